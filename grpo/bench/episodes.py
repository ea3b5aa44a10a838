"""`python -m grpo.bench episodes`: multi-turn training on a long-tailed agentic workload through
rollout=remote with two local `grpo.serve` servers, scheduled three ways:

    turns         every trajectory waits at each turn for the batch's slowest (rollout.schedule=turns)
    trajectories  each sends its next turn as soon as its environment answers (grpo/rollout/trajectories.py)
    partial       per trajectory, and a weight push waits only for the turns in flight (algo.partial_rollouts)

The workload (`LongTailGuess`): the guess game of experiment=guess_tiny (its warm-started tiny model)
with a turn cap drawn per episode from a long tail (most episodes 1-2 turns, one in twenty 12) and a
tool latency on every step (50 ms). All three run with algo.max_staleness=1, so the servers can
generate while the trainer updates. Per setting, over the steps after the first: episodes per second
(batch / step time), the engines' idle fraction (1 - seconds with a request of ours in flight / (servers
x step time)), the trainer's wait for its batch, and the batch's versions (partial rollouts).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import time

from grpo.bench.runs import QUIET, compose, metrics_rows, served
from grpo.envs.base import Step
from grpo.envs.guess import GuessEnv
from grpo.tiny.folders import resolve_model_folder
from grpo.train import train

SETTINGS = {
    "turns": ["rollout.schedule=turns"],
    "trajectories": ["rollout.schedule=trajectories"],
    "partial": ["rollout.schedule=trajectories", "algo.partial_rollouts=true"],
}


class LongTailGuess(GuessEnv):
    """The guess game with a turn cap per episode, drawn from a Pareto tail by the reset seed (P(cap >= k)
    = k^-tail, at most `max_cap`), and every step taking `latency_ms` first, as a tool call would."""

    def __init__(self, latency_ms: float = 50.0, max_cap: int = 12, tail: float = 1.2, **kwargs):
        super().__init__(**kwargs)
        self.latency_s, self.max_cap, self.tail = latency_ms / 1000, max_cap, tail

    def reset(self, sample, seed: int):
        self.cap = min(self.max_cap, int(random.Random(seed).paretovariate(self.tail)))
        self.turn = 0
        return super().reset(sample, seed)

    def step(self, action: str) -> Step:
        time.sleep(self.latency_s)
        self.turn += 1
        step = super().step(action)
        if not step.done and self.turn >= self.cap:  # this episode's cap: it ends here, unsolved
            return Step(None, step.reward, True, {**step.info, "capped": True})
        return step


def workload(latency_ms: float, batch: int, steps: int) -> list[str]:
    return ["experiment=guess_tiny", "env.name=grpo.bench.episodes.LongTailGuess", "env.max_turns=12",
            f"+env.kwargs.latency_ms={latency_ms}", f"algo.batch_size={batch}", f"steps={steps}", "eval_every=0",
            "algo.max_staleness=1", "export_model=false", *QUIET]


def bench_episodes(steps: int, batch: int, latency_ms: float, settings: list[str], extra: list[str]) -> list[dict]:
    common = workload(latency_ms, batch, steps) + list(extra)
    model = resolve_model_folder(compose(common + ["run_dir=unused"]))  # the guess warm start, built once
    rows = []
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(served(model)) for _ in range(2)]
        for name in settings:
            run_dir = tempfile.mkdtemp(prefix=f"bench-episodes-{name}-")
            print(f"bench: episodes, {name}, {steps} steps of {batch} episodes", flush=True)
            t0 = time.perf_counter()
            train(compose([*common, "rollout=remote", f"rollout.remote.urls=[{','.join(urls)}]", *SETTINGS[name],
                           f"run_dir={run_dir}"]))
            timed = metrics_rows(run_dir)[:-1]  # the last step waits for no next batch
            mean = lambda key: statistics.mean(r[key] for r in timed)  # noqa: E731
            step_s = mean("step_s")
            rows.append({"setting": name, "steps_timed": len(timed), "episodes_per_s": batch / step_s, "step_s": step_s,
                         "engine_idle": 1 - mean("time/engine_busy_s") / (len(urls) * step_s),
                         "trainer_wait_s": mean("time/wait_for_data_s"), "turns_mean": mean("episode/turns_mean"),
                         "turns_max": max(r["episode/turns_max"] for r in timed),
                         "versions_max": max(r.get("episode/versions_max", 1) for r in timed),
                         "mixed_versions": mean("episode/mixed_versions"), "wall_s": time.perf_counter() - t0})
    base = next((r["episodes_per_s"] for r in rows if r["setting"] == "turns"), None)
    for r in rows:
        r["vs_turns"] = r["episodes_per_s"] / base if base else ""
    return rows


def bench_learning(steps: int, settings: list[str], extra: list[str]) -> list[dict]:
    """experiment=guess_tiny itself (the plain guess game, 4 turns) on rollout=remote with one server,
    algo.max_staleness=1, per setting: the held-out solve rate before and after `steps` steps."""
    common = ["experiment=guess_tiny", "algo.max_staleness=1", f"steps={steps}", "export_model=false", *QUIET, *extra]
    rows = []
    with served(resolve_model_folder(compose(common + ["run_dir=unused"]))) as url:
        for name in settings:
            run_dir = tempfile.mkdtemp(prefix=f"bench-episodes-learn-{name}-")
            print(f"bench: learning, {name}, {steps} steps of experiment=guess_tiny", flush=True)
            summary = train(compose([*common, "rollout=remote", f"rollout.remote.urls=[{url}]", *SETTINGS[name],
                                     f"run_dir={run_dir}"]))
            rows.append({"setting": name, "steps": steps, "eval_before": summary["eval_before"],
                         "eval_after": summary["eval_after"], "eval_gain": summary["eval_gain"], "wall_s": summary["wall_s"]})
    return rows


def report_episodes(steps: int, batch: int, latency_ms: float, settings: list[str], overrides: list[str],
                    learn_steps: int = 0, learn_settings: list[str] = ()) -> tuple[dict, list]:
    rows = bench_episodes(steps, batch, latency_ms, settings, overrides) if steps else []
    cols = ["setting", "episodes_per_s", "vs_turns", "step_s", "engine_idle", "trainer_wait_s", "turns_mean", "turns_max",
            "versions_max", "mixed_versions", "steps_timed", "wall_s"]
    sections = [(f"long-tailed guess episodes ({latency_ms:g} ms tool, turn caps up to 12), "
                 f"{batch} per step, rollout=remote on 2 servers, algo.max_staleness=1 "
                 "(means over the steps after the first, the last left out)", rows, cols)] if rows else []
    learning = bench_learning(learn_steps, list(learn_settings), overrides) if learn_steps else []
    if learning:
        sections.append((f"experiment=guess_tiny on rollout=remote (one server), algo.max_staleness=1, {learn_steps} steps: "
                         "greedy held-out solve rate", learning, ["setting", "steps", "eval_before", "eval_after", "eval_gain",
                                                                   "wall_s"]))
    return {"episodes": rows, "learning": learning}, sections
