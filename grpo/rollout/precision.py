"""What an fp32 engine computes in on a GPU.

vLLM runs an fp32 model's attention in its Triton kernel (FLASH_ATTN and FLASHINFER take fp16/bf16 only),
and Triton's `tl.dot` on fp32 inputs defaults to TF32 on NVIDIA tensor cores: Q, K, P and V rounded to a
10-bit mantissa. The trainer's fp32 attention is not TF32 (torch keeps matmuls at "highest"; vLLM's worker
sets that too). So the sampler's logprobs were not the trainer's: on one H200 (vLLM 0.26.0, the default
tiny run, 40 steps; docs/results/gpu_vllm.md) the largest |trainer - sampler| logprob per step was 5e-3 to
7.6e-2 (mean over tokens 3e-4 to 1e-3), and grpo.verify's `sync` row failed at 3.9e-2 against its 2e-2.

`TRITON_F32_DEFAULT=ieee` (Triton's own switch, read when a kernel compiles and part of its cache key)
makes every fp32 `tl.dot` full fp32, so an fp32 run samples from the fp32 model it trains. A value the
user set is kept: `tf32` on purpose trades that for speed, and the parity checks' bound follows it
(`grpo.guards.parity`). bf16 and fp16 dots are untouched by the switch.
"""

from __future__ import annotations

import os

TRITON_F32 = "TRITON_F32_DEFAULT"
TF32_VALUES = ("tf32", "tf32x3")  # Triton's settings that round fp32 operands (tf32x3: three TF32 products)


def engine_env(dtype: str, cuda: bool, environ=None) -> dict[str, str]:
    """The variables an engine serving `dtype` on this device needs before its kernels compile: full-fp32
    Triton dots for an fp32 engine on CUDA, unless `environ` (default os.environ) already says."""
    environ = os.environ if environ is None else environ
    if dtype == "float32" and cuda and not environ.get(TRITON_F32):  # empty is unset to Triton: TF32
        return {TRITON_F32: "ieee"}
    return {}


def apply_engine_env(dtype: str, cuda: bool) -> None:
    """`engine_env` into this process's environment (a colocated engine, or grpo.serve before it execs vLLM)."""
    os.environ.update(engine_env(dtype, cuda))


def triton_tf32(environ=None) -> bool:
    """Whether fp32 Triton dots in this environment round to TF32: the user's TRITON_F32_DEFAULT says so.
    (Unset means TF32 to Triton, but an fp32 engine on CUDA is always started with `engine_env`.)"""
    environ = os.environ if environ is None else environ
    return environ.get(TRITON_F32, "").lower() in TF32_VALUES
