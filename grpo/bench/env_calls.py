"""`python -m grpo.bench env-calls`: one turn of episodes whose environment step takes a fixed time,
with the environments called one after another and `env.max_concurrency` at once
(grpo/rollout/episodes.py, `EnvCalls`). The policy is a script (every turn "8" and <eos>, no model),
so the wall time is the driver's and the environments'."""

from __future__ import annotations

import time

from grpo.envs.base import Step, TextEnv
from grpo.rollout.base import Rollouts, Sampling
from grpo.rollout.episodes import Budget, EpisodeRunner
from grpo.rollout.render import RawRender
from grpo.tasks.base import Sample
from grpo.tiny.text import build_char_tokenizer


class Sleeps(TextEnv):
    """A tool that answers after `step_s` and ends the episode: one turn."""

    def __init__(self, step_s: float):
        self.step_s = step_s

    def step(self, action: str) -> Step:
        time.sleep(self.step_s)
        return Step(None, 1.0, True)


def bench_env_calls(trajectories: int, step_ms: float, concurrency: list[int]) -> list[dict]:
    tok = build_char_tokenizer()
    turn = tok("8", add_special_tokens=False).input_ids + [tok.eos_token_id]

    def generate(prompt_ids, n, sampling):
        rows = len(prompt_ids) * n
        return Rollouts([list(turn)] * rows, [[0.0] * len(turn)] * rows, ["stop"] * rows, 0)

    group = 8
    samples = [Sample("Guess 1-15:", "8")] * (trajectories // group)
    prompts = [tok(s.prompt).input_ids for s in samples]
    rows = []
    for c in concurrency:
        runner = EpisodeRunner(lambda: Sleeps(step_ms / 1000), tok, RawRender(tok), Budget(1, 4, 8, 4), 60.0,
                               [tok.eos_token_id], "sleeps", max_concurrency=c)
        t0 = time.perf_counter()
        out = runner.run(generate, prompts, samples, group, Sampling(4))
        wall = time.perf_counter() - t0
        assert [e.finish for e in out.episodes] == ["stop"] * len(samples) * group
        rows.append({"max_concurrency": c, "trajectories": len(out.episodes), "step_ms": step_ms, "wall_s": wall,
                     "env_s_summed": sum(e.env_s for e in out.episodes), "vs_serial": None})
    serial = next((r["wall_s"] for r in rows if r["max_concurrency"] == 1), None)
    for r in rows:
        r["vs_serial"] = serial / r["wall_s"] if serial else ""
    return rows


def report_env_calls(trajectories: int, step_ms: float, concurrency: list[int]) -> tuple[dict, list]:
    rows = bench_env_calls(trajectories, step_ms, concurrency)
    return {"env_calls": rows}, [(f"one turn of {rows[0]['trajectories']} episodes, a {step_ms:g} ms environment step "
                                  "(env.max_concurrency=1: one after another)", rows,
                                  ["max_concurrency", "trajectories", "step_ms", "wall_s", "env_s_summed", "vs_serial"])]
