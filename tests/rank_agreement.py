"""What one rank learned alone, every rank must act on, for tests/test_preempt.py.

    torchrun --nproc_per_node 2 tests/rank_agreement.py OUT RUN_DIR

Rank 1 alone gets the time-limit warning (SIGUSR1): StopSignal.requested() must say stop, and requeue, on
every rank. Then every rank enters hold_run_folder(RUN_DIR), whose .lock another process (the test) holds:
every rank must refuse it. Writes OUT/rank<r>.json: {"requested", "requeue", "refused"} (the RunFolderError's
message, or None where the rank went on).
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo import dist  # noqa: E402
from grpo.preempt import StopSignal  # noqa: E402
from grpo.run_lock import RunFolderError, hold_run_folder  # noqa: E402


def main(out: str, run_dir: str) -> None:
    dist.init_distributed(dist.dist_info())
    rank = dist.rank()
    stop = StopSignal()
    if rank == 1:
        signal.raise_signal(signal.SIGUSR1)  # handled before raise_signal returns
    seen = {"requested": stop.requested(), "requeue": stop.requeue, "refused": None}
    stop.close()
    try:
        with hold_run_folder(run_dir, is_main=rank == 0):
            pass
    except RunFolderError as e:
        seen["refused"] = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # as tests/ddp_step.py's exit_process: gloo on torch 2.13 sometimes aborts in C++ destructors at exit
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
