"""The update's one forward: per-token logprobs (and entropy) of a micro-batch's completion tokens
from its `Rows` (grpo/update/layouts.py), for every layout, for a group of ranks that splits the rows
(sequence parallelism), for VLMs, for the old logprobs, the reference and grpo.verify.

The LM head runs here a chunk of tokens at a time.

The model's forward returns its last hidden states (`output_hidden_states`, with `logits_to_keep=1`
so its own head runs on one position), and the head runs here on pieces of at most about
`LOGIT_CHUNK_BYTES` of fp32 logits. With gradients and more than one piece, each piece is recomputed
in the backward pass (non-reentrant `torch.utils.checkpoint`), so no tokens x vocabulary tensor is
kept for backward: at 8,192 tokens and a 152k vocabulary the whole batch's fp32 logits are 5 GB, and
the logit - logsumexp that replaced log_softmax kept them (and their gradient) all the same. The
price is the head's forward run twice in training (measured in `python -m grpo.bench update-memory`).
A micro-batch whose logits fit in one piece keeps them (a frozen head keeps none, below) and runs
the head once: on SmolLM2 (2 CPU cores, 160 completion tokens) three pieces of 53 tokens with their
recompute took a fifth of the update's matmul time, the head's matmuls at 53 rows running at a third
of the machine's rate (docs/results/mfu.md).

Under ZeRO-3 every call of the head gathers its weight, a collective: the number of pieces comes
from the micro-batch cap (`algo.micro_batch_tokens`), the same on every rank, never from this
rank's own token count (elsewhere it comes from the micro-batch's own count). A piece is recomputed
there too while the head's weight trains: DeepSpeed's forward hook gathers the weight again for the
recompute and releases it right after, but torch's checkpoint kept a detached alias of what it saved
(`x.detach() if x.requires_grad`, torch/utils/checkpoint.py `_recomputation_hook`), so the backward
reads the gathered weight (the same update bit for bit, tied and untied heads, 2 ranks; the alias is
one more copy of the head's weight while a piece's backward runs, against the logits of every piece
but one kept to the end of the backward: 187 and 440 MB less at the peak in two CPU measurements,
docs/results/memory.md, each about the kept logits less one head copy; a 152k x 3584 bf16 head is
1.1 GB, four 441-token pieces' fp32 logits 1.0 GB, so a micro-batch of five pieces or fewer, 2,205
tokens, may peak higher there; not measured on a GPU). A frozen head
could not be recomputed under ZeRO-3 (checkpoint keeps the parameter itself, which the release has
turned into its empty placeholder, and torch refuses it: "Recomputed values ... have different
metadata"); a plain frozen linear head (LoRA's) takes its gradient to the hidden states in the forward
instead, under every strategy (grpo/update/frozen_head.py: no logits kept, no recompute, one gather a
piece); any other frozen ZeRO-3 head (a LoRA layer on the head) keeps its pieces' logits.

Heads that are not `lm_head(hidden)` (Gemma's logit soft-capping, Cohere's logit scale, ...) are
found once per model (grpo/update/support.py); those models take their own logits, from the first
position read on.

Split rows (`split`: grpo/parallel/sequence.py's, handed in by the strategy): the model runs on this
rank's columns of the whole rows; the head on the completion tokens predicted from them; the group's
sum (`split.gather`, differentiable) gives every rank the whole micro-batch's logprobs. Every rank keeps
the graph through its model forward, even with no token of its own, so every rank's backward joins
the attention's all-to-alls.

A MoE policy's training forward (`routed_logprobs` with its `experts`) also returns the router's
logits, from which grpo/moe_model.py computes the load-balancing loss and the expert load over the
rows' real tokens (`Rows.real_RW`): the statistics of a packed row are its sequences', not its padding's.

Attention kernels (REVIEW G1): on H100/H200 with torch >= 2.11 cuDNN's SDPA backward returns NaN in
grad_q when an explicit attention mask is passed (bool or float, even all-True), the key length is 64
mod 128, and a query row's logsumexp is below about -88.7 (attention-sink heads, as Qwen2.5's; fully
masked left-pad rows). pytorch issue 196678, hit by TRL users in its issue 7181; which torch release
fixes it is not known here. Every training layout passes a mask (padded: the padding; packed: the
block-causal mask transformers builds from the restarting position ids; shared: the tree mask), so on
CUDA the trainer's forwards run under `sdpa_kernel` with cuDNN left out (`training_attention`): flash
attention stays for what it takes, memory-efficient attention takes the masked calls (the cost:
cuDNN's Hopper speed-up on them). The backward runs under it too (grpo/update/step.py): gradient
checkpointing recomputes a layer's forward there. fp32 is safe by itself (cuDNN attention takes
fp16/bf16 only), but the choice does not depend on it. Not run on a GPU yet (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from grpo import moe_model, vision
from grpo.modeling import precision, unwrapped
from grpo.update import frozen_head, layouts

LOGIT_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one piece (152k vocabulary: 441 tokens)
CUDNN_MASKED_NAN_SINCE = (2, 11)  # the first torch with the cuDNN SDPA backward NaN (no fixed release known)
# every SDPA backend but cuDNN's, in torch's own order of preference
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def torch_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.13.0+cpu' -> (2, 13), '2.14.0a0+git1234' -> (2, 14)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def sdpa_backends(device_type: str, version: str = torch.__version__, masked: bool = True) -> list[SDPBackend] | None:
    """The SDPA backends the trainer's attention may take on `device_type` under torch `version`
    when it passes an explicit mask (`masked`): every one but cuDNN's on CUDA from torch 2.11 (see the
    top); None (torch's own choice) elsewhere: on the CPU, on older torch, and without a mask (the
    NaN needs one)."""
    if device_type != "cuda" or not masked or torch_version(version) < CUDNN_MASKED_NAN_SINCE:
        return None
    return list(WITHOUT_CUDNN)


def training_attention(device, masked: bool = True):
    """The context the trainer's forwards (and backward) run in on `device`: `sdpa_kernel` over
    `sdpa_backends`, or nothing where that is None."""
    backends = sdpa_backends(torch.device(device).type, masked=masked)
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each chosen token under softmax(logits / temperature) -> logprobs_BT.

    As logit[token] - logsumexp(logits): no B x T x V log_softmax is kept for the backward pass
    beside the logits (at 16k tokens x 152k vocabulary that is 10 GB in fp32)."""
    logits_BTV = logits_BTV.float()
    if temperature != 1.0:
        logits_BTV = logits_BTV / max(temperature, 1e-6)
    return logits_BTV.gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits_BTV, dim=-1)


