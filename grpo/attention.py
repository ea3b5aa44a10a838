"""Which attention kernels the trainer's forwards may take, and how wide their rows are: both decided
in plain functions (tested on the CPU), applied where the forwards run (grpo/logprobs.py, the backward
in grpo/update.py) and where the rows are laid out (grpo/layouts.py).

cuDNN's SDPA (REVIEW G1): on H100/H200 with torch >= 2.11 its backward returns NaN in grad_q when
an explicit attention mask is passed (bool or float, even all-True), the key length is 64 mod 128,
and a query row's logsumexp is below about -88.7 (attention-sink heads, as Qwen2.5's; fully masked
left-pad rows). pytorch issue 196678, hit by TRL users in its issue 7181; which torch release fixes it
is not known here. Every training layout passes a mask (padded: the padding; packed: the block-causal
mask transformers builds from the restarting position ids; shared: the tree mask), so on CUDA the
trainer's forwards run under `sdpa_kernel` with cuDNN left out: flash attention stays for what it
takes, memory-efficient attention takes the masked calls (the cost: cuDNN's Hopper speed-up on
them). The backward runs under it too: gradient checkpointing recomputes a layer's forward there.
fp32 is safe by itself (cuDNN attention takes fp16/bf16 only), but the choice does not depend on it.

Widths: on CUDA the rows a forward runs (packed, shared, padded) are padded to a multiple of 128,
the tile the attention kernels work in, so no width is 64 mod 128 even where cuDNN would be taken
after all. On the CPU widths stay as the data gives them (dense attention costs width^2 there).
Not run on a GPU yet (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDNN_MASKED_NAN_SINCE = (2, 11)  # the first torch with the cuDNN SDPA backward NaN (no fixed release known)
CUDA_WIDTH_MULTIPLE = 128
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


def width_multiple(device_type: str) -> int:
    """What the width of a forward's rows is rounded up to on `device_type`: 128 on CUDA, 1 (as the
    data gives it) on the CPU."""
    return CUDA_WIDTH_MULTIPLE if device_type == "cuda" else 1


def row_width(width: int, multiple: int) -> int:
    """`width` rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(1, -(-width // multiple)) * multiple
