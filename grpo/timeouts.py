"""One call of user code under a timeout: reward functions, environment steps, tools (leaf module)."""

from __future__ import annotations

import threading
from typing import Callable


def call_with_timeout(fn: Callable, timeout_s: float, setting: str, reraise: tuple = ()):
    """(fn(), None) or (None, "what went wrong"); a call past `timeout_s` is abandoned (a daemon thread:
    Python cannot kill it) and its error names `setting`. Exceptions of the types in `reraise` are
    raised here instead (a setup mistake that must stop the run)."""
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

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return None, f"no answer within {setting}={timeout_s:g}s"
    if "fatal" in box:
        raise box["fatal"]
    return box.get("value"), box.get("error")