@torch.no_grad()
def entropy(logits_BTV: torch.Tensor, rows_per_chunk: int = 8) -> torch.Tensor:
    """Entropy of each position's distribution -> entropy_BT (a metric: no gradient), a few rows at
    a time, so the fp32 log_softmax never exists for the whole batch."""
    out = []
    for chunk in logits_BTV.split(rows_per_chunk):
        logp = torch.log_softmax(chunk.float(), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out) if out else logits_BTV.new_zeros(logits_BTV.shape[:2]).float()


def head_pieces(model, max_tokens: int, tokens: int) -> int:
    """How many pieces the head runs on for a micro-batch of `tokens` completion positions: under
    ZeRO-3 from the micro-batch cap `max_tokens` (each piece's call gathers the head's weight, a
    collective every rank must make alike), otherwise from `tokens` (0 cap: `tokens` everywhere)."""
    sharded = hasattr(unwrapped(model).get_output_embeddings().weight, "ds_id")
    return pieces_for(max_tokens if sharded and max_tokens else tokens, vocab_size_of(model))


def pieces_for(max_tokens: int, vocab_size: int) -> int:
    """How many pieces the head runs on for a micro-batch of at most `max_tokens` positions."""
    per_piece = max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))
    return max(1, math.ceil(max_tokens / per_piece))


