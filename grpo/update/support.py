"""What a model supports, asked once per model and stored on it.

    plain_head    its logits are `get_output_embeddings()(last hidden state)`: the update runs the head
                  itself, in pieces (grpo/update/forward.py); a head of its own (Gemma's soft-capping,
                  Cohere's logit scale) gives its own logits, whole
    packs         it keeps attention inside each sequence of a packed row (restarting position ids,
                  no mask): algo.packing; a model that does not is refused, never trained on
                  attention mixed across sequences
    mask_dtype    the 4D mask it takes (bool for sdpa, its float dtype for eager), None if none
                  (flash attention); with `shares` the shared-prompt layout (algo.shared_prompt),
                  which a MoE asked for its router logits does not take (grpo/moe_model.py)
    window        its sliding window, if any: a 4D mask replaces the window transformers builds, so a
                  batch shares prompts only while its longest sequence is within the window

Each answer is a probe (a forward on a few tokens, in eval mode, so dropout and LoRA dropout cannot
make two forwards disagree) run on first use and kept as an attribute of the unwrapped model: a
model built later can never inherit another's answer (an `id()`-keyed cache could, at a reused
address: an eager model handed a bool mask is not masked at all). Under ZeRO-3 a probe's forward
gathers parameters, a collective: every rank asks the same questions in the same order, because
what is asked follows the configured layout only (`runnable_layout`), never the rank's own batch.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from grpo import moe_model
from grpo.errors import ConfigError
from grpo.modeling import attention_of, compute_dtype, precision, sliding_window_of, unwrapped

ATTRIBUTE = "_grpo_support"


def mask_dtype_for(model) -> torch.dtype | None:
    """The form of a custom 4D mask `model`'s attention takes: bool for sdpa (True where attended),
    the model's float dtype for eager attention (added to the scores); None for any other attention
    (flash attention takes no 4D mask)."""
    impl = attention_of(model)
    if impl == "sdpa":
        return torch.bool
    if impl == "eager":
        return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    return None


def mask_form(allowed: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True where attended) in the form an attention takes: bool as it is (sdpa); a float
    dtype: 0 where attended and the dtype's minimum elsewhere (eager attention adds it to the scores)."""
    if mask_dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=mask_dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(mask_dtype).min)


@dataclass
class Support:
    attention: Optional[str]  # the attention implementation the answers hold for
    plain_head: Optional[bool] = None
    packs: Optional[bool] = None
    shares: Optional[bool] = None  # the shared-prompt layout: a 4D mask taken and obeyed
    mask_dtype: Optional[torch.dtype] = None
    window: Optional[int] = None
    why_not_shared: Optional[str] = None
    warned: set = field(default_factory=set)


def support_of(model) -> Support:
    """The answers kept on `model` (asked anew if its attention implementation changed since)."""
    target = unwrapped(model)
    found = target.__dict__.get(ATTRIBUTE)
    if found is None or found.attention != attention_of(model):
        found = Support(attention_of(model), mask_dtype=mask_dtype_for(model), window=sliding_window_of(model))
        target.__dict__[ATTRIBUTE] = found
    return found


