"""The wait progress line: one per interval, naming what is awaited, the time so far and the limit."""

from grpo.progress import WaitProgress


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_one_line_per_interval_with_elapsed_and_limit():
    clock, lines = FakeClock(), []
    tick = WaitProgress("vLLM engine at 127.0.0.1:8000 to answer /health", 600, log=lines.append, every_s=15,
                        note="log: /tmp/e.log", clock=clock)
    for t in (1, 14.9):  # polls before the first interval: silent
        clock.now = 100 + t
        tick()
    assert lines == []
    for t in (15, 16, 29, 31):  # one line at 15 s, the next at the first poll 15 s after it (31 s), none between
        clock.now = 100 + t
        tick()
    assert lines == ["waiting for vLLM engine at 127.0.0.1:8000 to answer /health: 15 s of 600 s; log: /tmp/e.log",
                     "waiting for vLLM engine at 127.0.0.1:8000 to answer /health: 31 s of 600 s; log: /tmp/e.log"]


def test_silent_without_a_log():
    clock = FakeClock()
    tick = WaitProgress("x", 10, log=None, every_s=1, clock=clock)
    clock.now += 5
    tick()  # nothing to call, nothing raised
    assert tick.elapsed() == 5
