"""Mixture-of-experts policies, of whatever family transformers ships (Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE, gpt-oss, ...): what the trainer reads of one (`Experts`), the expert kernel it runs on the
device (`experts_kernel`), and the router's load-balancing loss with the routing statistics a step
logs (`routing_of`, `routing_metrics`). The rule of `algo.router_aux_loss_coef` stands here too (`check`).

The load-balancing loss is Switch Transformer's (Fedus et al. 2021, eq. 4-6), as transformers'
`load_balancing_loss_func` computes it:

    aux = E * sum_i f_i * P_i

over every MoE layer and every real token (padding left out): f_i the fraction of the top-k
assignments that went to expert i (they sum to k), P_i the mean router probability of expert i
(they sum to 1). A perfectly balanced router gives f_i = k / E and P_i = 1 / E, so aux = k; all
tokens on the same k experts with probability 1/k each gives aux = E. Only P carries a gradient.

Why it is computed here and not read from the model: transformers adds `router_aux_loss_coef * aux`
to `out.loss` only when `labels` are passed, and the update computes its own loss from the hidden
states (grpo/update/forward.py); its `out.aux_loss` counts every position of a packed row, the row's
padding too. The update asks the model for its router logits (`output_router_logits=True`, the public
output every family above has) and the rows' real tokens decide what counts.

Departures, said once: the loss is per forward, as transformers' and Megatron's are, so a batch cut
into micro-batches sums each one's aux weighted by its share of the loss's tokens (the weight does not
grow with the number of micro-batches, but f_i and P_i are each micro-batch's own, not the whole
batch's). The statistics use softmax then top-k of the router's logits, the routing of the families
that declare a `router_aux_loss_coef`; families balanced without one (DeepSeek-V3's and GLM-4.5's
bias-corrected sigmoid routers) are not asked for router logits and log no routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo.errors import ConfigError
from grpo.modeling import text_config

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # the families' names for E

# the expert kernel (transformers' `experts_implementation`) the trainer runs, by device type.
# cpu: grouped_mm. Measured on the tiny MoE (4 layers, 8 experts, top-2; forward + backward of 64 x 16
# tokens, 1 thread, fp32): eager 220 ms, grouped_mm 184 ms, batched_mm 6,428 ms (35x; bf16: 20x);
# 40-55x on a 2-layer one (docs/moe.md). cuda: grouped_mm, transformers' own default for a
# forward over many tokens; batched_mm gathers every token's expert weights (tokens x top-k x expert
# size of memory), which transformers' `generate` switches to by itself for decoding on a GPU. Not yet
# measured on a GPU (docs/moe.md).
EXPERTS_KERNELS = {"cpu": "grouped_mm", "cuda": "grouped_mm"}


def experts_kernel(device_type: str) -> str:
    """The expert kernel for a policy on `device_type` (EXPERTS_KERNELS); eager, every family's own
    loop over the experts, on a device nothing was chosen for."""
    return EXPERTS_KERNELS.get(device_type, "eager")


def sets_experts_kernel(model) -> bool:
    """Whether `model`'s family takes a kernel choice (its experts are one fused module decorated by
    transformers' `use_experts_implementation`: Qwen3-MoE, Mixtral, OLMoE, gpt-oss...); the older
    per-expert module lists run their own loop. transformers' own check, wrapped here only
    (tests/test_moe_model.py fails if an upgrade moves it)."""
    return type(model)._can_set_experts_implementation()


def pin_experts_kernel(model, device_type: str) -> str | None:
    """Set the expert kernel of a MoE `model` for `device_type`; returns the kernel its config then
    holds, or None for a model without experts to set (dense, or a family that runs its own loop)."""
    if experts_of(model) is None or not sets_experts_kernel(model):
        return None
    model.set_experts_implementation(experts_kernel(device_type))
    return model.config._experts_implementation


@dataclass(frozen=True)
class Experts:
    """What the trainer reads of a MoE model's config."""

    num_experts: int  # E
    top_k: int  # k: experts per token
    # the config's router_aux_loss_coef; None: the family balances its experts without a loss (a
    # bias on the router's scores: DeepSeek-V3, GLM-4.5), so no router logits are asked for
    aux_loss_coef: float | None


def experts_of(model) -> Experts | None:
    """The experts of `model` (through any wrapper; a VLM's language model), None for a dense model."""
    config = text_config(model)
    top_k = getattr(config, "num_experts_per_tok", None)
    count = next((getattr(config, k) for k in EXPERT_COUNT_KEYS if getattr(config, k, None)), None)
    if not top_k or not count:
        return None
    coef = getattr(config, "router_aux_loss_coef", None)
    return Experts(int(count), int(top_k), None if coef is None else float(coef))