@contextlib.contextmanager
def evaluating(model):
    """Eval mode (no dropout) and no gradient for a probe, the model's mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


# A probe's bound on a position's relative difference, by the dtype the model computes in. Attending to
# the wrong tokens moves a position's state by about its own size (0.91 on the tiny model), so 0.1 still
# tells it apart; fp32 kernels agree to about 1e-4, but in bf16/fp16 the packed row (a mask: CUDA's
# mem-efficient kernel) and the sequence alone (no mask: flash) take different kernels, whose rounding
# reaches about 1e-2 on the last state of a 28-layer model (REVIEW Part 5, GPU-only notes; not yet
# measured on a GPU): 1e-2 there would refuse the CUDA default layout as "attends across the sequences".
PROBE_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 0.1, torch.float16: 0.1}


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float = 1e-2) -> bool:
    """Hidden states agree position by position: |a - b| within `tolerance` of |b| at every position
    (attending to the wrong tokens changes a position's state by about its own size; a model's
    outlier dimensions cannot hide a wrong position behind the largest value of another)."""
    a, b = a.float(), b.float()
    return bool(((a - b).norm(dim=-1) <= tolerance * b.norm(dim=-1).clamp(min=1e-6)).all())


def last_hidden(model, **inputs) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False, output_hidden_states=True,
                logits_to_keep=1)
    return out.hidden_states[-1][0]


def probe_plain_head(model) -> bool:
    device = next(model.parameters()).device
    ids = torch.tensor([[0, 1]], device=device)
    with evaluating(model):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.tensor([[0, 1]], device=device),
                    output_hidden_states=True, logits_to_keep=0)
        hidden = getattr(out, "hidden_states", None)
        if hidden is None:
            return False
        with precision(model):
            mine = unwrapped(model).get_output_embeddings()(hidden[-1]).float()
    return mine.shape == out.logits.shape and torch.allclose(mine, out.logits.float(), atol=1e-3, rtol=1e-3)


def probe_packs(model) -> bool:
    """A two-sequence row against its second sequence alone (a model attending across the restart,
    as a cache makes it: 0.91 of the state's size off on the tiny model)."""
    ids = torch.tensor([[1, 2, 3, 3, 1, 2]])
    with evaluating(model):
        packed = last_hidden(model, input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
        alone = last_hidden(model, input_ids=ids[:, 3:], position_ids=torch.tensor([[0, 1, 2]]))
    return close(packed[3:], alone, PROBE_TOLERANCE.get(compute_dtype(model), 1e-2))


# the row `1 2 | 3 3 | 1`: prompt 1 2, then the completions 3 3 and 1, each attending to the prompt and
# itself, positions running on from the prompt in each (as grpo/update/layouts.py `pack_shared` lays it)
SHARED_PROBE_IDS, SHARED_PROBE_POSITIONS = [[1, 2, 3, 3, 1]], [[0, 1, 2, 3, 2]]
SHARED_PROBE_MASK = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]


def probe_shares(model, mask_dtype: torch.dtype) -> bool:
    """The row `1 2 | 3 3 | 1` against `1 2 3 3` and `1 2 1`."""
    mask = mask_form(torch.tensor(SHARED_PROBE_MASK, dtype=torch.bool)[None, None], mask_dtype)
    with evaluating(model):
        row = last_hidden(model, input_ids=torch.tensor(SHARED_PROBE_IDS), attention_mask=mask,
                          position_ids=torch.tensor(SHARED_PROBE_POSITIONS))
        a = last_hidden(model, input_ids=torch.tensor([[1, 2, 3, 3]]), position_ids=torch.arange(4)[None])
        b = last_hidden(model, input_ids=torch.tensor([[1, 2, 1]]), position_ids=torch.arange(3)[None])
    return close(row, torch.cat([a, b[2:]]), PROBE_TOLERANCE.get(compute_dtype(model), 1e-2))


def has_plain_head(model) -> bool:
    support = support_of(model)
    if support.plain_head is None:
        support.plain_head = probe_plain_head(model)
    return support.plain_head


# The micro-batch layouts (grpo/update/layouts.py plans them; the config's `algo.layout` names one).
LAYOUTS = ("padded", "packed", "shared")


def runnable_layout(model, layout: str, longest: int = 0) -> tuple[str, str | None]:
    """(the layout `model` runs, why it is not `layout` or None) when the settings ask for `layout`
    (grpo/update/layouts.py `layout_of`) on a batch whose longest sequence is `longest` tokens: shared
    where the model takes a 4D mask, obeys it and no sliding window binds; else packed (one warning per
    model and reason: the same numbers, more positions); packed only where the model keeps packed
    sequences apart (else ConfigError). Called before the micro-batches are planned, so a fallback is
    planned within the token cap."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    if layout == "padded":
        return layout, None
    support = support_of(model)
    name = type(unwrapped(model)).__name__
    if getattr(getattr(unwrapped(model), "config", None), "vision_config", None) is not None:
        # a VLM's rows carry M-RoPE positions behind the text ones (grpo/vision.py): packed rows are kept
        # apart by those; the shared-prompt layout is not built for them
        why = f"{name} is a vision-language model, whose image prompts are not laid out in shared-prompt rows"
        if layout == "shared" and "vision" not in support.warned:
            support.warned.add("vision")
            warnings.warn(f"algo.shared_prompt is on, but {why}: the update packs them (the same numbers, more "
                          "positions). Set algo.shared_prompt=false to say so.", stacklevel=2)
        return "packed", why if layout == "shared" else None
    if support.packs is None:
        support.packs = probe_packs(model)
    if not support.packs:
        raise ConfigError(
            f"algo.packing=true, but {name} attends across the sequences of a packed row "
            f"(it does not restart attention where the position ids restart): set algo.packing=false.")
    if layout == "packed":
        return layout, None
    if support.shares is None:
        if moe_model.routed_experts(model) is not None:  # the update asks it for router logits (grpo/moe_model.py)
            support.why_not_shared = (f"{name} returns its router logits only with its load-balancing loss, which "
                                      "transformers computes over a 2D attention mask (a shared-prompt row's is 4D)")
        elif support.mask_dtype is None:
            support.why_not_shared = (f"{name} runs {support.attention!r} attention, which takes no custom 4D mask "
                                      "(sdpa and eager do)")
        elif not probe_shares(model, support.mask_dtype):
            support.why_not_shared = (f"{name} does not give a completion in a shared-prompt row what it gives it alone "
                                      "(it ignores a 4D mask)")
        support.shares = support.why_not_shared is None
    reason, why = "model", support.why_not_shared
    if why is None and support.window is not None and longest > support.window:
        reason, why = "window", (f"{name} attends over a sliding window of {support.window} tokens, which a 4D mask "
                                 f"replaces, and a batch has a sequence of {longest} tokens")
    if why is None:
        return "shared", None
    if reason not in support.warned:
        support.warned.add(reason)
        warnings.warn(f"algo.shared_prompt is on, but {why}: the update packs these micro-batches without sharing "
                      f"prompts (algo.packing; the same numbers, more positions). Set algo.shared_prompt=false to "
                      f"say so.", stacklevel=2)
    return "packed", why
