"""`python -m grpo.bench zero3-head`: the LM head's pieces under ZeRO-3, their logits kept for the
backward against each piece recomputed in it (grpo/update/forward.py), or for a frozen head (LoRA's)
against its gradient taken in the forward (grpo/update/frozen_head.py), peak memory and seconds.

Each case is a fresh `torchrun --nproc_per_node 2` of this module (gloo on CPU): a 2-layer Qwen2
(hidden 512, vocabulary 32768, tied, untied or frozen tied head) built under `deepspeed.zero.Init`, one forward of
`tokens` positions per rank, the head on pieces of `chunk_mb` of fp32 logits (`head_logprobs`), the
backward and an SGD step. `kept` runs each piece without checkpointing and keeps its logits (what
ZeRO-3 did before, for trained and frozen heads alike). The second of two iterations is measured (the first traces DeepSpeed's
prefetch); loss and gradient norm must agree between the modes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from grpo.bench.memory import PeakRSS
from grpo.bench.report import ranks_json

CASES = [(head, mode) for head in ("tied", "untied") for mode in ("kept", "recomputed")] + [("frozen", "kept"), ("frozen", "in-forward")]


def worker(out: str, head: str, mode: str, tokens: int, chunk_mb: float) -> None:
    import deepspeed  # deepspeed: only inside the bench's ranks
    from transformers import Qwen2Config, Qwen2ForCausalLM  # transformers' model classes: only here

    from grpo.update import forward  # the update's modules: only in the ranks (the driver starts them)

    forward.LOGIT_CHUNK_BYTES = int(chunk_mb * 2**20)
    recomputed = [0]
    real_checkpoint = forward.checkpoint

    def counted(fn, *args, **kwargs):
        if mode == "kept":
            return fn(*args)
        recomputed[0] += 1
        return real_checkpoint(fn, *args, **kwargs)

    forward.checkpoint = counted
    in_forward, real_piece = [0], forward.frozen_head.piece

    def counted_piece(*args):
        in_forward[0] += 1
        return real_piece(*args)

    forward.frozen_head.piece = counted_piece
    if mode == "kept":  # a frozen head's pieces too
        forward.frozen_head.applies = lambda head: False
    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    window = 512
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32768, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                      intermediate_size=1024, max_position_embeddings=window, tie_word_embeddings=head != "untied")
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2**31 - 1}
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = Qwen2ForCausalLM(cfg)
    if head == "frozen":  # as under LoRA (the input embedding, tied, with it)
        model.lm_head.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trained, lr=1e-3), config=ds)
    ids = torch.randint(0, cfg.vocab_size, (tokens // window, window), generator=torch.Generator().manual_seed(rank))
    pieces = forward.pieces_for(tokens, cfg.vocab_size)
    for _ in range(2):
        recomputed[0] = in_forward[0] = 0
        with PeakRSS() as peak:
            start = time.perf_counter()
            hidden = engine.module(input_ids=ids, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
            logp, _ = forward.head_logprobs(engine.module, hidden[:, :-1], ids[:, 1:], 1.0, pieces)
            loss = logp.mean()
            engine.backward(loss)
            seconds = time.perf_counter() - start
        engine.step()
        grad_norm = float(engine.get_global_grad_norm())  # this step's, computed in `step`
    row = {"head": head, "mode": mode, "rank": rank, "pieces": pieces, "recomputed": recomputed[0], "in_forward": in_forward[0],
           "peak_rss_mb": round(peak.rss_mb), "seconds": round(seconds, 1), "loss": loss.item(), "grad_norm": grad_norm}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def report_zero3_head(tokens: int = 4096, chunk_mb: float = 32.0) -> tuple[dict, list]:
    folder, results = tempfile.mkdtemp(prefix="bench-zero3-head-"), []
    for head, mode in CASES:
        out = os.path.join(folder, f"{head}-{mode}.json")
        print(f"bench: ZeRO-3 head pieces, {head} head, logits {mode}, on 2 processes", flush=True)
        results += ranks_json("grpo.bench.zero3_head", 2, ["--worker", out, head, mode, "--tokens", str(tokens),
                                                           "--chunk-mb", str(chunk_mb)], out, f"ZeRO-3 head bench ({head}, {mode})")
    return {"zero3_head": results, "tokens": tokens, "chunk_mb": chunk_mb}, [
        (f"ZeRO-3 on 2 CPU ranks (gloo), a 2-layer Qwen2 (hidden 512, vocabulary 32768), {tokens} positions per rank, "
         f"the head on pieces of {chunk_mb:g} MB of fp32 logits; peak MB above each rank's rest", results,
         ["head", "mode", "rank", "pieces", "recomputed", "in_forward", "peak_rss_mb", "seconds", "loss", "grad_norm"])]


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m grpo.bench.zero3_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=3, metavar=("OUT", "HEAD", "MODE"), help="one case on this rank, under torchrun")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk-mb", type=float, default=32.0)
    p.add_argument("--out", default="bench_results/zero3_head.json")
    args = p.parse_args()
    if args.worker:
        worker(*args.worker, args.tokens, args.chunk_mb)
    else:
        from grpo.bench.report import publish

        publish(args.out, *report_zero3_head(args.tokens, args.chunk_mb))
