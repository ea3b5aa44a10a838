"""Split-row checks that need a group of ranks, for tests/test_sequence_parallel.py:

    torchrun --nproc_per_node 2 tests/split_worker.py kv_heads OUT     # a model with fewer key/value heads than S
    torchrun --nproc_per_node N tests/split_worker.py moe_routing OUT  # a MoE update's logged routing

Both under parallel=ddp with parallel.sequence_parallel=2 (gloo, DeepSpeed's all-to-all).

kv_heads: a Qwen2 with 4 heads and 1 key/value head (S = 2 is a multiple of it: each rank holds a copy).
The unsplit logprobs, then one split forward and backward with checkpointed layers (their recompute
runs through the split attention), then the unsplit logprobs again. Writes OUT/kv_heads_rank<r>.json:
{"before", "after"}: every attention's num_key_value_groups before and after the split, "unsplit_diff":
max |logprob| difference between the two unsplit forwards (null if the second one raised: "error"),
"split_diff": the split's logprobs against the unsplit, "split_calls": the attention calls that went
through the split (2 layers, each run and recomputed: 4), "grad_diff", "grad_max": the group's summed
gradient against the unsplit one's, and that gradient's largest entry.

moe_routing: the tiny MoE (seed 0), tests.test_gradient_invariance.make_batch(B=8, group=2, T=16),
packed rows, router_aux_loss_coef 0.01, each rank B / N rows, one policy_update. Writes
OUT/moe_rank<r>.json: the update's moe/* metrics on that rank.
"""

import json
import os
import sys

import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo import dist  # noqa: E402
from grpo.batch import collate  # noqa: E402
from grpo.config import AlgoConfig, ParallelConfig, TinyModelConfig  # noqa: E402
from grpo.parallel import sequence  # noqa: E402
from grpo.parallel.ddp import DDPStrategy  # noqa: E402
from grpo.rollout.base import Rollouts  # noqa: E402
from grpo.tiny.moe import build_tiny_moe  # noqa: E402
from grpo.tiny.text import build_char_tokenizer  # noqa: E402
from grpo.update import policy_update, score_tokens  # noqa: E402
from grpo.update.forward import batch_logprobs  # noqa: E402
from grpo.update.layouts import MicroBatch  # noqa: E402
from grpo.update.step import forwarding  # noqa: E402
from tests.test_gradient_invariance import make_batch  # noqa: E402

SPLIT = 2


def split_strategy(model, algo) -> DDPStrategy:
    return DDPStrategy(OmegaConf.structured(ParallelConfig(strategy="ddp", sequence_parallel=SPLIT)), model, algo, 10)


def kv_groups(model) -> list[int]:
    return [layer.self_attn.num_key_value_groups for layer in model.model.layers]


def kv_heads(out: str, rank: int) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=256, attn_implementation="sdpa")).float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, warmup_steps=0, packing=False,
                                           micro_batch_tokens=10_000))
    strategy = split_strategy(model, algo)
    lengths = [3, 6, 1, 4]  # the same batch on both ranks: the group runs it once
    comps = [[4 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate(lengths)]
    batch = collate([[1, 5, 6, 7], [1, 5, 6, 7], [1, 9], [1, 9]],
                    Rollouts(comps, [[-1.0] * n for n in lengths], ["stop"] * 4, 0), torch.zeros(4), 0, False)
    mask_BT = batch.mask_BT
    before = kv_groups(model)
    plain_BT = score_tokens(model, batch, 1.0, 10_000)
    model.train()
    model.zero_grad()
    (batch_logprobs(model, batch, 1.0)[0] * mask_BT).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # rank 0's micro-batch, split over the group: each rank backs off 1/S of the loss and holds a part
    # of the gradient (the strategy would sum the parts); the backward recomputes the layers split
    mine = MicroBatch(batch, "padded") if rank == 0 else None
    (planned, _), = strategy.sequence.exchange([mine] if mine else [])
    model.zero_grad()
    real_routed, calls = sequence.routed, []  # the attention calls the split takes (forward, recompute)
    sequence.routed = lambda: (lambda s: (calls.append(s is not None), s)[1])(real_routed())
    with forwarding(strategy, model, planned, 1.0) as (split_BT, _, _):
        (split_BT * mask_BT).sum().div(SPLIT).backward()
    sequence.routed = real_routed
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in got.values():
        torch.distributed.all_reduce(g)
    result = {"before": before, "after": kv_groups(model), "split_calls": sum(calls),
              "split_diff": ((split_BT.detach() - plain_BT) * mask_BT).abs().max().item(),
              "grad_diff": max((got[n] - want[n]).abs().max().item() for n in want),
              "grad_max": max(g.abs().max().item() for g in want.values())}
    try:
        result["unsplit_diff"] = ((score_tokens(model, batch, 1.0, 10_000) - plain_BT) * mask_BT).abs().max().item()
    except RuntimeError as e:
        result["unsplit_diff"], result["error"] = None, str(e)[:300]
    json.dump(result, open(os.path.join(out, f"kv_heads_rank{rank}.json"), "w"))


def moe_routing(out: str, rank: int, world: int) -> None:
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    batch = make_batch(tok, B=8, group=2, T=16)
    algo = OmegaConf.structured(AlgoConfig(group_size=2, batch_size=8, lr=1e-6, warmup_steps=0, packing=True,
                                           shared_prompt=False, micro_batch_tokens=10_000, router_aux_loss_coef=0.01))
    rows = batch.size // world
    stats = policy_update(split_strategy(model, algo), batch.select(slice(rank * rows, (rank + 1) * rows)), algo, 16, 1.0)
    json.dump({k: v for k, v in stats.items() if k.startswith("moe/")}, open(os.path.join(out, f"moe_rank{rank}.json"), "w"))


if __name__ == "__main__":
    info = dist.dist_info()
    dist.init_distributed(info, force=True)
    check, folder = sys.argv[1], sys.argv[2]
    if check == "kv_heads":
        kv_heads(folder, info.rank)
    else:
        moe_routing(folder, info.rank, info.world_size)
    dist.shutdown()
