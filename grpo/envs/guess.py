"""Guess the number: the environment holds a secret s in 1..N (the sample's answer) and answers each
guess with "<" (the secret is lower), ">" (higher) or ends the episode on a hit, reward 1.

The prompt is the same for every secret, so a policy that ignores the observations says one fixed
sequence of guesses and, within 4 turns, can hit at most 4 of the 15 secrets (0.267): a greedy solve
rate above that shows the policy reads the observation tokens put between its turns. Binary search
hits all 15 in 49 / 15 = 3.27 guesses on average.

Shaping, off by default (`env.kwargs`, e.g. `+env.kwargs.miss_reward=-0.1 +env.kwargs.narrow_reward=0.2`):
each miss's step gets `miss_reward`, plus `narrow_reward` x the share of the still-possible secrets
(those consistent with every earlier answer) that the guess's answer rules out (a guess outside the
interval rules out none; binary search's rules out about half). Per-turn credit (algo.turn_rewards)
gives each turn its own step's reward; the default sums them into the episode's.
"""

from __future__ import annotations

from grpo.envs.base import Step, TextEnv
from grpo.errors import ConfigError

LOWER, HIGHER = "<", ">"  # one character each: the tiny model's tokenizer is character-level


def parse_guess(action: str) -> int | None:
    text = action.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 4 else None  # "²".isdigit() too


class GuessEnv(TextEnv):
    def __init__(self, invalid: str = "?", miss_reward: float = 0.0, narrow_reward: float = 0.0, high: int = 15):
        self.invalid = invalid  # the observation after a turn that is not a number
        self.miss_reward, self.narrow_reward, self.high = miss_reward, narrow_reward, high

    def reset(self, sample, seed: int):
        super().reset(sample, seed)
        self.secret = int(sample.answer)
        if not 1 <= self.secret <= self.high:  # shaping's count of the secrets left would go past 1, or below 0
            raise ConfigError(f"env.kwargs.high={self.high}: the task's secret {self.secret} is outside 1..{self.high}; "
                              f"set env.kwargs.high to the task's largest secret (task=guess: 15) or more.")
        self.low_s, self.high_s = 1, self.high  # the secrets consistent with the answers so far
        return None

    def step(self, action: str) -> Step:
        guess = parse_guess(action)
        if guess is None:
            return Step(self.invalid, self.miss_reward, False, {"invalid": True})
        if guess == self.secret:
            return Step(None, 1.0, True)
        before = self.high_s - self.low_s + 1
        if self.secret < guess:
            self.high_s = min(self.high_s, guess - 1)
        else:
            self.low_s = max(self.low_s, guess + 1)
        ruled_out = (before - (self.high_s - self.low_s + 1)) / before
        return Step(LOWER if self.secret < guess else HIGHER, self.miss_reward + self.narrow_reward * ruled_out, False)


def binary_search_turns(secret: int, low: int = 1, high: int = 15) -> list[tuple[str, str | None]]:
    """The (guess, observation) turns binary search plays against `secret`; the last observation is
    None (the hit). The guess task's warm start trains on these, actions only."""
    turns = []
    while True:
        mid = (low + high) // 2
        if mid == secret:
            return turns + [(str(mid), None)]
        turns.append((str(mid), LOWER if secret < mid else HIGHER))
        low, high = (low, mid - 1) if secret < mid else (mid + 1, high)
