"""Two ranks save one checkpoint, rank 1 slow to write its state (a busy node, a slow file system), for
tests/test_checkpoint.py.

    torchrun --nproc_per_node 2 tests/checkpoint_race.py RUN_DIR [leftover]

Rank 1 starts writing only once rank 0's save has published the checkpoint, or 3 s after it began: the
checkpoint published must still hold both ranks' states. With `leftover`: a killed save's temporary
folder is there already, and rank 0 takes 1 s to remove it: rank 1 must not write into it meanwhile
(rank 0 would then remove rank 1's state and publish without it). Each rank writes
RUN_DIR/returned_rank<r>.json (the folder save_checkpoint returned) once it has.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo import checkpoint, dist  # noqa: E402


class Nothing:
    """A strategy whose own files are not the point."""

    def save(self, folder: str) -> None:
        pass


def slowed_rng_state(real=checkpoint.rng_state):
    if dist.rank() == 1:
        tmp = os.path.join(sys.argv[1], "checkpoints", f".tmp-{checkpoint.checkpoint_name(1)}")
        deadline = time.monotonic() + 3.0
        while os.path.isdir(tmp) and time.monotonic() < deadline:  # gone: rank 0 published without rank 1
            time.sleep(0.05)
    return real()


def slowed_rmtree(path, *args, real=checkpoint.shutil.rmtree, **kwargs):
    if os.path.basename(path).startswith(".tmp-"):
        time.sleep(1.0)
    return real(path, *args, **kwargs)


def main(run_dir: str, mode: str) -> None:
    dist.init_distributed(dist.dist_info(), timeout_s=60)  # a rank left waiting in a barrier fails within a minute
    if mode == "leftover":
        if dist.rank() == 0:
            checkpoint.shutil.rmtree = slowed_rmtree  # this process's shutil: rank 1's is its own
    else:
        checkpoint.rng_state = slowed_rng_state
    path = checkpoint.save_checkpoint(run_dir, 1, Nothing(), {"data": dist.rank()})
    with open(os.path.join(run_dir, f"returned_rank{dist.rank()}.json"), "w") as f:
        json.dump(path, f)
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "slow_rank1")
    # as tests/ddp_step.py's exit_process: gloo on torch 2.13 sometimes aborts in C++ destructors at exit
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
