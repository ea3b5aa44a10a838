"""Every error a user can fix, in one leaf module: each message names what to change.

Raised anywhere (configs, data, devices, servers, clusters), caught in one place: `grpo.cli`
turns them into one `error: ...` line instead of a traceback. `did_you_mean` is the hint their
messages share for a mistyped setting.
"""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


class DatasetError(ValueError):
    """A malformed data row or file; the message names the file and the line or row."""


class DeviceError(ConfigError):
    """A device that is not there, or is taken by training."""


class TokenError(ConfigError):
    """A token file that cannot be used."""


class ClusterError(ConfigError):
    """The SLURM cluster cannot run this request; the message says what it has and what to change."""


class Unjudged(RuntimeError):
    """A task's answer check that could not decide (math-verify out of its time twice reading or comparing a
    completion, main thread only): evaluation counts the completion wrong and says how many (`eval/unjudged`)."""


class ServerError(RuntimeError):
    """A rollout server that cannot be reached or answers with an error (`status`: its HTTP code)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RewardStop(RuntimeError):
    """A reward that cannot go on (a judge that scores too few completions, refuses the token): the run
    stops instead of training on what little is scored."""


class EngineStartError(RuntimeError):
    """A vLLM engine that could not start, most often for memory."""


class WarmStartError(RuntimeError):
    """The tiny model's supervised warm start ended below its accuracy target; nothing was cached."""


class RunFolderError(RuntimeError):
    """The run folder is another live run's, or was removed or replaced while this run wrote to it."""


class HungCallsError(RuntimeError):
    """Too many calls of user code (rewards, environment steps, tools) still running past their timeout:
    threads Python cannot stop, which would otherwise pile up until the process can start no more."""


USER_ERRORS = (ConfigError, DatasetError, ServerError, RewardStop, EngineStartError, WarmStartError, RunFolderError,
               HungCallsError)


def did_you_mean(key: str, declared, prefix: str = "") -> str:
    """The setting of `declared` a mistyped `key` most likely meant (learning_rate -> lr by initials), as a
    hint for a message; else the settings there are."""
    initials = "".join(word[:1] for word in str(key).split("_"))
    close = difflib.get_close_matches(str(key), declared, n=1) or ([initials] if initials in declared else [])
    return f" (did you mean {prefix}{close[0]}?)" if close else f" (its settings: {', '.join(sorted(declared))})"
