"""ZeRO-3 over a MoE with ranks routed to disjoint experts (tests/test_moe_zero3.py):

    torchrun --nproc_per_node 2 tests/moe_zero3_worker.py OUT MODEL   # rank r takes rows 4r..4r+3 of each batch
    python tests/moe_zero3_worker.py OUT MODEL                        # one process takes all 8 rows

MODEL is `tiny_moe` (model=tiny_moe at random init: Qwen3-MoE, 4 layers, 8 experts, top-2, fused
experts; a block DeepSpeed marks as a ZeRO-3 leaf by itself) or `olmoe_loop` (a 2-layer OLMoE, 8
experts, top-2, whose experts are an `nn.ModuleList` run one by one, only those a token chose, as
transformers 4.x's blocks ran: DeepSpeed does not list OLMoE, so only grpo/moe/zero3.py makes its
block a leaf). fp32, `Zero3Strategy`, and 2 optimizer steps of the project's own update
(`policy_update`, one per batch of 8 rows). Every batch carries routes (`routes_BLMK`, replayed by
the update, grpo/moe/routing.py): rows 0-3 go to 2 of experts 0-3, rows 4-7 to 2 of experts 4-7, per
token and layer. On 2 processes rank 0 so never routes a token to an expert rank 1 uses, and the
reverse. The router aux loss is off: it is each forward's own (grpo/moe_model.py), so 2 ranks'
forwards and one forward over all rows differ by design. Rank 0 writes OUT (torch.save): the initial
and the final weights, gathered, each step's gradient norm, and the classes the engine marked as
ZeRO-3 leaves.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.ddp_step import exit_process  # noqa: E402

ROWS, STEPS = 8, 2


class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LoopExperts(nn.Module):
    """OlmoeExperts' interface, one module per expert, and only the chosen experts run: under ZeRO-3
    without a leaf, each rank gathers the parameters of the experts its own tokens chose."""

    def __init__(self, experts: int, hidden: int, inner: int):
        super().__init__()
        self.experts = nn.ModuleList(Expert(hidden, inner) for _ in range(experts))

    def forward(self, hidden_NH, top_k_index_NK, top_k_weights_NK):
        out_NH = torch.zeros_like(hidden_NH)
        for e in top_k_index_NK.unique().tolist():
            token, slot = torch.where(top_k_index_NK == e)
            y = self.experts[e](hidden_NH[token]) * top_k_weights_NK[token, slot, None]
            out_NH = out_NH.index_add(0, token, y.to(out_NH.dtype))
        return out_NH


def build(name: str, cfg, tok) -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from grpo.moe_model import pin_experts_kernel
    from grpo.tiny.moe import build_tiny_moe

    if name == "tiny_moe":
        model = build_tiny_moe(cfg.model.tiny, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        pin_experts_kernel(model, "cpu")
        return model
    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = OlmoeForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.experts = LoopExperts(8, 64, 32)
    return model


def disjoint_routes(batch, experts: int, layers: int, top_k: int, seed: int) -> torch.Tensor:
    """`[B, L, layers, top_k]` routes: row b's tokens to top_k distinct experts of the half of the
    experts its rank owns (rows of the first half of the batch: experts 0..E/2-1; the rest: E/2..E-1)."""
    B, L = batch.input_ids_BL.shape
    half = experts // 2
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(B, L, layers, half, generator=g).argsort(dim=-1)[..., :top_k]  # distinct, within a half
    owner = (torch.arange(B) >= B // 2).long().view(B, 1, 1, 1)
    return picks + owner * half


def gathered(model) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def main(out: str, name: str) -> None:
    from deepspeed.utils import get_z3_leaf_modules

    from grpo.dist import dist_info, init_distributed
    from grpo.moe import routing
    from grpo.parallel.zero import Zero3Strategy
    from grpo.tiny.text import build_char_tokenizer
    from grpo.update import policy_update
    from tests.conftest import compose_cfg
    from tests.test_gradient_invariance import make_batch

    info = dist_info()
    if info.world_size > 1:
        init_distributed(info)
    cfg = compose_cfg("parallel=zero3", "model=tiny_moe", "model.dtype=float32", "algo.lr=1e-2",
                      "algo.warmup_steps=0", "algo.router_aux_loss_coef=0", "algo.batch_size=8", "algo.group_size=1")
    tok = build_char_tokenizer()
    model = build(name, cfg, tok)
    layers, k = len(routing.moe_layers(model)), routing.top_k(model)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    strategy = Zero3Strategy(cfg.parallel, model, cfg.algo, total_steps=STEPS)
    per_rank = ROWS // info.world_size
    mine = slice(info.rank * per_rank, (info.rank + 1) * per_rank)
    norms = []
    for step in range(STEPS):
        batch = make_batch(tok, seed=step, B=ROWS)
        batch.routes_BLMK = disjoint_routes(batch, 8, layers, k, seed=100 + step)
        stats = policy_update(strategy, batch.select(mine), cfg.algo, max_len=6, temperature=1.0)
        norms.append(stats["grad_norm"])  # the global norm before clipping: AdamW's step would hide a scale error
    final = gathered(strategy.model)
    leaves = sorted({type(m).__name__ for m in get_z3_leaf_modules(strategy.model)})
    if info.rank == 0:
        torch.save({"init": init, "final": final, "leaves": leaves, "grad_norms": norms}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
