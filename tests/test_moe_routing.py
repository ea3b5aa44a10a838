"""Routing replay (grpo/moe/routing.py) on tiny MoE models of every family it supports, built in code:
replaying a model's own routing gives its logits bitwise; other experts change them and the router
still learns; a missing route keeps the router's own choice; generate's routing, recorded call by
call, is the routing of one forward over the whole sequence."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from grpo.moe import routing

COMMON = dict(vocab_size=100, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**COMMON, head_dim=32, num_hidden_layers=2, num_experts=8,
                                          moe_intermediate_size=32, intermediate_size=64),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**COMMON, num_hidden_layers=2, num_experts=8, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=32, intermediate_size=64),
    "mixtral": lambda: T.MixtralConfig(**COMMON, head_dim=32, num_hidden_layers=2, num_local_experts=8, intermediate_size=32),
    "olmoe": lambda: T.OlmoeConfig(**COMMON, num_hidden_layers=2, num_experts=8, intermediate_size=32),
    "gpt_oss": lambda: T.GptOssConfig(**COMMON, head_dim=32, num_hidden_layers=2, num_local_experts=8, intermediate_size=32),
    # layer 0 dense: routes index MoE layers, not decoder layers
    "deepseek_v3": lambda: T.DeepseekV3Config(**COMMON, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                                              n_shared_experts=1, moe_intermediate_size=32, intermediate_size=64, n_group=1,
                                              topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=16,
                                              qk_nope_head_dim=16, v_head_dim=16),
}


def tiny(family: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    config.eos_token_id = config.pad_token_id = config.bos_token_id = 0
    return T.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def own_routes(model, ids):
    with routing.record(model) as rec, torch.no_grad():
        logits = model(ids).logits
    return logits, rec.routes(ids.shape[0])


def other_experts(routes, experts: int = 8):
    return (routes + 1) % experts  # every row's experts moved by one: distinct within the row, all different


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replaying_a_models_own_routing_gives_its_logits_bitwise(family, dtype):
    model = tiny(family, dtype)
    ids = torch.randint(1, 100, (3, 9), generator=torch.Generator().manual_seed(1))
    logits, routes = own_routes(model, ids)
    assert routes.shape == (3, 9, len(routing.moe_layers(model)), 2)
    with routing.replay(model, routes) as done, torch.no_grad():
        replayed = model(ids).logits
    assert torch.equal(replayed, logits)
    assert (int(done.fallback), done.total) == (0, 3 * 9 * len(routing.moe_layers(model)))
    assert int(done.given) == done.total and done.flip_fraction == 0.0  # the router agrees with itself


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_experts_change_the_logits_and_the_router_still_learns(family):
    model = tiny(family)
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    logits, routes = own_routes(model, ids)
    forced = other_experts(routes)
    with routing.replay(model, forced) as done:
        out = model(ids).logits
        with routing.record(model) as rec:  # the replayed forward's routers report the forced experts
            model(ids)
    assert done.flip_fraction == 1.0  # every token-layer was sent elsewhere than its router chose
    assert torch.equal(rec.routes(2), forced)
    assert (out.detach() - logits).abs().max() > 1e-3
    out.logsumexp(-1).mean().backward()
    for _, router in routing.moe_layers(model):
        grad = router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_a_missing_route_keeps_the_routers_own_choice():
    model = tiny("qwen3_moe")
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    logits, routes = own_routes(model, ids)
    forced = other_experts(routes)
    forced[0, :3] = -1  # the first three tokens of row 0: not given by the sampler
    with routing.replay(model, forced) as done, torch.no_grad():
        model(ids)
        with routing.record(model) as rec:
            model(ids)
    used = rec.routes(2)
    assert torch.equal(used[0, :3], routes[0, :3]) and torch.equal(used[0, 3:], forced[0, 3:])
    assert int(done.fallback) == 2 * 3 * 2  # two forwards x three tokens x two layers
    assert int(done.given) == int(done.flips) == 2 * (2 * 6 - 3) * 2  # flips count given routes only


def test_routes_laid_out_unlike_the_input_are_refused():
    model = tiny("qwen3_moe")
    ids = torch.randint(1, 100, (2, 6))
    _, routes = own_routes(model, ids)
    with pytest.raises(ValueError, match="laid out like input_ids"), routing.replay(model, routes[:, :5]):
        model(ids)
    with pytest.raises(ValueError, match=r"expected \[batch, tokens, 2, top_k\]"), routing.replay(model, routes[:, :, :1]):
        pass


@pytest.mark.parametrize("bad, found", [
    ([8, 1], r"1 with an expert id outside \[0, num_experts\) and not -1 \(first: batch row 1, token 2, MoE layer 1: \[8, 1\]\)"),
    ([-2, -2], r"1 with an expert id outside .*\[-2, -2\]"),  # -1 alone marks a route not given
    ([3, -1], r"1 with -1 beside expert ids .*\[3, -1\]"),  # half a row would fall back whole
    ([3, 3], r"1 with an expert twice .*\[3, 3\]"),  # would weigh one expert twice
], ids=["id_E", "minus_2", "half_given", "duplicate"])
def test_routes_no_router_can_take_are_refused_naming_what_was_found(bad, found):
    """Checked once, as the replay opens: before, an id of E failed deep in the experts' gather (a
    device assert on CUDA) and the others replayed silently wrong."""
    model = tiny("qwen3_moe")  # 8 experts, top-2, 2 MoE layers
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(7))
    _, routes = own_routes(model, ids)
    routes[0, 1] = -1  # a token not given on both layers: fine
    routes[1, 2, 1] = torch.tensor(bad)
    with pytest.raises(ValueError, match=r"the sampler's routes have token-layer rows no router can take: " + found):
        with routing.replay(model, routes):
            pass
    with pytest.raises(ValueError, match=found), routing.replay(model, routes, force=False):  # observed too
        pass


def test_unrouted_counts_the_forwarded_token_layers_left_without_a_route():
    """Row 0: left pad, 4 real tokens; row 1: 5 real tokens, right pad. Each row's last real token is
    never forwarded by the sampler (no route by design), so 3 + 4 = 7 tokens x 2 layers = 14 count;
    of them row 0's token 1 (both layers) and row 1's token 0 (layer 1) have none: 3 of 14."""
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    routes = torch.tensor([0, 1]).expand(2, 5, 2, 2).clone()
    routes[0, 0] = -1  # padding: not counted
    routes[0, 4] = -1  # the last token: not counted
    routes[0, 1] = -1
    routes[1, 0, 1] = -1
    assert routing.unrouted(routes, mask) == (3.0, 14.0)
    assert routing.unrouted(None, mask) == (0.0, 0.0)


def test_an_unknown_router_family_is_refused_by_name():
    model = tiny("qwen3_moe")
    router = routing.moe_layers(model)[0][1]
    router.__class__ = type("FancyTopKRouter", (type(router),), {})
    with pytest.raises(NotImplementedError, match="FancyTopKRouter.*rollout.routing_replay=false"):
        with routing.replay(model, torch.zeros(1, 1, 2, 2, dtype=torch.long)):
            pass


def test_a_dense_model_has_no_moe_layers():
    model = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                                             num_key_value_heads=1, intermediate_size=32))
    assert routing.moe_layers(model) == [] and not routing.is_moe(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_generates_routing_recorded_call_by_call_is_one_forwards_routing(family):
    """Prefill, then one row per generated token: P + C - 1 rows per sequence (the last token sampled
    is never forwarded), equal to a single forward over prompt and completion."""
    model = tiny(family)
    prompt = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(4))
    with routing.record(model) as rec, torch.no_grad():
        seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                              do_sample=False, pad_token_id=0)
    generated = rec.routes(2)
    assert generated.shape[1] == 5 + 4 - 1
    _, whole = own_routes(model, seqs[:, :-1])
    assert torch.equal(generated, whole)


def test_flip_fraction_by_value():
    own = torch.tensor([[[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]])  # [1, 4, 1, 2]
    sampled = torch.tensor([[[[1, 0]], [[2, 4]], [[-1, 5]], [[7, 0]]]])
    # token 0: same set in another order (no flip); 1: flipped; 2: not given (left out); 3: flipped
    assert routing.flip_fraction(own, sampled) == pytest.approx(2 / 3)
    assert routing.flip_fraction(own, sampled, mask=torch.tensor([[1, 1, 1, 0]])) == pytest.approx(1 / 2)
    assert routing.flip_fraction(own, own) == 0.0


def test_a_recording_opened_before_the_replay_sees_the_replayed_experts():
    """What the experts used, whichever block was entered first (grpo.verify records around the update's
    replaying forward)."""
    model = tiny("qwen3_moe")
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(5))
    _, routes = own_routes(model, ids)
    forced = other_experts(routes)
    with torch.no_grad(), routing.record(model) as rec, routing.replay(model, forced):
        model(ids)
    assert torch.equal(rec.routes(2), forced)


@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward_in_the_block", "backward_after_it"])
def test_gradient_checkpointings_recompute_replays_only_inside_the_block(backward_inside):
    """The recompute in backward runs the routers again: inside `replay` (as grpo/update/step.py's
    `forwarding` keeps it open through the caller's backward) the gradients are those without
    checkpointing; after the block the recompute routes on its own, which torch's checkpoint refuses."""
    import copy

    base = tiny("qwen3_moe").train()
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(6))
    _, routes = own_routes(base, ids)
    forced = other_experts(routes)

    def grads(checkpointing: bool, inside: bool):
        model = copy.deepcopy(base)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with routing.replay(model, forced):
            loss = model(ids).logits.logsumexp(-1).mean()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(False, True)
    if not backward_inside:
        with pytest.raises(torch.utils.checkpoint.CheckpointError):
            grads(True, False)
        return
    checkpointed = grads(True, True)
    assert max(float((plain[n] - checkpointed[n]).abs().max()) for n in plain) < 1e-6