def _piece(head, hidden_NH, tokens_N, temperature: float, with_entropy: bool):
    logits_NV = head(hidden_NH)
    logp_N = token_logprobs(logits_NV[None], tokens_N[None], temperature)[0]
    if not with_entropy:
        return logp_N, None
    with torch.no_grad():
        return logp_N, entropy(logits_NV[None].detach() / max(temperature, 1e-6))[0]


def head_logprobs(model, hidden_BTH: torch.Tensor, tokens_BT: torch.Tensor, temperature: float, pieces: int,
                  with_entropy: bool = False):
    """logprobs_BT (and entropy_BT) of `tokens_BT` from the final hidden states, in `pieces` calls
    of the head (some may be empty); with gradients and several pieces, each recomputed in backward."""
    head = unwrapped(model).get_output_embeddings()
    B, T, H = hidden_BTH.shape
    grad = torch.is_grad_enabled() and hidden_BTH.requires_grad
    frozen = grad and frozen_head.applies(head)  # its gradient to the hidden states taken in the forward
    # not a frozen ZeRO-3 weight of any other kind of head (see the top)
    recompute = grad and pieces > 1 and (head.weight.requires_grad or not hasattr(head.weight, "ds_id"))
    logps, ents = [], []
    with precision(model):
        for h_NH, t_N in zip(hidden_BTH.reshape(B * T, H).tensor_split(pieces), tokens_BT.reshape(-1).tensor_split(pieces)):
            if frozen:
                logp_N, ent_N = frozen_head.piece(head, h_NH, t_N, temperature, with_entropy)
            elif recompute:
                logp_N, ent_N = checkpoint(_piece, head, h_NH, t_N, temperature, with_entropy, use_reentrant=False)
            else:
                logp_N, ent_N = _piece(head, h_NH, t_N, temperature, with_entropy)
            logps.append(logp_N)
            ents.append(ent_N)
    logp_BT = torch.cat(logps).reshape(B, T)
    return logp_BT, (torch.cat(ents).reshape(B, T) if with_entropy else None)


