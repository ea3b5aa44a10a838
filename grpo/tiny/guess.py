"""The guess task's warm-start check (task=guess, env=guess): the share of secrets the tiny model finds
in greedy episodes, played through the run's own episode driver on the model being warm-started. Here,
above the tasks and the rollout engine, so the task knows no engine: grpo/tiny/folders.py hands it to
the warm start."""

from __future__ import annotations

from grpo.envs.guess import GuessEnv
from grpo.rollout.base import Sampling
from grpo.rollout.episodes import Budget, EpisodeRunner
from grpo.rollout.hf import HFBackend
from grpo.rollout.render import RawRender


def solve_rate(model, tokenizer, samples: list, max_new_tokens: int, max_turns: int = 4) -> float:
    """Greedy episodes of `samples` against GuessEnv, through the episode driver on `model`."""
    backend = HFBackend(None, model, tokenizer)
    budget = Budget(max_turns, max_new_tokens, max_turns * (max_new_tokens + 4), 4, backend.max_context)
    runner = EpisodeRunner(GuessEnv, tokenizer, RawRender(tokenizer), budget, 10.0, backend.stop_ids, "guess")
    prompt_ids = [tokenizer(s.prompt).input_ids for s in samples]
    out = runner.run(backend.generate, prompt_ids, samples, 1, Sampling(max_new_tokens, temperature=0.0))
    return sum(e.finish == "stop" and e.env_reward == 1.0 for e in out.episodes) / len(samples)
