"""Weight-sync cost, part of `python -m grpo.bench run`: seconds and MB/s to push the policy's weights
into an engine per bucket size (and one tensor per bucket, how TRL and OpenRLHF send them), and
ZeRO-3's gather of a SmolLM2-135M-shaped model from its shards on 2 processes, bucket by bucket, with
the peak memory above the resting state. The gather runs under torchrun as this module
(`python -m grpo.bench.sync OUT BUCKETS`)."""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time

import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from grpo import dist
from grpo.bench.memory import PeakRSS
from grpo.bench.report import ranks_json
from grpo.bench.runs import backend_overrides, compose, tiny_model_path
from grpo.config import AlgoConfig, ParallelConfig
from grpo.models import load_model
from grpo.parallel.zero import Zero3Strategy
from grpo.rollout import build_rollout
from grpo.weights import group_by_size


def bench_sync(backend_name: str, bucket_mb: list[float], repeats: int, url: str | None = None) -> list[dict]:
    """Seconds and MB/s to push the policy's weights into an engine, per bucket size; bucket 0
    means one tensor per bucket (how TRL and OpenRLHF send them: one call and transfer each)."""
    cfg = compose([*backend_overrides(backend_name, url), "run_dir=unused"])
    path = tiny_model_path()
    model, tok = load_model(path)
    print(f"bench: weight sync into rollout={backend_name}", flush=True)
    rollout = build_rollout(cfg.rollout, model, tok, path, run_dir=tempfile.mkdtemp(prefix="bench-sync-"))
    named = list(model.named_parameters(remove_duplicate=False))
    total_mb = sum(p.numel() * p.element_size() for _, p in named) / 2**20
    results = []
    try:
        for mb in bucket_mb:
            times = []
            for r in range(repeats):
                t0 = time.perf_counter()
                size = 1 if mb == 0 else int(mb * 2**20)  # 1 byte: every tensor alone in its bucket
                rollout.update_weights(group_by_size(((n, p.detach()) for n, p in named), size), version=r)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            results.append({"backend": backend_name, "bucket_mb": mb or "per-tensor", "tensors": len(named),
                            "model_mb": total_mb, "sync_s": s, "mb_per_s": total_mb / s})
    finally:
        rollout.close()
    return results


def zero3_sync_worker(bucket_mbs: list[float], out: str) -> None:
    """Under torchrun: ZeRO-3 shards of a SmolLM2-135M-shaped model (random weights) on each rank;
    for each bucket size, gather the full weights bucket by bucket and pack each bucket into one
    contiguous buffer, as the grpo_gloo transport does before sending it."""
    dist.init_distributed(dist.dist_info())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    largest_mb = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    strategy = Zero3Strategy(OmegaConf.structured(ParallelConfig(strategy="zero3")), model,
                             OmegaConf.structured(AlgoConfig()), total_steps=1)
    del model

    def gather_all(bucket_bytes: int) -> None:
        for bucket in strategy.weight_buckets(bucket_bytes):
            flat = torch.cat([t.reshape(-1) for _, t in bucket])
            del flat

    gather_all(int(min(bucket_mbs) * 2**20))  # warm-up: first-touch pages and DeepSpeed's buffers
    results = []
    for mb in sorted(bucket_mbs):
        gc.collect()
        dist.barrier()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            gather_all(int(mb * 2**20))
            seconds = time.perf_counter() - t0
        results.append({"bucket_mb": mb, "gather_s": seconds, "mb_per_s": model_mb / seconds,
                        "peak_above_rest_mb": mem.peak_above_mb, "model_mb": model_mb, "largest_tensor_mb": largest_mb})
    if dist.rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.shutdown()


def bench_zero3_sync(bucket_mbs: list[float]) -> list[dict]:
    out = os.path.join(tempfile.mkdtemp(prefix="bench-zero3-sync-"), "sync.json")
    print(f"bench: ZeRO-3 gather on 2 processes, buckets {bucket_mbs} MB", flush=True)
    return ranks_json("grpo.bench.sync", 2, [out, ",".join(map(str, bucket_mbs))], out, "ZeRO-3 sync bench")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo.bench.sync",
                                     description="One rank of the ZeRO-3 gather, under torchrun; "
                                                 "`python -m grpo.bench run` starts 2 of them.")
    parser.add_argument("out", help="the JSON file rank 0 writes the rows to")
    parser.add_argument("buckets", help="comma-separated bucket sizes in MB, e.g. 16,64")
    args = parser.parse_args()
    zero3_sync_worker([float(b) for b in args.buckets.split(",") if b], args.out)
