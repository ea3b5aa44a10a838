"""grpo/update/forward.py (kernels) and grpo/update/layouts.py (widths): the trainer's attention never takes cuDNN's SDPA on CUDA (its backward returns
NaN with a mask at widths 64 mod 128: REVIEW G1), and rows are rounded to a multiple of 128 there.
Decided in plain functions tested here by value; applied where the forwards (and the backward) run,
which these tests check on the CPU by forcing the CUDA choices (MATH only, widths of 128)."""

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend

import grpo.update.forward
import grpo.update.layouts
from grpo.update.forward import sdpa_backends, torch_version
from grpo.update.layouts import row_width, width_multiple
from grpo.config import AlgoConfig
from grpo.update.layouts import micro_batch_plan, pack, pack_shared
from grpo.parallel.single import SingleStrategy
from grpo.update import accumulate_gradients, loss_norm, score_tokens
from tests.test_packing import completion_tokens, spread_batch

LAYOUTS = ["padded", "packed", "shared"]


def test_the_sdpa_backends_leave_out_cudnn_on_cuda_by_value():
    for version in ("2.11.0", "2.13.0+cu130", "2.14.0a0+git1234", "3.0.0"):
        backends = sdpa_backends("cuda", version, masked=True)
        assert backends == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], version
        assert SDPBackend.CUDNN_ATTENTION not in backends
    assert sdpa_backends("cuda", "2.10.1", masked=True) is None  # before the regression (pytorch#196678)
    assert sdpa_backends("cuda", "2.13.0", masked=False) is None  # the NaN needs an explicit mask
    assert sdpa_backends("cpu", "2.13.0+cpu", masked=True) is None  # the CPU: torch's own choice
    assert sdpa_backends("cuda") is not None and sdpa_backends("cpu") is None  # this torch (2.13 here)
    assert torch_version("2.13.0+cpu") == (2, 13) and torch_version("2.9.1") == (2, 9)
    with pytest.raises(ValueError):
        torch_version("nightly")


def test_widths_round_to_128_on_cuda_only_by_value():
    assert width_multiple("cuda") == 128 and width_multiple("cpu") == 1
    assert [row_width(w, 128) for w in (1, 64, 128, 129, 704, 768)] == [128, 128, 128, 256, 768, 768]
    assert [row_width(w, 1) for w in (1, 5, 704)] == [1, 5, 704]  # the CPU: as the data gives them
    assert all(row_width(w, 128) % 128 != 64 for w in range(1, 1000))


def force_cuda_choices(monkeypatch):
    """The choices CUDA gets, forced on the CPU: MATH only (a restriction, as on CUDA), widths of 128.
    Returns the backends of every sdpa_kernel entered."""
    entered = []
    real_kernel = grpo.update.forward.sdpa_kernel

    def spy(backends, *a, **k):
        entered.append(list(backends))
        return real_kernel(backends, *a, **k)

    monkeypatch.setattr(grpo.update.forward, "sdpa_kernel", spy)
    monkeypatch.setattr(grpo.update.forward, "sdpa_backends", lambda device_type, version=None, masked=True: [SDPBackend.MATH])
    monkeypatch.setattr(grpo.update.layouts, "width_multiple", lambda device_type: 128)
    return entered


