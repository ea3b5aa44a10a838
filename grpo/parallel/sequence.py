"""Ulysses sequence parallelism for the update (`parallel.sequence_parallel=S`), through DeepSpeed's
own `UlyssesSPAttentionHF` (deepspeed.runtime.sequence_parallel.ulysses_sp, the ALST work).

Groups of S consecutive ranks share every row of the update. Rollouts are unchanged: each rank still
samples and scores its own prompts, so engines get whole prompts and their placement does not change.
In the update each rank plans its micro-batches as without S; the S ranks of a group then exchange
them (`exchange`) and run every one of them together, each on 1/S of the row's columns. This module
is the strategy's side, handed to the update's forward (grpo/update/forward.py) as `split`: which
columns a rank runs (`columns`), the group's sum (`gather`), and the attention routed through the
group while a split forward and its backward run (`running`). The whole rows and their masks are
laid out by grpo/update/layouts.py (`rows(..., split_size=S)`); this module knows no update.

    columns   the row (padded, packed or shared) is widened to a multiple of S and cut in S
              consecutive slices; rank s runs the model on slice s, with the row's own position
              ids, so rotary positions are the unsplit row's
    attention DeepSpeed's all-to-all turns [local columns, all heads] into [all columns, H/S heads],
              the model's own SDPA runs there with the whole row's mask (causal and padding, the
              packed block-causal one, the shared-prompt tree), and a second all-to-all goes back.
              DeepSpeed's wrapper drops the model's mask (it relies on position ids and flash
              kernels); ours hands the attention the row's mask, built here from the whole row,
              so the three layouts stay exact
    logprobs  the head runs on the completion tokens predicted from this rank's columns; one
              differentiable all-reduce over the group gives every rank the micro-batch's whole
              logprobs_BT, the loss is computed alike on the S ranks, and each backs off 1/S of it:
              the all-reduce's backward hands each rank the whole gradient for its own tokens, and
              the attention's all-to-all routes the other ranks' share back to them

Gradients: every rank's parameter gradients are a part of the micro-batch's; the strategies sum
them over all ranks already (DDP's all-reduce; ZeRO's averaged reduce times the world), so
data parallelism is world / S rows at a time with no change to their reductions. Statistics
(entropy, sampler difference, the loss's own value) count on the micro-batch's owner only.

The split is the process's while a split forward and its backward run (`_ACTIVE`; module state, not
thread state, because CUDA runs a backward's recompute on autograd's own threads), for the thread
that entered it and the backwards it runs: an attention call from any other thread takes the model's
own attention (`routed`). In-process generation (hf, colocated) and in-process reward models take
turns with the update in the trainer's thread anyway (grpo/rewards/__init__.py runs them there).

What a split needs of the model is checked when the strategy is built (`check_model`): SDPA
attention (transformers routes eager attention past the registry this wraps), no sliding window,
heads and key/value heads that S divides (or S a multiple of the key/value heads).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as tdist

from grpo.errors import ConfigError
from grpo.modeling import attention_of, sliding_window_of, text_config

# the row being run while a split forward (and its backward: checkpointed layers recompute there)
# is under way, and the thread that entered it; None otherwise, when the wrapped attention is the model's own
_ACTIVE: dict = {"split": None, "mask": None, "thread": None}


@contextlib.contextmanager
def active(split, mask_R1WW):
    """SDPA attention runs through `split` (DeepSpeed's, with the whole row's mask; None: causal)
    until the block ends, for calls from this thread and from the backwards it runs (`routed`)."""
    _ACTIVE["split"], _ACTIVE["mask"], _ACTIVE["thread"] = split, mask_R1WW, threading.get_ident()
    try:
        yield
    finally:
        _ACTIVE["split"] = _ACTIVE["mask"] = _ACTIVE["thread"] = None


def in_backward() -> bool:
    """Whether this thread runs an autograd backward now (torch's thread-local graph task, -1 outside
    one): on CUDA a backward and its checkpointed layers' recompute run on autograd's device threads."""
    return torch._C._current_graph_task_id() != -1


def routed():
    """The split an attention call from this thread goes into, or None (the model's own attention):
    the split's all-to-alls are the group's sequence, so no other thread's model (a reward model, a
    generation) may enter them."""
    split = _ACTIVE["split"]
    if split is None or (threading.get_ident() != _ACTIVE["thread"] and not in_backward()):
        return None
    return split


def sequence_groups(world: int, size: int) -> list[list[int]]:
    """The ranks of each group sharing rows: `size` consecutive ranks (as DeepSpeed's own groups)."""
    if size < 1 or world % size:
        raise ValueError(f"{world} ranks cannot form groups of {size}")
    return [list(range(g * size, (g + 1) * size)) for g in range(world // size)]


def check_size(size: int, strategy: str, world: int | None) -> None:
    """Raise ConfigError for a `parallel.sequence_parallel` the strategy and world cannot take."""
    if size < 1:
        raise ConfigError(f"parallel.sequence_parallel={size} must be >= 1 (1: rows are not split).")
    if size == 1:
        return
    if strategy == "single":
        raise ConfigError(f"parallel.sequence_parallel={size} splits rows across ranks; parallel=single has one. "
                          f"Use parallel=zero2, zero3 or ddp with a multiple of {size} processes.")
    if world is not None and world % size:
        raise ConfigError(f"parallel.sequence_parallel={size} with {world} processes: the processes must be a "
                          f"multiple of {size} (groups of {size} ranks share rows). Change one of them.")


def check_heads(size: int, heads: int, kv_heads: int) -> None:
    """Ulysses gives each rank heads / size query heads: `size` must divide the heads, and divide the
    key/value heads or be a multiple of them (each rank then holds a copy of one)."""
    if heads % size:
        raise ConfigError(f"parallel.sequence_parallel={size}: the model has {heads} attention heads, which {size} "
                          f"does not divide; choose a divisor of {heads}.")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(f"parallel.sequence_parallel={size}: the model has {kv_heads} key/value heads; {size} must "
                          f"divide them or be a multiple of them.")


def check_model(size: int, model) -> None:
    """Raise ConfigError if `model` cannot run split rows (see the top)."""
    attention = attention_of(model)
    if attention != "sdpa":
        raise ConfigError(f"parallel.sequence_parallel={size} needs SDPA attention, the model runs "
                          f"{attention!r}; load it with model.attn_implementation=sdpa (or set "
                          f"parallel.sequence_parallel=1).")
    window = sliding_window_of(model)
    if window:
        raise ConfigError(f"parallel.sequence_parallel={size}: the model attends through a sliding window of "
                          f"{window}, which the split rows' masks do not carry; set parallel.sequence_parallel=1.")
    text = text_config(model)
    heads = text.num_attention_heads
    check_heads(size, heads, getattr(text, "num_key_value_heads", None) or heads)


def columns(width: int, size: int, rank: int) -> slice:
    """The columns of a row `width` wide (a multiple of `size`) that split rank `rank` runs."""
    if width % size:
        raise ValueError(f"a row {width} wide does not split in {size}")
    n = width // size
    return slice(rank * n, (rank + 1) * n)


class SequenceParallel:
    """One rank's part in its group of `size` ranks sharing rows (see the top)."""

    def __init__(self, size: int, model):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: F401 (fails early)

        check_model(size, model)
        world, rank = tdist.get_world_size(), tdist.get_rank()
        self.size = size
        self.group = None
        for ranks in sequence_groups(world, size):  # every rank creates every group, in the same order
            group = tdist.new_group(ranks)
            if rank in ranks:
                self.group, self.rank = group, ranks.index(rank)
        self.text = text_config(model)
        self._ulysses: dict[int, object] = {}
        install()

    def ulysses(self, rows: int):
        """DeepSpeed's attention for micro-batches of `rows` rows (its shapes fix the batch size)."""
        if rows not in self._ulysses:
            # deepspeed, transformers: heavy, only with sequence_parallel > 1
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            heads = self.text.num_attention_heads
            self._ulysses[rows] = UlyssesSPAttentionHF(
                attn=ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"],  # transformers' own SDPA, not split_attention
                batch_size=rows,
                attn_head_count=heads,
                attn_head_size=getattr(self.text, "head_dim", None) or self.text.hidden_size // heads,
                kv_head_count=getattr(self.text, "num_key_value_heads", None) or heads,
                num_hidden_layers=self.text.num_hidden_layers,
                process_group=self.group,
                seq_length_is_variable=True,
            )
        return self._ulysses[rows]

    def exchange(self, items: list) -> list[tuple[object, bool]]:
        """Every group member's `items`, in rank order, each with whether it is this rank's own:
        what the group runs together (the same list on every member)."""
        gathered = [None] * self.size
        tdist.all_gather_object(gathered, items, group=self.group)
        return [(item, r == self.rank) for r, mine in enumerate(gathered) for item in mine]

    @contextlib.contextmanager
    def running(self, rows):
        """The attention routed through the group for `rows` (grpo/update/layouts.py `Rows`, laid out
        whole) until the block ends, so the caller's forward, backward and any recompute in it run split."""
        with active(self, rows.mask):
            yield self

    def columns(self, width: int) -> slice:
        """This rank's columns of a row `width` wide."""
        return columns(width, self.size, self.rank)

    def gather(self, values_N: torch.Tensor) -> torch.Tensor:
        """The sum over the group of each rank's `values_N` (0 where another rank computed the value),
        differentiable: the backward hands each rank the whole gradient."""
        return GroupSum.apply(values_N, self.group)


class GroupSum(torch.autograd.Function):
    """The sum over a process group, whose backward is the sum of the gradients over the group: with
    the same loss on every rank, S times each rank's own gradient (the loss is backed off 1/S)."""

    @staticmethod
    def forward(ctx, values, group):
        ctx.group = group
        out = values.clone()
        tdist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


def install() -> None:
    """Route SDPA attention through `split_attention` (once per process; `check_model` made sure the
    model runs SDPA): outside a split forward it calls transformers' own SDPA unchanged."""
    # transformers: heavy; grpo.config imports this module
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
    if ALL_ATTENTION_FUNCTIONS["sdpa"] is not own:
        return  # installed already

    def split_attention(module, query, key, value, attention_mask, *args, **kwargs):
        split = routed()
        if split is None:
            return own(module, query, key, value, attention_mask, *args, **kwargs)
        # the model's mask covers this rank's columns only; the whole row's (None: causal) goes to DeepSpeed's
        with own_key_value_groups(module):
            return split.ulysses(query.shape[0])(module, query, key, value, _ACTIVE["mask"], *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = split_attention


@contextlib.contextmanager
def own_key_value_groups(module):
    """Give the attention `module` back its own `num_key_value_groups` when the block ends. With fewer
    key/value heads than S (check_heads allows it) DeepSpeed's wrapper sets it to the split's
    (query heads per copied key/value head on this rank) on every call and never restores it, so the
    model's next unsplit forward (grpo.verify's split row, in-process generation, a layout probe)
    repeated its key/value heads too few times and failed on a shape. The split's value is needed
    only inside the call: the attention's backward is autograd's, and a checkpointed layer's
    recompute comes through this wrapper again."""
    own = getattr(module, "num_key_value_groups", None)
    try:
        yield
    finally:
        if own is not None:
            module.num_key_value_groups = own


def build(size: int, model) -> SequenceParallel | None:
    """The rank's SequenceParallel for `parallel.sequence_parallel=size`, or None at 1. DeepSpeed's
    communication layer must be up (its all-to-all runs there; grpo.parallel.zero.init_deepspeed_comm,
    which the DDP strategy calls too when it splits rows)."""
    if size == 1:
        return None
    return SequenceParallel(size, model)