def positions(x_RW: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x_RW[at] (a [rows, columns, ...] tensor at (row, column) pairs) -> [N, ...]. The shared-prompt layout
    reads a prompt's last position once per completion (16 times at G=16), and on the CPU the backward of
    x[at] (index_put, accumulating) adds such repeats with atomics when torch has more than one thread, in
    the order the threads arrive: 2-thread runs drifted apart, at 1e-9 first, where 1 thread repeats bit
    for bit. On the CPU the positions are read through a flat index_select, whose backward (index_add_)
    adds them in index order, the same sums as one thread's. On CUDA x[at] stays: its sort-based backward
    is the deterministic one there."""
    if x_RW.device.type != "cpu":
        return x_RW[at]
    W = x_RW.shape[1]
    return x_RW.reshape(-1, *x_RW.shape[2:]).index_select(0, at[0] * W + at[1])


def vocab_size_of(model) -> int:
    vocab = unwrapped(model).get_output_embeddings().weight
    return getattr(vocab, "ds_shape", vocab.shape)[0]  # ZeRO-3: the full shape, not the local shard



def logprobs(model, rows, temperature: float, with_entropy: bool = False, max_tokens: int = 0, split=None):
    """(logprobs_BT, entropy_BT or None) of `rows`' completion tokens under `model`, in the micro-batch's
    B x T layout (0 where no completion token is). `rows` must be on the model's device. `max_tokens`:
    the micro-batch cap, which sets the number of the head's pieces alike on every rank (0: this
    micro-batch's own count). `split`: a group's column split and gather (see the top), or None."""
    logp_BT, ent_BT, _ = routed_logprobs(model, rows, temperature, with_entropy, max_tokens, split)
    return logp_BT, ent_BT


def routed_logprobs(model, rows, temperature: float, with_entropy: bool = False, max_tokens: int = 0, split=None,
                    experts: moe_model.Experts | None = None):
    """`logprobs`, and with a MoE model's `experts` the forward's routing (grpo/moe_model.py `Routing`:
    the router's load-balancing loss and per-expert load over the rows' real tokens; with `split`,
    this rank's columns'), else None: (logprobs_BT, entropy_BT or None, Routing or None)."""
    W = rows.input_ids_RW.shape[1]
    cols = slice(0, W) if split is None else split.columns(W)
    ids_RW, pos_RW = rows.input_ids_RW[:, cols], rows.position_ids_RW[:, cols]
    if rows.rope_3RW is not None:  # a VLM: the vision tower's output over the image slots, M-RoPE positions
        inputs = dict(inputs_embeds=vision.input_embeddings(model, ids_RW, rows.image_slots_RW[:, cols], rows.images),
                      position_ids=torch.cat([pos_RW[None], rows.rope_3RW[:, :, cols]]))
    else:
        inputs = dict(input_ids=ids_RW, position_ids=pos_RW)
    if split is None and rows.mask is not None:  # a split's mask goes to the group's attention, whole
        inputs["attention_mask"] = rows.mask
    if split is not None or rows.layout != "padded":  # a cache would make transformers build a plain causal mask
        inputs["use_cache"] = False
    if experts is not None:  # one [rows x columns, E] tensor per MoE layer in the output (grpo/moe_model.py)
        inputs["output_router_logits"] = True
    at, tokens_n, mine_N = rows.hidden_at, rows.tokens_N, None
    if split is not None:  # the tokens predicted from this rank's columns
        mine_N = (at[1] >= cols.start) & (at[1] < cols.stop)
        at, tokens_n = (at[0][mine_N], at[1][mine_N] - cols.start), tokens_n[mine_N]
    with training_attention(ids_RW.device):
        if rows.plain_head:
            out = model(**inputs, logits_to_keep=1, output_hidden_states=True)
            hidden_RWH = out.hidden_states[-1]
            pieces = head_pieces(model, max_tokens, tokens_n.shape[0])
            logp_n, ent_n = head_logprobs(model, positions(hidden_RWH, at)[None], tokens_n[None], temperature, pieces, with_entropy)
            logp_n, ent_n = logp_n[0], ent_n[0] if with_entropy else None
        else:  # a head of its own: the model's logits from the first position read on
            width = ids_RW.shape[1]
            keep = width - int(at[1].min()) if at[1].numel() else 1
            out = model(**inputs, logits_to_keep=keep)
            logits_nV = positions(out.logits, (at[0], at[1] - (width - keep)))
            logp_n = token_logprobs(logits_nV[None], tokens_n[None], temperature)[0]
            with torch.no_grad():
                ent_n = entropy(logits_nV[:, None].detach() / max(temperature, 1e-6))[:, 0] if with_entropy else None
    if split is not None:  # each rank's tokens in the group's sum: the whole micro-batch's on every rank
        where = (mine_N.nonzero()[:, 0],)
        zeros_N = torch.zeros(rows.tokens_N.shape, device=logp_n.device)
        logp_n = split.gather(zeros_N.index_put(where, logp_n))
        ent_n = split.gather(zeros_N.index_put(where, ent_n.detach())) if with_entropy else None
    routing = None if experts is None else moe_model.routing_of(out.router_logits, rows.real_RW[:, cols], experts)
    zeros_BT = torch.zeros(rows.shape_BT, device=logp_n.device)
    return (zeros_BT.index_put(rows.token_at, logp_n), (zeros_BT.index_put(rows.token_at, ent_n) if with_entropy else None),
            routing)


def batch_logprobs(model, mb, temperature: float, with_entropy: bool = False, max_tokens: int = 0):
    """`logprobs` of micro-batch `mb` (grpo/update/layouts.py `MicroBatch`, or a Batch: padded; on the
    model's device), laid out as planned: for a caller outside the update's loop (tests, benches)."""
    if not isinstance(mb, layouts.MicroBatch):
        mb = layouts.MicroBatch(mb, "padded")
    return logprobs(model, layouts.rows(model, mb), temperature, with_entropy, max_tokens)
