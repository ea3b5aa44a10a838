from __future__ import annotations

UNFINISHED = ("length", "turns")  # the policy ran out of tokens or turns: the environment never judged the answer


def env_reward(completions: list[str], samples: list, env_rewards=None, finish_reasons=None, **_) -> list:
    """The environment's own reward for each episode: the sum its steps gave. An episode the policy left
    unfinished (`length`: cut at max_new_tokens or out of token budget; `turns`: out of turns) before any
    step rewarded it scores 0, as the same episode cut one turn later after a 0-reward miss does: without
    it a first turn that rambles past max_new_tokens would be excluded (every function abstaining is NaN),
    never penalised (`algo.mask_truncated` is the switch that drops cut episodes). None (abstains) where a
    finished episode got no reward; an `error` episode's None is withheld by the trainer."""
    if env_rewards is None:
        raise ValueError("reward `env` needs an environment (env=guess, ...): the trainer passes env_rewards then")
    if finish_reasons is None:
        return list(env_rewards)
    return [0.0 if r is None and f in UNFINISHED else r for r, f in zip(env_rewards, finish_reasons, strict=True)]