def routed_experts(model) -> Experts | None:
    """The experts of a model whose forward the update asks for its router logits (a MoE with a
    load-balancing loss); None for any other."""
    experts = experts_of(model)
    return experts if experts is not None and experts.aux_loss_coef is not None else None


def aux_coef(setting: float | None, model) -> float:
    """The load-balancing loss's weight in the update: `algo.router_aux_loss_coef` (`setting`), or the
    model config's where it is None; 0 for a dense model or a family without the loss (`check_model`
    refused a weight > 0 for them)."""
    experts = experts_of(model)
    if experts is None or experts.aux_loss_coef is None:
        return 0.0
    return experts.aux_loss_coef if setting is None else float(setting)


def check(algo) -> None:
    """algo.router_aux_loss_coef (validate's part): null (the model's own), 0 (off) or a positive weight."""
    coef = algo.router_aux_loss_coef
    if coef is not None and not (isinstance(coef, (int, float)) and coef >= 0 and math.isfinite(coef)):
        raise ConfigError(f"algo.router_aux_loss_coef={coef!r}: the router's load-balancing loss weight must be >= 0 "
                          "(0 turns it off), or null for the model config's own router_aux_loss_coef.")


def check_model(model, setting: float | None) -> None:
    """A positive `algo.router_aux_loss_coef` (`setting`) needs a model with a load-balancing loss to
    weigh: a dense model, or a MoE balanced without one, is refused (checked when the policy is loaded)."""
    if setting is None or setting == 0 or routed_experts(model) is not None:
        return
    name = type(model).__name__
    what = "has no experts" if experts_of(model) is None else \
        "balances its experts without a load-balancing loss (its config has no router_aux_loss_coef)"
    raise ConfigError(f"algo.router_aux_loss_coef={setting}, but {name} {what}: set algo.router_aux_loss_coef=0, "
                      "or null (the model's own).")


@dataclass
class Routing:
    """One forward's routing over its real tokens and every MoE layer."""

    aux_loss: torch.Tensor  # 0-dim, differentiable through the router probabilities
    load_E: torch.Tensor  # top-k assignments per expert, summed over layers and tokens (no gradient)


def routing_of(router_logits, real_N: torch.Tensor, experts: Experts) -> Routing:
    """The load-balancing loss and per-expert load of one forward. `router_logits`: the model's
    output, one [N, E] tensor per MoE layer, N the forward's positions in row-major order (rows x
    width); `real_N` (any shape of N elements): 1 on the tokens that count, 0 on padding."""
    E, k = experts.num_experts, experts.top_k
    device = router_logits[0].device
    real_N = real_N.reshape(-1).to(device=device, dtype=torch.float32)
    load_E = torch.zeros(E, device=device)
    prob_E = torch.zeros(E, device=device)
    for logits_NE in router_logits:
        probs_NE = torch.softmax(logits_NE.float(), dim=-1)
        chosen_NK = torch.topk(probs_NE, k, dim=-1).indices
        load_E = load_E.index_add(0, chosen_NK.reshape(-1), real_N.repeat_interleave(k))
        prob_E = prob_E + (probs_NE * real_N[:, None]).sum(dim=0)
    counted = (real_N.sum() * len(router_logits)).clamp(min=1.0)  # token-layers
    aux = E * ((load_E / counted) * (prob_E / counted)).sum()
    return Routing(aux, load_E.detach())


def routing_metrics(aux_loss: float, load_E: torch.Tensor) -> dict[str, float]:
    """A step's routing in its log: `moe/aux_loss` (the load-balancing loss, mean over the forwards;
    k when balanced), `moe/expert_load_max` (the busiest expert's fraction of the top-k assignments;
    1/E when balanced, 1/k at worst with distinct experts per token) and `moe/routing_entropy` (the
    entropy of the assignments' distribution over experts, divided by log E: 1 when balanced). NaN each
    where no token was routed (every group skipped as flat): 0 would read as a collapsed router."""
    if not load_E.sum() > 0:
        return {"moe/aux_loss": math.nan, "moe/expert_load_max": math.nan, "moe/routing_entropy": math.nan}
    frac_E = load_E.double() / load_E.double().sum().clamp(min=1.0)
    entropy = -(frac_E * frac_E.clamp(min=1e-30).log()).sum() / math.log(len(frac_E))
    return {"moe/aux_loss": float(aux_loss), "moe/expert_load_max": float(frac_E.max()),
            "moe/routing_entropy": float(entropy)}
