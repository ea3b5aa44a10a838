"""What a long wait is waiting for, said as it goes: one line every `every_s` seconds (REVIEW 5.3).

Engine starts, server health checks, the bench's and doctor's servers and `grpo.launch`'s wait for
the server job can each take minutes; without this they are minutes of silence. The loop that waits
calls its `WaitProgress` on every poll; the line names what is awaited, the time so far against the
limit, and where to look (an engine's log)."""

from __future__ import annotations

import time


def say(text: str) -> None:
    print(text, flush=True)


class WaitProgress:
    """Call on every poll of a wait: logs "waiting for WHAT: 30 s of 600 s; NOTE" once `every_s` has
    passed since the start or the last line, nothing in between. `log=None`: silent (ranks that
    wait beside the one that reports)."""

    def __init__(self, what: str, timeout_s: float, log=say, every_s: float = 15.0, note: str = "",
                 clock=time.monotonic):
        self.what, self.timeout_s, self.log, self.every_s, self.note, self.clock = what, timeout_s, log, every_s, note, clock
        self.start = clock()
        self.next = self.start + every_s

    def elapsed(self) -> float:
        return self.clock() - self.start

    def __call__(self) -> None:
        now = self.clock()
        if self.log is None or now < self.next:
            return
        self.next = now + self.every_s
        self.log(f"waiting for {self.what}: {now - self.start:.0f} s of {self.timeout_s:.0f} s"
                 + (f"; {self.note}" if self.note else ""))
