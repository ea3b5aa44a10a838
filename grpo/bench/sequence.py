"""`python -m grpo.bench sequence-memory`: one rank's peak memory in an update on long sequences, with
the rows split across S ranks (`parallel.sequence_parallel=S`, grpo/parallel/sequence.py) for each S
in --sizes.

Each S is a fresh `torchrun --nproc_per_node S` of this module (gloo on CPU; DDP, so every rank holds
the same weights, gradients and AdamW state whatever S is, and what changes with S is the forward's
activations). The model has SmolLM2-135M's width (hidden 576, MLP 1536, vocabulary 49152) with 8 heads
of 72 and 4 key/value heads (SmolLM2's 9 and 3 do not split in 2 or 4), --layers of its 30 layers,
random weights. Rank 0 holds one group of 2 completions of --tokens tokens each (a 16-token prompt);
the other ranks none: the group's S ranks run each sequence together, one micro-batch per sequence
(algo.micro_batch_tokens = the sequence), so the peak is one sequence's forward and backward, split S
ways. Each rank reports its peak resident memory above its rest (after the model, the strategy and a
first small update that allocated gradients and optimizer state) over one `policy_update`, and how long
that took.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo import dist
from grpo.batch import collate
from grpo.bench.memory import ALLOCATOR, PeakRSS
from grpo.bench.report import ranks_json
from grpo.config import AlgoConfig, ParallelConfig
from grpo.parallel.ddp import DDPStrategy
from grpo.rollout.base import Rollouts
from grpo.update import policy_update

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=8, head_dim=72,
             num_key_value_heads=4, tie_word_embeddings=True)


def long_batch(tokens: int, prompt: int = 16, seed: int = 0):
    """A group of 2 completions of `tokens` tokens after one `prompt`-token prompt, random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 40000, (prompt,), generator=g).tolist()
    done = [torch.randint(100, 40000, (tokens,), generator=g).tolist() for _ in range(2)]
    return collate([ids, ids], Rollouts(done, [[-1.0] * tokens] * 2, ["length"] * 2, 0), torch.tensor([1.0, -1.0]), 0, False)


def worker(size: int, layers: int, tokens: int, out: str) -> None:
    info = dist.dist_info()
    dist.init_distributed(info, force=True)  # one process too: the strategy's collectives need a group
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_hidden_layers=layers, max_position_embeddings=tokens + 64,
                                         attn_implementation="sdpa"))
    algo = OmegaConf.structured(AlgoConfig(batch_size=2, group_size=2, lr=1e-6, warmup_steps=0, packing=False,
                                           micro_batch_tokens=tokens + 16))
    strategy = DDPStrategy(OmegaConf.structured(ParallelConfig(strategy="ddp", sequence_parallel=size)), model, algo, 10)
    mine = info.rank == 0
    small, batch = long_batch(32, seed=1), long_batch(tokens)
    empty = batch.select(slice(0, 0))
    policy_update(strategy, small if mine else empty, algo, 32, 1.0)  # gradients and AdamW state exist from here
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as peak:
        policy_update(strategy, batch if mine else empty, algo, tokens, 1.0)
    seconds = time.perf_counter() - start
    row = {"S": size, "rank": info.rank, "tokens": tokens, "layers": layers, "update_s": round(seconds, 1),
           "peak_rss_mb": round(peak.rss_mb), "peak_anon_mb": round(peak.anon_mb)}
    gathered = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, row)
    if mine:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.shutdown()


def bench_sequence_memory(sizes: list[int], layers: int, tokens: int) -> list[dict]:
    folder = tempfile.mkdtemp(prefix="bench-sequence-")
    rows = []
    for size in sizes:
        out = os.path.join(folder, f"S{size}.json")
        print(f"bench: one update on a {tokens}-token sequence, rows split across {size} rank(s)", flush=True)
        threads = max(1, (os.cpu_count() or 1) // size)
        rows += ranks_json("grpo.bench.sequence", size, ["--worker", str(size), out, "--layers", str(layers), "--tokens",
                                                         str(tokens)], out, f"sequence-parallel memory bench (S={size})",
                           {**ALLOCATOR, "OMP_NUM_THREADS": str(threads)})
    return rows


def report_sequence_memory(sizes: list[int], layers: int, tokens: int) -> tuple[dict, list]:
    rows = bench_sequence_memory(sizes, layers, tokens)
    return {"sequence_memory": rows, "layers": layers, "tokens": tokens, "shape": SHAPE}, [
        (f"One update on 2 sequences of 16 + {tokens} tokens (one per micro-batch), DDP on CPU (gloo), SmolLM2-135M's "
         f"width with 8 heads, {layers} layers; peak MB above each rank's rest", rows,
         ["S", "rank", "tokens", "update_s", "peak_rss_mb", "peak_anon_mb"])]


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m grpo.bench.sequence", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("S", "OUT"),
                   help="one case on this rank, under torchrun (without it: every --sizes, as `grpo.bench sequence-memory`)")
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default="bench_results/sequence_memory.json")
    args = p.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.layers, args.tokens, args.worker[1])
    else:
        from grpo.bench.report import publish

        publish(args.out, *report_sequence_memory([int(x) for x in args.sizes.split(",") if x], args.layers, args.tokens))
