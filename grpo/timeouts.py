"""One call of user code under a timeout: reward functions, environment steps, tools (leaf module)."""

from __future__ import annotations

import threading
from typing import Callable

from grpo.errors import HungCallsError

# Calls abandoned past their timeout and still running, in this process: a function that hangs for good
# on some inputs (4 abandoned a step) held 8,000 threads after 2,000 steps, until "can't start new thread".
MAX_HUNG = 256
_hung: list[tuple[threading.Thread, str]] = []  # each with the setting it ran past
_hung_lock = threading.Lock()


def check_hung() -> None:
    """Raises HungCallsError when MAX_HUNG abandoned calls are still running (those that ended are forgotten),
    naming the setting most of them ran past."""
    with _hung_lock:
        _hung[:] = [(t, s) for t, s in _hung if t.is_alive()]
        if len(_hung) >= MAX_HUNG:
            settings = [s for _, s in _hung]
            setting = max(set(settings), key=settings.count)
            raise HungCallsError(
                f"{len(_hung)} calls of user code are still running past their timeout ({settings.count(setting)} of "
                f"them past {setting}); "
                f"Python cannot stop a thread, so each one hung for good is kept, and the run stops before the process "
                f"runs out of threads. The warnings above name the inputs it hung on: fix the code that hangs there, "
                f"or raise {setting} if it only needs longer.")


def call_with_timeout(fn: Callable, timeout_s: float, setting: str, reraise: tuple = (), stop_if_hung: bool = True):
    """(fn(), None) or (None, "what went wrong"); a call past `timeout_s` is abandoned (a daemon thread:
    Python cannot kill it) and its error names `setting`. Exceptions of the types in `reraise` are
    raised here instead (a setup mistake that must stop the run), and HungCallsError when too many earlier
    calls are still running past theirs (`check_hung`), unless `stop_if_hung` is False: an environment's
    calls, made while the engines generate on one rank alone, are counted and stopped at scoring instead,
    where every rank stops together (grpo.rewards.score)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except reraise as e:
            box["fatal"] = e
        except Exception as e:  # noqa: BLE001 - reported to the caller, who decides what it costs
            box["error"] = f"{type(e).__name__}: {e}"
        except BaseException as e:  # noqa: BLE001 - sys.exit() in user code: its thread ends, not the run; an error, not a None result
            box["error"] = f"{type(e).__name__}({e!r}) raised: user code must return or raise an Exception"

    if stop_if_hung:
        check_hung()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        with _hung_lock:
            _hung.append((t, setting))
        return None, f"no answer within {setting}={timeout_s:g}s"
    if "fatal" in box:
        raise box["fatal"]
    return box.get("value"), box.get("error")
