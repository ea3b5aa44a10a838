"""Any task with a second chance: a wrong answer gets `message` as the observation and the policy
tries again, up to the turn cap; a right one (the task's `is_correct`) ends the episode with
reward 1. The task's reward functions score the final turn as usual."""

from __future__ import annotations

from grpo.envs.base import Step, TextEnv


class RetryEnv(TextEnv):
    def __init__(self, is_correct, message: str = " wrong, try again: "):
        self.is_correct, self.message = is_correct, message

    def step(self, action: str) -> Step:
        if self.is_correct(action, self.sample):
            return Step(None, 1.0, True)
        return Step(self.message, 0.0, False)
