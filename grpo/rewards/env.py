from __future__ import annotations


def env_reward(completions: list[str], samples: list, env_rewards=None, **_) -> list:
    """The environment's own reward for each episode (the sum its steps gave; None where it gave none)."""
    if env_rewards is None:
        raise ValueError("reward `env` needs an environment (env=guess, ...): the trainer passes env_rewards then")
    return list(env_rewards)
