"""What an environment is: one instance per trajectory, text in and text out.

    env = make_env(sample)            # built from the config and the task's sample, in any process
    text = env.reset(sample, seed)    # optional text shown before the first turn (None: nothing)
    step = env.step(action_text)      # the policy's turn, decoded -> Step(observation, reward, done, info)
    env.close()

The episode driver (grpo/rollout/episodes.py) calls `step` once per policy turn, with the turn's
text (special tokens removed), under `env.step_timeout_s`. It calls a batch's instances from several
threads at once (`env.max_concurrency`), each instance one call at a time (only a `close` may come
while a call abandoned at its timeout still runs). The observation is tokenized and put in the
sequence with loss mask 0; the episode's environment reward is the sum of the rewards its steps
gave (None when no step gave one), and enters the loss through the `env` reward function
(grpo/rewards/__init__.py) with its weight, like any other reward. With `algo.turn_rewards` each
step's reward (times that weight) is its own turn's instead (docs/algorithm.md, per-turn credit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional, Protocol


@dataclass
class Step:
    observation: Optional[str] = None  # shown to the policy before its next turn; ignored when done
    reward: Optional[float] = None  # this step's reward (None: none given)
    done: bool = False  # the episode ends here (the environment's own end: finish reason "stop")
    info: dict = field(default_factory=dict)  # e.g. {"tool_call": True, "tool_error": "..."}: counted in the metrics


class Env(Protocol):
    def reset(self, sample, seed: int) -> Optional[str]: ...

    def step(self, action: str) -> Step: ...

    def close(self) -> None: ...


class TextEnv(ABC):
    """A base with nothing to reset or close; subclasses write `step`."""

    def reset(self, sample, seed: int) -> Optional[str]:
        self.sample = sample
        return None

    @abstractmethod
    def step(self, action: str) -> Step:
        """The policy's turn, as text -> what the environment answers."""

    def close(self) -> None:
        pass
