"""`python -m grpo.bench zero3-memory`: what one rank holds under ZeRO-3, loading the policy whole
and then partitioning it (`before`, as the trainer did) against building it under
`deepspeed.zero.Init` (`after`, `Zero3Strategy.loading`), without and with a reference model
(algo.beta > 0: `before` a full replica on every rank, `after` a partitioned engine).

Each case is a fresh `torchrun --nproc_per_node 2` of this module (gloo on CPU) on a model shaped like
SmolLM2-135M (hidden 576, 30 layers, vocabulary 49152; random weights, built here and saved with
save_pretrained so `from_pretrained` loads it as any folder). Each rank reports its peak resident
memory above its rest (after imports and the process group, before any model) over (a) the load:
policy built, `deepspeed.initialize`, and the reference built; and (b) one update step
(`policy_update`: reference scoring, forward, backward, AdamW). `anon` leaves out file-backed pages
(the checkpoint's safetensors are memory-mapped: their pages are the page cache's, shared and
reclaimable, but count in the plain resident size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo import dist
from grpo.batch import collate
from grpo.bench.memory import PeakRSS
from grpo.bench.report import ranks_json
from grpo.config import compose_config
from grpo.errors import ConfigError
from grpo.models import build_policy, build_reference, load_model
from grpo.parallel.zero import Zero3Strategy, init_deepspeed_comm
from grpo.rollout.base import Rollouts
from grpo.tiny.folders import resolve_on_node
from grpo.tiny.text import build_char_tokenizer
from grpo.update import policy_update

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=512)
CASES = [("before", 0.0), ("after", 0.0), ("before", 0.04), ("after", 0.04)]


def save_model(folder: str) -> float:
    """The SmolLM2-135M-shaped model (random weights, fp32) and a tokenizer in `folder`; its size in MB."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model.save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


GROUP = 4  # completions per prompt


def synthetic_batch(rows: int, prompt: int, completion: int, seed: int):
    """`rows` completions in groups of `GROUP` with random tokens and rewards, collated as the loop does."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (prompt,), generator=g).tolist() for _ in range(rows)]
    done = [torch.randint(100, 40000, (completion,), generator=g).tolist() for _ in range(rows)]
    logprobs = [[-1.0] * completion] * rows
    advantages_B = torch.randn(rows, generator=g)
    return collate(prompts, Rollouts(done, logprobs, ["length"] * rows, 0), advantages_B, 0, False)


def worker(folder: str, mode: str, beta: float, out: str, rows: int, tokens: int) -> None:
    """One case on this rank (under torchrun): load, then one update step; rank 0 writes both ranks' rows."""
    info = dist.dist_info()
    cfg = compose_config(["parallel=zero3", f"model.path={folder}", "run_dir=unused", f"algo.beta={beta}",
                          f"algo.zero_std_groups={'keep' if beta > 0 else 'drop'}",
                          f"algo.batch_size={rows * info.world_size}", f"algo.group_size={GROUP}", "algo.warmup_steps=0",
                          f"algo.micro_batch_tokens={rows * 2 * tokens}"])
    dist.init_distributed(info)  # torchrun's world; DeepSpeed's comm joins it
    init_deepspeed_comm(cfg.parallel.cpu_shm_allreduce)
    batch = synthetic_batch(rows, tokens, tokens, seed=info.rank)
    dist.barrier()
    with PeakRSS() as load:
        loading = Zero3Strategy.loading(cfg.parallel, cfg.algo, torch.float32) if mode == "after" else contextlib.nullcontext()
        path = resolve_on_node(cfg, info, log=lambda *_: None)
        model, _ = build_policy(cfg, path, info, log=lambda *_: None, loading=loading)
        strategy = Zero3Strategy(cfg.parallel, model, cfg.algo, total_steps=1)
        del model
        if beta > 0 and mode == "after":
            ref = build_reference(cfg, path, strategy)
        elif beta > 0:  # as the trainer did: a full replica on every rank
            ref = load_model(path)[0].eval().requires_grad_(False)
        else:
            ref = None
    held_anon_mb = (load.sample()[1] - load.base[1]) / 2**20  # what stays after the load's transients
    dist.barrier()
    with PeakRSS() as step:
        stats = policy_update(strategy, batch, cfg.algo, tokens, 1.0, ref)
    row = {"mode": mode, "beta": beta, "rank": info.rank, "load_rss_mb": load.rss_mb, "load_anon_mb": load.anon_mb,
           "held_anon_mb": held_anon_mb, "step_rss_mb": step.rss_mb, "step_anon_mb": step.anon_mb, "kl": stats["kl"], "loss": stats["loss"]}
    gathered = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, row)
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.shutdown()


def bench_zero3_memory(rows: int = 4, tokens: int = 32) -> tuple[list[dict], float]:
    """Every case in a fresh 2-rank torchrun; (one row per case and rank, the model's size in MB)."""
    if rows < GROUP or rows % GROUP:  # an incomplete group's baseline: the KL and loss came out nan
        raise ConfigError(f"--rows {rows}: the rows of a rank are whole groups of {GROUP} completions; "
                         f"use a multiple of {GROUP}, e.g. --rows {max(1, rows // GROUP) * GROUP}")
    folder = tempfile.mkdtemp(prefix="bench-zero3-model-")
    model_mb = save_model(folder)
    results = []
    for mode, beta in CASES:
        out = os.path.join(folder, f"{mode}-{beta}.json")
        print(f"bench: ZeRO-3 memory, {mode}, beta {beta}, on 2 processes", flush=True)
        results += ranks_json("grpo.bench.zero3", 2, ["--worker", folder, mode, str(beta), out, "--rows", str(rows),
                                                      "--tokens", str(tokens)], out, f"ZeRO-3 memory bench ({mode}, beta={beta})")
    return results, model_mb


def report_zero3_memory(rows: int = 4, tokens: int = 32) -> tuple[dict, list]:
    results, model_mb = bench_zero3_memory(rows, tokens)
    return {"zero3_memory": results, "model_mb": model_mb, "rows": rows, "tokens": tokens}, [
        (f"ZeRO-3 on 2 CPU ranks (gloo), a SmolLM2-135M-shaped model ({model_mb:.0f} MB in fp32), one update "
         f"step on {rows} x ({tokens} prompt + {tokens} completion) tokens per rank; peak MB above each rank's rest", results,
         ["mode", "beta", "rank", "load_rss_mb", "load_anon_mb", "held_anon_mb", "step_rss_mb", "step_anon_mb", "kl"])]


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m grpo.bench.zero3", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=4, metavar=("FOLDER", "MODE", "BETA", "OUT"),
                   help="one case on this rank, under torchrun (without it: every case, as `grpo.bench zero3-memory`)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default="bench_results/zero3_memory.json")
    args = p.parse_args()
    if args.worker:
        folder, mode, beta, out = args.worker
        worker(folder, mode, float(beta), out, args.rows, args.tokens)
    else:
        from grpo.bench.report import publish

        publish(args.out, *report_zero3_memory(args.rows, args.tokens))
