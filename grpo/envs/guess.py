"""Guess the number: the environment holds a secret s in 1..N (the sample's answer) and answers each
guess with "<" (the secret is lower), ">" (higher) or ends the episode on a hit, reward 1.

The prompt is the same for every secret, so a policy that ignores the observations says one fixed
sequence of guesses and, within 4 turns, can hit at most 4 of the 15 secrets (0.267): a greedy solve
rate above that shows the policy reads the observation tokens put between its turns. Binary search
hits all 15 in 49 / 15 = 3.27 guesses on average.
"""

from __future__ import annotations

from grpo.envs.base import Step, TextEnv

LOWER, HIGHER = "<", ">"  # one character each: the tiny model's tokenizer is character-level


def parse_guess(action: str) -> int | None:
    text = action.strip()
    return int(text) if text.isdigit() and len(text) <= 4 else None


class GuessEnv(TextEnv):
    def __init__(self, invalid: str = "?"):
        self.invalid = invalid  # the observation after a turn that is not a number

    def reset(self, sample, seed: int):
        super().reset(sample, seed)
        self.secret = int(sample.answer)
        return None

    def step(self, action: str) -> Step:
        guess = parse_guess(action)
        if guess is None:
            return Step(self.invalid, 0.0, False, {"invalid": True})
        if guess == self.secret:
            return Step(None, 1.0, True)
        return Step(LOWER if self.secret < guess else HIGHER, 0.0, False)


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
