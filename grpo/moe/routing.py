"""Which experts a Mixture-of-Experts policy routes each token to: record them, and run a forward with
given ones (rollout routing replay, R3: arXiv 2510.11370).

The sampler (vLLM, or `generate` on the hf backend) and the trainer can route the same token to
different experts: bf16 rounding moves a router's scores, and a near tie flips its top-k. The trainer
then scores tokens with experts that never produced them. Replay forces the sampler's choice in every
trainer forward; the router still learns, because the chosen experts' weights are gathered from the
trainer's own scores (only the discrete selection is replayed, as verl, slime, NeMo RL and Megatron do).

Routes are a LongTensor `[B, T, L, K]` laid out like the forward's `input_ids` `[B, T]`: one row of `K`
experts per token and MoE layer, `L` the model's MoE layers in order (`moe_layers`; a dense layer has
no row). An entry of -1 marks a route the sampler did not give (a prompt block its cache skipped):
that token-layer keeps the trainer's own choice (NeMo RL's fallback).

How: a forward hook on each router replaces its output `(logits, weights, experts)` by the weights of
the given experts, computed from the router's own logits by its family's rule (`WEIGHTS`). With the
router's own experts this reproduces its output bitwise (tests/test_moe_routing.py, every family).
transformers 5.x has no routing argument; the hooks work under ZeRO-3 and gradient checkpointing
(keep `replay` open across `backward()`: the recompute runs the routers again).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from grpo.errors import ConfigError


def _softmax_pick(router, logits, experts, norm: bool, cast: bool):
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, experts)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if cast else weights


def _qwen_like(router, logits, experts):  # Qwen2-MoE, Qwen3-MoE, OLMoE: softmax, pick, renormalise
    return _softmax_pick(router, logits, experts, router.norm_topk_prob, cast=True)


def _mixtral(router, logits, experts):  # softmax in fp32, pick, always renormalised, weights stay fp32
    weights = F.softmax(logits.float(), dim=-1).gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True)


def _gpt_oss(router, logits, experts):  # pick the logits (bias included), then softmax over the k
    picked = logits.gather(-1, experts)
    return F.softmax(picked, dim=1, dtype=picked.dtype)


def _deepseek_v3(router, logits, experts):  # sigmoid, pick, renormalise, scale (fp32 logits)
    weights = logits.sigmoid().gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# Router class (transformers 5.x) -> its rule from logits and chosen experts to the experts' weights.
# Each is its class's forward with `torch.topk` replaced by a gather; add a family by reading its forward.
WEIGHTS = {
    "Qwen3MoeTopKRouter": _qwen_like,
    "Qwen2MoeTopKRouter": _qwen_like,
    "OlmoeTopKRouter": _qwen_like,
    "MixtralTopKRouter": _mixtral,
    "GptOssTopKRouter": _gpt_oss,
    "DeepseekV3TopkRouter": _deepseek_v3,
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_router(module) -> bool:
    name = type(module).__name__.lower()
    return name.endswith("topkrouter") and hasattr(module, "top_k")


def moe_layers(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of every MoE layer, in layer order; [] for a dense model."""
    found = []
    for name, module in model.named_modules():
        if is_router(module):
            m = _LAYER.search(name)
            if m is None:
                raise ValueError(f"routing: cannot tell which decoder layer the router {name!r} belongs to "
                                 "(expected a module path with `layers.<i>.`).")
            found.append((int(m.group(1)), module))
    return sorted(found, key=lambda pair: pair[0])


def is_moe(model) -> bool:
    return bool(moe_layers(model))


def top_k(model) -> int:
    """Experts per token (every MoE layer of a supported model routes to the same number)."""
    ks = {router.top_k for _, router in moe_layers(model)}
    if len(ks) != 1:
        raise ValueError(f"routing: expected one top_k for every MoE layer, found {sorted(ks)}.")
    return ks.pop()


def _check_supported(routers) -> None:
    unknown = sorted({type(r).__name__ for r in routers} - set(WEIGHTS))
    if unknown:
        raise NotImplementedError(
            f"routing replay does not know the router {', '.join(unknown)}: supported are {', '.join(WEIGHTS)}. "
            "Set rollout.routing_replay=false and routing_observe=false, or add the family's rule to grpo/moe/routing.py WEIGHTS."
        )


