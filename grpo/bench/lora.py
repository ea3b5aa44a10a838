"""`python -m grpo.bench lora`: LoRA against full fine-tuning on smollm2-135m: step time, step memory,
and the sync into a colocated engine (bytes, seconds, the first generation after it). Each mode runs
in a fresh process of this module (`python -m grpo.bench.lora MODE OUT`), so each starts from the
same resting memory."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import torch
from omegaconf import OmegaConf

from grpo.batch import collate
from grpo.bench.memory import PeakRSS
from grpo.bench.runs import compose
from grpo.config import AlgoConfig
from grpo.dist import DistInfo
from grpo.models import build_policy
from grpo.parallel.single import SingleStrategy
from grpo.rollout import Sampling, build_rollout
from grpo.rollout.base import Rollouts
from grpo.tiny.folders import resolve_on_node
from grpo.update.forward import batch_logprobs


def lora_worker(mode: str, out: str, rows: int = 8, prompt: int = 64, completion: int = 64, steps: int = 3) -> None:
    """`model=smollm2-135m`, full fine-tuning (mode `full`) or a rank-16 LoRA adapter (`lora`), in its
    own process: the median time and the peak memory (above the resting state after loading) of a
    training step (forward + backward of the policy loss on rows x (prompt + completion) tokens, then
    AdamW), then the sync into a colocated vLLM engine: the bytes sent, `update_weights`' seconds,
    and the first generation after it (where vLLM loads an adapter)."""
    cfg = compose(["model=smollm2-135m", "rollout=colocated", "run_dir=unused", "rollout.vllm.max_model_len=256",
                   *(["model.lora.rank=16", "model.lora.alpha=32"] if mode == "lora" else [])])
    path = resolve_on_node(cfg, DistInfo(), log=lambda *_: None)
    model, tok = build_policy(cfg, path, DistInfo(), log=lambda *_: None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (prompt,), generator=g).tolist() for _ in range(rows)]
    done = [torch.randint(100, 40000, (completion,), generator=g).tolist() for _ in range(rows)]
    batch = collate(prompts, Rollouts(done, [[0.0] * completion] * rows, ["length"] * rows, 0), torch.ones(rows),
                    tok.pad_token_id, False)
    strategy = SingleStrategy(cfg.parallel, model, OmegaConf.structured(AlgoConfig(lr=1e-5, warmup_steps=0)), 100)
    times = []
    with PeakRSS() as mem:
        for _ in range(steps):
            t0 = time.perf_counter()
            logp, _ = batch_logprobs(strategy.model, batch, 1.0)
            strategy.backward(-logp.mean())
            strategy.step()
            times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as run_dir:
        rollout = build_rollout(cfg.rollout, strategy.model, tok, path, run_dir=run_dir)
        nbytes = sum(t.numel() * t.element_size() for b in strategy.weight_buckets(64 * 2**20) for _, t in b)
        syncs, firsts = [], []
        for version in range(1, 4):
            t0 = time.perf_counter()
            rollout.update_weights(strategy.weight_buckets(64 * 2**20), version=version)
            t1 = time.perf_counter()
            rollout.generate([prompts[0]], 1, Sampling(max_new_tokens=1, temperature=0.0))
            syncs.append(t1 - t0)
            firsts.append(time.perf_counter() - t1)
        rollout.close()
    with open(out, "w") as f:
        json.dump({"mode": mode, "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                   "step_s": sorted(times)[len(times) // 2], "step_peak_above_rest_mb": mem.peak_above_mb,
                   "sync_mb": nbytes / 2**20, "sync_s": sorted(syncs)[1], "first_generate_after_sync_s": sorted(firsts)[1]}, f)


def bench_lora() -> list[dict]:
    rows = []
    for mode in ("full", "lora"):
        print(f"bench: smollm2-135m, {mode}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, "-m", "grpo.bench.lora", mode, f.name], check=True)
            rows.append(json.load(open(f.name)))
    return rows


def report_lora() -> tuple[dict, list]:
    rows = bench_lora()
    return {"lora": rows}, [
        ("smollm2-135m: full fine-tuning vs LoRA rank 16 (all 7 projections); step on 8 x (64 + 64) tokens, "
         "sync into a colocated vLLM engine (median of 3)", rows,
         ["mode", "trainable_params", "step_s", "step_peak_above_rest_mb", "sync_mb", "sync_s", "first_generate_after_sync_s"])]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo.bench.lora",
                                     description="One mode's measurement in a fresh process; "
                                                 "`python -m grpo.bench lora` runs one per mode.")
    parser.add_argument("mode", choices=["full", "lora"])
    parser.add_argument("out", help="the JSON file the row is written to")
    args = parser.parse_args()
    lora_worker(args.mode, args.out)
