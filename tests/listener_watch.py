"""Every listener of a process tree while an end-to-end run is alive, each classified as it is seen.

The existing single run of each backend is watched (no extra runs): a thread samples the tree every
0.2 s (grpo.listeners) and keeps the union, each listener classified against the registry as it is
at that moment (a backend forgets its engines' registrations when it closes). A listener seen once
misbound stays a violation; one seen before its component registered it counts as accounted for
once it is seen registered.
"""

from __future__ import annotations

import threading

from grpo import listeners


class ListenerWatch:
    def __init__(self, *pids: int, interval_s: float = 0.2, ports: dict | None = None, processes: dict | None = None):
        self.pids, self.interval_s = pids, interval_s
        self.ports, self.processes = ports, processes  # None: the live registry of this process
        self.seen: dict[tuple, listeners.Listener] = {}  # (pid, kind, address, port) -> classified
        self.samples = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="listener-watch", daemon=True)

    def __enter__(self) -> "ListenerWatch":
        self.sample()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        self.sample()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        for pid in self.pids:
            for item in listeners.classify(listeners.listeners(pid), self.ports, self.processes):
                key = (item.pid, item.kind, item.address, item.port)
                old = self.seen.get(key)
                if old is None or (old.problem == "no component registered it" and not item.problem):
                    self.seen[key] = item
        self.samples += 1

    def purposes(self) -> set[str]:
        return {item.purpose for item in self.seen.values()}

    def assert_accounted(self, *purposes: str) -> None:
        """No violation; and (precondition: the watch saw the run) each of `purposes` was seen."""
        assert self.samples >= 2, f"the watch sampled {self.samples} times"
        bad = listeners.violations(list(self.seen.values()))
        assert not bad, "listeners bound where they must not be:\n" + "\n".join(map(str, bad))
        for purpose in purposes:
            assert any(purpose in p for p in self.purposes()), (
                f"no listener for {purpose!r} was seen; seen:\n" + "\n".join(map(str, self.seen.values())))