@dataclass
class Recording:
    """The experts each router chose, per forward call: `calls[j]` is `[N_j, L, K]` for the j-th forward
    (N_j its tokens, flattened from `[B, T]` as the routers see them)."""

    layers: int
    per_router: list[list[torch.Tensor]] = field(default_factory=list)

    @property
    def calls(self) -> list[torch.Tensor]:
        counts = {len(c) for c in self.per_router}
        if len(counts) != 1:
            raise RuntimeError(f"routing: the routers ran a different number of times ({sorted(counts)}).")
        return [torch.stack([c[j] for c in self.per_router], dim=1) for j in range(counts.pop())]

    def routes(self, batch: int) -> torch.Tensor:
        """The recorded calls as one `[B, T, L, K]` tensor, calls joined along time: a prefill of the
        prompts and then one call per generated token (`generate` with a KV cache), or one full forward."""
        return torch.cat([c.reshape(batch, -1, *c.shape[1:]) for c in self.calls], dim=1)


@contextlib.contextmanager
def record(model):
    """Record the experts every router of `model` chooses while the block runs (`Recording`)."""
    routers = [r for _, r in moe_layers(model)]
    rec = Recording(layers=len(routers), per_router=[[] for _ in routers])

    def hook(i):
        def save(module, inputs, output):
            rec.per_router[i].append(output[2].detach().to("cpu", torch.long))
        return save

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


@dataclass
class Replayed:
    """What a replay did, counted over every forward inside the block (0-dim tensors once counted: read
    them once, after the step): token-layers that fell back to the trainer's own router (-1 in the
    routes: padding and each row's last token too, so not a measure of what the sampler left out; that
    is `unrouted`, over the batch) out of those replayed; and of the token-layers given a route, how
    many the router, left to itself on the same input, would have sent elsewhere (`flips`: the
    sampler/trainer disagreement that replay corrects, R3's "routers that disagree per forward")."""

    fallback: Any = 0
    total: Any = 0
    flips: Any = 0
    given: Any = 0

    @property
    def flip_fraction(self) -> float:
        return float(self.flips) / float(self.given) if float(self.given) else 0.0


def wants_routes(rollout) -> bool:
    """Whether the sampler returns its routed experts: to replay them (rollout.routing_replay) or to
    count how often the trainer's routers disagree with them (rollout.routing_observe)."""
    return bool(rollout.routing_replay or rollout.routing_observe)


def setting(rollout) -> str:
    """The setting that asked for routes, as a user writes it (for messages)."""
    return "rollout.routing_replay=true" if rollout.routing_replay else "rollout.routing_observe=true"


@contextlib.contextmanager
def replay(model, routes: torch.Tensor | None, done: Replayed | None = None, force: bool = True):
    """Every forward of `model` inside the block routes token t of MoE layer l to `routes[.., t, l, :]`
    (`[B, T, L, K]` laid out like the forward's input ids). None replays nothing (a dense model, or
    replay off). Yields its `Replayed` counts (added to `done` where given). `force` False
    (rollout.routing_observe): the routers keep their own choice and only the counts are taken."""
    done = Replayed() if done is None else done
    if routes is None:
        yield done
        return
    layers = moe_layers(model)
    routers = [r for _, r in layers]
    _check_supported(routers)
    if routes.dim() != 4 or routes.shape[2] != len(routers):
        raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)} for a model with {len(routers)} MoE "
                         f"layers; expected [batch, tokens, {len(routers)}, top_k].")
    check_routes(routes, [r.num_experts for r in routers])
    flat = routes.reshape(-1, routes.shape[2], routes.shape[3])

    def hook(i, layer):
        def forced(module, inputs, output):
            logits, _, own = output
            given = flat[:, i].to(own.device)
            if given.shape != own.shape:
                raise ValueError(
                    f"routing replay: the router of layer {layer} routed {own.shape[0]} tokens to {own.shape[1]} experts "
                    f"each; the routes give {given.shape[0]} x {given.shape[1]}. Routes must be laid out like input_ids."
                )
            missing = (given < 0).any(dim=-1, keepdim=True)
            differs = (own.sort(dim=-1).values != given.sort(dim=-1).values).any(dim=-1, keepdim=True) & ~missing
            done.flips = done.flips + differs.sum()  # on the device: no host sync per layer
            done.given = done.given + (~missing).sum()
            done.fallback = done.fallback + missing.sum()
            done.total += given.shape[0]
            if not force:
                return None  # the router's own output: observed, not replayed
            given = torch.where(missing, own, given)
            return logits, WEIGHTS[type(module).__name__](module, logits, given), given
        return forced

    # first among the router's hooks: a `record` entered before (verify's) records what the experts used
    handles = [r.register_forward_hook(hook(i, layer), prepend=True) for i, (layer, r) in enumerate(layers)]
    try:
        yield done
    finally:
        for h in handles:
            h.remove()


