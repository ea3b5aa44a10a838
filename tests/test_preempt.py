"""SIGTERM outside SLURM: the run finishes its step, checkpoints, stops; started again, it resumes
with every step logged once. (Under SLURM it also requeues itself: tests/test_slurm.py.)"""

import json
import signal
import time

from tests.test_checkpoint import run_train


def steps_logged(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def test_sigterm_checkpoints_after_the_step_and_resumes(tmp_path, cache_dir):
    run_dir, args = tmp_path / "run", ["steps=200", "checkpoint_every=0"]
    victim = run_train(run_dir, cache_dir, *args)
    deadline = time.time() + 300
    while max(steps_logged(run_dir), default=0) < 3 and time.time() < deadline and victim.poll() is None:
        time.sleep(0.05)
    victim.send_signal(signal.SIGTERM)
    out, _ = victim.communicate(timeout=120)
    assert victim.returncode == 143, out
    stopped = int((run_dir / "checkpoints" / "latest").read_text().split("_")[1])
    assert 3 <= stopped < 200 and f"stopped after step {stopped} on a signal; checkpoint written" in out
    assert steps_logged(run_dir)[-1] == stopped  # the step in progress was finished, not cut

    resumed = run_train(run_dir, cache_dir, "steps=12" if stopped < 12 else f"steps={stopped + 2}", "checkpoint_every=0")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == stopped
    assert steps_logged(run_dir) == [0, *range(1, summary["steps"] + 1), summary["steps"]]
