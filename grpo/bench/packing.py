"""`python -m grpo.bench update-packing`: the update phase padded against packed (`algo.packing`)
against packed with each prompt once per tree of its completions (`algo.shared_prompt`), on SmolLM2-135M with a realistic spread of lengths, each mode in a fresh process of this module
(`python -m grpo.bench.packing MODE OUT ...`) so each starts from the same resting memory.

The workload: `--prompts` prompts of 40-160 tokens, `--group` completions each, of 4 to 400 tokens
(log-uniform: most short, a few long, as sampled completions are), random token ids, seeded; the
same batch in every mode. One `policy_update` (forward, backward, AdamW step; the default algo,
micro-batches of `algo.micro_batch_tokens`) after an untimed warm-up update on two sequences.
Reported: update seconds, completion tokens per second, the tokens the model's forward saw
(padding included), the peak resident memory above the process's rest, and the loss and gradient
norm (equal in every mode: the same update).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
from omegaconf import OmegaConf

from grpo.batch import collate
from grpo.bench.memory import ALLOCATOR, PeakRSS
from grpo.config import AlgoConfig, ParallelConfig
from grpo.models import load_model
from grpo.packaged import ensure_packaged_model
from grpo.parallel.single import SingleStrategy
from grpo.rollout.base import Rollouts
from grpo.update import policy_update
from grpo.update.layouts import micro_batches, pack, pack_shared
from grpo.update.support import LAYOUTS


def spread_workload(prompts: int, group: int, vocab: int, seed: int = 0):
    """(prompt ids per completion, Rollouts, advantages_B): the length-spread batch."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids, completions = [], []
    for _ in range(prompts):
        prompt = torch.randint(3, vocab, (int(torch.randint(40, 161, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group):
            n = round(math.exp(math.log(4) + (math.log(400) - math.log(4)) * float(torch.rand(1, generator=g))))
            prompt_ids.append(prompt)
            completions.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    logps = [(-torch.rand(len(c), generator=g)).tolist() for c in completions]
    reasons = ["length" if len(c) == 400 else "stop" for c in completions]
    return prompt_ids, Rollouts(completions, logps, reasons, 0), torch.randn(len(completions), generator=g)


def forward_tokens(batch, max_tokens: int, layout: str) -> int:
    """Tokens the model's forward passes see, padding included."""
    total = 0
    for mb in micro_batches(batch, max_tokens, layout):
        b = mb.batch
        if layout == "padded":
            total += b.input_ids_BL.numel()
        elif layout == "packed":
            total += pack(b.input_ids_BL, b.attention_mask_BL, b.prompt_width, mb.groups).input_ids_RW.numel()
        else:
            total += pack_shared(b.input_ids_BL, b.attention_mask_BL, b.prompt_width, mb.groups).input_ids_RW.numel()
    return total


def update_worker(mode: str, out: str, layers: int, prompts: int, group: int) -> None:
    torch.manual_seed(0)
    model, tok = load_model(ensure_packaged_model("smollm2-135m", os.environ.get("GRPO_CACHE", "~/.cache/grpo")))
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.train()
    prompt_ids, rollouts, adv = spread_workload(prompts, group, len(tok))
    batch = collate(prompt_ids, rollouts, adv, tok.pad_token_id, mask_truncated=False)
    algo = OmegaConf.structured(AlgoConfig(batch_size=prompts * group, group_size=group, warmup_steps=0,
                                           packing=mode != "padded", shared_prompt=mode == "shared"))
    strategy = SingleStrategy(OmegaConf.structured(ParallelConfig(strategy="single")), model, algo, total_steps=2)
    warm = batch.select(slice(0, 2))
    warm_algo = OmegaConf.merge(algo, {"group_size": 2, "batch_size": 2})
    policy_update(strategy, warm, warm_algo, 400, 1.0)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        stats = policy_update(strategy, batch, algo, 400, 1.0)
        seconds = time.perf_counter() - t0
    completion_tokens = int(batch.mask_BT.sum())
    with open(out, "w") as f:
        json.dump({"mode": mode, "update_s": seconds, "completion_tok_per_s": completion_tokens / seconds,
                   "completions": batch.size, "completion_tokens": completion_tokens,
                   "sequence_tokens": int(batch.attention_mask_BL.sum()),
                   "forward_tokens": forward_tokens(batch, algo.micro_batch_tokens, mode),
                   "peak_above_rest_mb": mem.peak_above_mb, "loss": stats["loss"], "grad_norm": stats["grad_norm"],
                   "layers": layers, "threads": torch.get_num_threads()}, f)


def bench_update_packing(layers: int, prompts: int, group: int, repeats: int) -> list[dict]:
    rows = []
    for r in range(repeats):  # modes alternate, so a change in the machine's load falls on both
        for mode in LAYOUTS:
            print(f"bench: update-packing {mode} (repeat {r + 1} of {repeats})", flush=True)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, "-m", "grpo.bench.packing", mode, f.name, str(layers), str(prompts),
                                str(group)], check=True, env={**os.environ, **ALLOCATOR})
                rows.append({**json.load(open(f.name)), "repeat": r + 1})
    for row in rows:
        padded = next(p for p in rows if p["mode"] == "padded" and p["repeat"] == row["repeat"])
        row["speedup_vs_padded"] = padded["update_s"] / row["update_s"]
        row["memory_vs_padded"] = row["peak_above_rest_mb"] / padded["peak_above_rest_mb"]
        row["loss_diff"] = abs(row["loss"] - padded["loss"])
    return rows


def report_update_packing(layers: int, prompts: int, group: int, repeats: int) -> tuple[dict, list]:
    rows = bench_update_packing(layers, prompts, group, repeats)
    return {"update_packing": rows}, [
        (f"one policy_update of SmolLM2-135M ({layers} of 30 layers), {prompts} prompts (40-160 tokens) x {group} "
         f"completions (4-400 tokens, log-uniform), micro-batches of 8192 tokens", rows,
         ["mode", "repeat", "update_s", "speedup_vs_padded", "completion_tok_per_s", "forward_tokens", "sequence_tokens",
          "peak_above_rest_mb", "memory_vs_padded", "loss", "loss_diff", "grad_norm"])]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo.bench.packing",
                                     description="One update in a fresh process; `python -m grpo.bench update-packing` "
                                                 "runs one per mode.")
    parser.add_argument("mode", choices=LAYOUTS)
    parser.add_argument("out", help="the JSON file the row is written to")
    parser.add_argument("layers", type=int)
    parser.add_argument("prompts", type=int)
    parser.add_argument("group", type=int)
    args = parser.parse_args()
    update_worker(args.mode, args.out, args.layers, args.prompts, args.group)