def check_routes(routes: torch.Tensor, experts: list[int]) -> None:
    """Refuse routes `[B, T, L, K]` that no router of the model can take (ValueError, naming what was
    found): an expert id outside [0, experts[l]) other than -1, a row mixing -1 with ids, or an expert
    twice in one row. Unchecked, an id >= E fails deep in the experts' gather (on CUDA a device assert),
    and the others replay silently wrong: -2 or a half row fall back to the trainer's router, a
    duplicate weighs one expert twice. Vectorised, with one host read per replay call."""
    limit = torch.tensor(experts, device=routes.device)[None, None, :, None]
    outside = ((routes < -1) | (routes >= limit)).any(dim=-1)  # [B, T, L]
    given = routes >= 0
    mixed = given.any(dim=-1) & ~given.all(dim=-1)
    ordered = routes.sort(dim=-1).values
    twice = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(dim=-1)
    if not bool((outside | mixed | twice).any()):
        return
    found = []
    for name, bad in (("an expert id outside [0, num_experts) and not -1", outside),
                      ("-1 beside expert ids (a row is all -1, not given, or all ids)", mixed),
                      ("an expert twice", twice)):
        if bad.any():
            b, t, layer = (int(i) for i in bad.nonzero()[0])
            found.append(f"{int(bad.sum())} with {name} (first: batch row {b}, token {t}, MoE layer {layer}: "
                         f"{routes[b, t, layer].tolist()})")
    raise ValueError(f"routing replay: the sampler's routes have token-layer rows no router can take: "
                     f"{'; '.join(found)}. Each row lists top_k distinct experts in [0, {max(experts)}) or is all -1. "
                     "The sampler routed with another model than the trainer's (check the engine's model and the "
                     "weight sync), or its routes were read wrong (grpo/moe/vllm_capture.py, served_routes.py); "
                     "rollout.routing_replay=false trains without them.")


def unrouted(routes_BLMK: torch.Tensor | None, attention_mask_BL: torch.Tensor) -> tuple[float, float]:
    """(token-layers the sampler gave no route, token-layers it forwarded) over a batch's real tokens
    but each row's last (sampled, never forwarded: no route by design); (0, 0) without routes. The
    first over the second is `routing/unrouted_fraction`: what replay left to the trainer's own router,
    chiefly prompt blocks the prefix cache served with no row in the batch to take them from
    (`grpo.batch.share_prompt_routes`)."""
    if routes_BLMK is None:
        return 0.0, 0.0
    real = attention_mask_BL.bool()
    forwarded = real & F.pad(real[:, 1:], (0, 1), value=False)  # a real token followed by one: not the last
    missing = (routes_BLMK[..., 0] < 0) & forwarded[..., None]  # [B, L, M]
    return float(missing.sum()), float(forwarded.sum()) * routes_BLMK.shape[2]


def flip_fraction(own: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """The fraction of token-layers whose set of experts differs between `own` and `sampled` (both
    `[B, T, L, K]`; the order within a row does not count), over the tokens where `mask` `[B, T]` is
    true; sampled rows with a -1 (not given) are left out."""
    a, b = own.sort(dim=-1).values, sampled.sort(dim=-1).values
    differs = (a != b).any(dim=-1)  # [B, T, L]
    valid = (sampled >= 0).all(dim=-1)
    if mask is not None:
        valid = valid & mask.bool().unsqueeze(-1)
    n = int(valid.sum())
    return float((differs & valid).sum()) / n if n else 0.0


def check(cfg) -> None:
    """rollout.routing_replay / routing_observe against the rest of the config (called by
    grpo.config.validate; the backend checks its own part, RolloutBackend.check_routing): routes are not
    carried into a vision-language model's rows yet; routing_observe beside routing_replay would be
    ignored (the forwards replay)."""
    if not wants_routes(cfg.rollout):
        return
    if cfg.rollout.routing_replay and cfg.rollout.routing_observe:
        raise ConfigError("rollout.routing_observe=true beside rollout.routing_replay=true: the forwards replay the "
                          "sampler's routes and observe would change nothing (replay logs routing/flip_fraction too). "
                          "Keep rollout.routing_replay=true to train with the sampler's experts, or set it false to "
                          "only measure how often the routers disagree (routing_observe=true); not both.")
    if cfg.model.path == "tiny_vlm":
        raise ConfigError(f"{setting(cfg.rollout)} with a vision-language model: not supported yet; set it false.")


def check_policy(model, rollout) -> None:
    """rollout.routing_replay / routing_observe against the loaded policy (the backends ask before
    starting an engine)."""
    if rollout is None or not wants_routes(rollout):
        return
    if not is_moe(model):
        name = setting(rollout)
        raise ConfigError(f"{name} needs a Mixture-of-Experts policy; this model has no MoE layers "
                          f"that grpo/moe/routing.py knows (routers: {', '.join(WEIGHTS)}). Set {name.replace('true', 'false')}.")
    _check_supported([r for _, r in moe_layers(model)])