def watch_attention(model, calls: list) -> list:
    """At every attention call of `model`: (flash allowed, inside a backward pass (gradient
    checkpointing's recompute), the row width). Returns the hooks, to remove."""
    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        calls.append((torch.backends.cuda.flash_sdp_enabled(), torch._C._current_graph_task_id() != -1, hidden.shape[1]))

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for n, m in model.named_modules() if n.endswith("self_attn")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scoring_under_the_cuda_choices_gives_the_same_logprobs(tiny_lm, layout, monkeypatch):
    """Every scoring forward goes through sdpa_kernel with the chosen backends, in rows 128 wide; the
    logprobs are the CPU's own (the padding attends to itself only, after every real token)."""
    model, tok = tiny_lm
    batch = spread_batch(tok)
    real = completion_tokens(batch)
    before = score_tokens(model, batch, 0.7, 10_000, layout=layout)
    entered, calls = force_cuda_choices(monkeypatch), []
    hooks = watch_attention(model, calls)
    try:
        after = score_tokens(model, batch, 0.7, 10_000, layout=layout)
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(after[real], before[real], rtol=0, atol=1e-5)
    assert layout == "padded" or (after[~real] == 0).all()  # packed rows score completion tokens only
    assert entered and all(e == [SDPBackend.MATH] for e in entered)
    assert calls and not any(flash for flash, _, _ in calls)  # every attention call inside the restriction
    assert all(width % 128 == 0 for _, _, width in calls), calls


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_under_the_cuda_choices_with_gradient_checkpointing(tiny_lm, layout, monkeypatch):
    """The loss's forward and the backward run under the restriction, also gradient checkpointing's
    recompute of each layer inside the backward, in rows 128 wide; the gradients are the CPU's own."""
    from grpo.models import enable_gradient_checkpointing

    base, tok = tiny_lm
    batch = spread_batch(tok)
    norm = loss_norm(batch, max_len=14, gen_tokens_per_step=float(batch.mask_BT.sum()))
    algo = OmegaConf.structured(AlgoConfig(packing=layout != "padded", shared_prompt=layout == "shared",
                                           micro_batch_tokens=512))
    score_tokens(base, batch, 1.0, 10_000, layout=layout)  # the model's one-off layout probes (copied with it)
    grads, calls = [], []
    for restricted in (False, True):
        entered = force_cuda_choices(monkeypatch) if restricted else []
        model = copy.deepcopy(base).train()
        enable_gradient_checkpointing(model)
        hooks = watch_attention(model, calls) if restricted else []
        accumulate_gradients(SingleStrategy(None, model, algo, total_steps=1), batch, algo, norm, 1.0)
        for h in hooks:
            h.remove()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert entered and all(e == [SDPBackend.MATH] for e in entered)
    assert any(in_backward for _, in_backward, _ in calls), "no recompute seen: gradient checkpointing did not run"
    assert not any(flash for flash, _, _ in calls), calls  # forward and recompute alike
    assert all(width % 128 == 0 for _, _, width in calls), calls
    assert len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-5, msg=n)


def test_layouts_at_the_cuda_width_by_value(tiny_lm):
    """pack and pack_shared with multiple=128: the same rows, then padding to 128 columns; the padding
    of a shared row attends to itself only; a plan counts the rounded width against the cap."""
    _, tok = tiny_lm
    b = tok.bos_token_id
    from grpo.batch import collate
    from grpo.rollout.base import Rollouts

    batch = collate([[b, 5, 6], [b, 5, 6], [b, 7]],
                    Rollouts([[10, 11], [12], [13, 14, 15]], [[0.0] * 2, [0.0], [0.0] * 3], ["stop"] * 3, 0),
                    torch.zeros(3), tok.pad_token_id, False)
    args = (batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width)
    for narrow, wide in ((pack(*args, [3]), pack(*args, [3], multiple=128)),
                         (pack_shared(*args, [[2, 1]]), pack_shared(*args, [[2, 1]], multiple=128))):
        W = narrow.input_ids_RW.shape[1]
        assert W < 128 and wide.input_ids_RW.shape == (1, 128)  # 14 packed, 11 shared
        assert wide.input_ids_RW[:, :W].equal(narrow.input_ids_RW) and (wide.input_ids_RW[:, W:] == 0).all()
        assert wide.position_ids_RW[:, :W].equal(narrow.position_ids_RW)
        assert all(x.equal(y) for x, y in zip(wide.hidden_at + wide.token_at, narrow.hidden_at + narrow.token_at))
    assert wide.mask_R1WW[..., :W, :W].equal(narrow.mask_R1WW)
    assert wide.mask_R1WW[0, 0, W:].equal(torch.eye(128, dtype=torch.bool)[W:])  # padding: itself only
    assert not wide.mask_R1WW[0, 0, :W, W:].any()  # no real position attends to padding
    # the CPU keeps the data's width: the existing by-value layouts
    assert pack(*args, [3]).input_ids_RW.shape == (1, 14)
    # a cap of 256 positions: rows as wide as the longest sequence (under 128), or 2 rows of 128
    big = spread_batch(tok)
    longest = int(big.attention_mask_BL.sum(1).max())
    plain, rounded = (micro_batch_plan(big, 256, "packed", multiple=m) for m in (1, 128))
    assert longest <= 128 and len(rounded) >= len(plain)
    assert all(len(groups) * 128 <= 256 for _, groups in rounded)
