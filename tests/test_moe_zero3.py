"""ZeRO-3 with a Mixture-of-Experts policy (grpo/moe/zero3.py): which MoE blocks must be ZeRO-3 leaves
beyond DeepSpeed's own list, by value for every family routing.py knows; that Zero3Strategy marks
them (and Zero2Strategy does not); and 2 processes whose ranks route to disjoint experts end with the
weights of one process over both ranks' rows, for fused experts and for experts that are modules of
their own and run only when chosen (issue 50)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers as T
from deepspeed.utils import get_z3_leaf_modules

from grpo.moe import zero3
from grpo.parallel import zero
from tests.conftest import ROOT, compose_cfg
from tests.test_moe_routing import tiny
from tests.test_parallel import TORCHRUN

# family -> its MoE block, and whether DeepSpeed 0.19.8 marks it as a leaf by itself
BLOCKS = {
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", True),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", True),
    "mixtral": ("MixtralSparseMoeBlock", True),
    "olmoe": ("OlmoeSparseMoeBlock", False),
    "gpt_oss": ("GptOssMLP", False),
    "deepseek_v3": ("DeepseekV3MoE", False),
}


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_the_leaves_deepspeed_does_not_list_are_added_by_family(family):
    model = tiny(family)
    block, listed = BLOCKS[family]
    assert [c.__name__ for c in zero3.moe_blocks(model)] == [block]
    assert [c.__name__ for c in zero3.missing_leaves(model)] == ([] if listed else [block])
    marked = zero3.mark_leaves(model)  # the listed ones too: a user's leaf_module.classes replaces DeepSpeed's list
    assert [c.__name__ for c in marked] == [block]
    # both MoE layers' blocks flagged, nothing else (deepseek_v3: 3 layers, the first dense)
    assert [type(m).__name__ for m in get_z3_leaf_modules(model)] == [block] * 2


def test_deepspeeds_default_leaves_still_hold_qwen3_moe():
    """The DeepSpeed internal zero3.py reads: an upgrade that moves or empties it fails here."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    assert "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock" in zero3.deepspeed_default_leaves()
    assert zero3._qualified(Qwen3MoeSparseMoeBlock) in zero3.deepspeed_default_leaves()


def test_a_dense_model_has_no_moe_blocks():
    model = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                                             num_key_value_heads=1, intermediate_size=32))
    assert zero3.moe_blocks(model) == [] and zero3.mark_leaves(model) == []
    assert get_z3_leaf_modules(model) == []


class _Initialized(Exception):
    pass


@pytest.mark.parametrize("strategy, marked", [(zero.Zero3Strategy, True), (zero.Zero2Strategy, False)])
def test_zero3_strategy_marks_the_blocks_before_deepspeed_initialize(monkeypatch, strategy, marked):
    """What `deepspeed.initialize` is handed (stopped there: no process group in this process)."""
    import deepspeed

    seen = []

    def initialize(model, **_):
        seen.extend(type(m).__name__ for m in get_z3_leaf_modules(model))
        raise _Initialized

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(zero, "init_deepspeed_comm", lambda *_: None)
    cfg = compose_cfg("parallel=zero3")
    with pytest.raises(_Initialized):
        strategy(cfg.parallel, tiny("olmoe"), cfg.algo, total_steps=1)
    assert seen == (["OlmoeSparseMoeBlock"] * 2 if marked else [])


def _worker(out, model: str, procs: int, timeout_s: int = 300) -> dict:
    launch = [sys.executable] if procs == 1 else [*TORCHRUN, "--standalone", f"--nproc_per_node={procs}"]
    try:
        done = subprocess.run([*launch, "tests/moe_zero3_worker.py", str(out), model], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as e:  # ZeRO-3 ranks that gather different parameters wait on each other
        raise AssertionError(f"{model} on {procs} process(es) still running after {timeout_s} s: a hang") from e
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _expert_updates(update: dict[str, torch.Tensor]) -> list[float]:
    """The largest change of each expert's down projection, every layer: fused (`experts.down_proj`,
    `[E, H, I]`) or one module per expert (`experts.experts.<e>.down.weight`)."""
    fused = [u.amax(dim=(1, 2)) for k, u in update.items() if k.endswith("mlp.experts.down_proj")]
    looped = [u.max().reshape(1) for k, u in update.items() if k.endswith(".down.weight") and ".experts.experts." in k]
    return torch.cat(fused + looped).tolist()


@pytest.mark.starts_process
@pytest.mark.parametrize("model, leaf, experts", [
    ("tiny_moe", "Qwen3MoeSparseMoeBlock", 4 * 8),  # fused experts; DeepSpeed's own leaf
    ("olmoe_loop", "OlmoeSparseMoeBlock", 2 * 8),  # one module per expert, run only when chosen; zero3.py's leaf
])
def test_zero3_with_disjoint_routing_on_two_processes_matches_one(tmp_path, model, leaf, experts):
    """ZeRO-3 (tests/moe_zero3_worker.py: the project's Zero3Strategy and policy_update, fp32, random
    init, 2 optimizer steps of 8 rows) with rows 0-3 replayed onto experts 0-3 and rows 4-7 onto
    experts 4-7: on 2 processes (gloo) rank 0 takes rows 0-3 and rank 1 rows 4-7, so no expert sees
    tokens from both ranks. Both models finish (no hang) with one process's weights over all 8 rows,
    and each step's gradient norm (before clipping; AdamW's update is blind to a gradient's scale,
    so this is what catches a sum where a mean belongs).

    Tolerances: weights atol 1e-4 against an update of about 1.5e-2 per element (lr 1e-2, 2 steps);
    measured max difference 1.6e-5 (tiny_moe) and 2.2e-5 (olmoe_loop) on a 2-core CPU, 2026-11-28,
    from elements whose gradient is ~1e-9, where AdamW's g / (|g| + 1e-8) turns float reordering into
    a visible fraction of lr. Gradient norms rtol 1e-5 (measured 1.4e-7 and 1.0e-7).
    Broken on purpose: rank 1's rows routed onto experts 0-3 too: weights differ by 3.0e-2; the loss
    not multiplied by the world size in ZeroStrategy.backward: weights still within 1e-4 (AdamW,
    clipping), gradient norms off by 2x; olmoe_loop without zero3.mark_leaves in Zero3Strategy: rank 0
    aborts in its first forward (gloo "Received data size doesn't match expected size", 4096 vs 64
    bytes: the ranks gathered different experts), rank 1's connection is reset, the run fails in 18 s."""
    one = _worker(tmp_path / "one.pt", model, 1)
    two = _worker(tmp_path / "two.pt", model, 2)
    assert one["leaves"] == two["leaves"] == [leaf]
    init = one["init"]
    assert all(torch.equal(init[k], two["init"][k]) for k in init)
    update = {k: (one["final"][k] - init[k]).abs() for k in init}
    diff = max((one["final"][k] - two["final"][k]).abs().max().item() for k in init)
    print(f"{model}: largest update {max(u.max().item() for u in update.values()):.3g}, max difference {diff:.2e}, "
          f"grad norms {one['grad_norms']} / {two['grad_norms']}")
    # every expert of every layer was trained: on 2 processes each by one rank only
    moved = _expert_updates(update)
    assert len(moved) == experts and min(moved) > 5e-3, moved
    assert diff < 1e-4, diff
    assert one["grad_norms"] == pytest.approx(two["grad_norms"], rel=1e-5)
