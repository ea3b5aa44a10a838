"""The machine's dense matmul peak, what model FLOPs utilisation (MFU) is measured against.

Measured, not looked up: the best of a few square matmuls in the run's dtype, on the run's device, with
the threads the run uses (on a CPU, `torch.get_num_threads()` as the process set it: grpo/cpus.py). A
CPU's peak depends on its kernels (AVX2, AVX-512, AMX: 2 cores of this project's machines measure
about 0.3 TFLOP/s in fp32 and 1-1.9 in bf16 with AMX) and on what else runs on its cores, so a measured
figure is the honest one; a GPU's measured figure sits below its datasheet's, which is stated beside
it where known (`NOMINAL`). On a GPU, fp32 matmuls run as TF32 where torch allows it
(`torch.backends.cuda.matmul.allow_tf32`, or the float32 matmul precision), and the figure follows.
"""

from __future__ import annotations

import functools
import time

import torch

# dense (no sparsity) datasheet peaks, FLOP/s, by a name torch.cuda.get_device_name contains; the
# first key the name contains wins, so a variant with a lower peak (PCIe, NVL) comes before its family
NOMINAL = {
    "H100 PCIe": {torch.bfloat16: 756e12, torch.float16: 756e12, "tf32": 378e12, torch.float32: 51e12},
    "H100 NVL": {torch.bfloat16: 835e12, torch.float16: 835e12, "tf32": 417.5e12, torch.float32: 60e12},
    "H200 NVL": {torch.bfloat16: 835e12, torch.float16: 835e12, "tf32": 417.5e12, torch.float32: 60e12},
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, "tf32": 494.5e12, torch.float32: 67e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, "tf32": 494.5e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, "tf32": 156e12, torch.float32: 19.5e12},
}
SIZES = {"cpu": (1024,), "cuda": (8192,)}  # square: n x n @ n x n, 2 n^3 FLOPs


def dtype_key(device_type: str, dtype: torch.dtype):
    """fp32 on a GPU that runs it as TF32 is "tf32"."""
    if device_type == "cuda" and dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return dtype


def nominal_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak of `device` in `dtype`, FLOP/s; None where not known (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = next((t for key, t in NOMINAL.items() if key in name), None)
    return None if table is None else table.get(dtype_key(device.type, dtype))


@functools.lru_cache(maxsize=None)
def _measured(device: str, dtype: torch.dtype, threads: int, repeats: int, precision: str) -> float:
    device_type = torch.device(device).type
    best = 0.0
    generator = torch.Generator(device=device).manual_seed(0)
    for n in SIZES.get(device_type, (1024,)):
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        a @ b  # the kernel's first call (its setup, a GPU's clocks) is not timed
        for _ in range(repeats):
            if device_type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            a @ b
            if device_type == "cuda":
                torch.cuda.synchronize(device)
            best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


def measured_peak(device: torch.device | str, dtype: torch.dtype, repeats: int = 10, fresh: bool = False) -> float:
    """The best FLOP/s of a dense matmul in `dtype` on `device` with this process's threads; measured
    once per process for each (device, dtype, threads): about 0.1-0.2 s on 2 CPU cores in fp32. On the
    shared 2-core machines of this project the figure varies by about +-25% between processes (another
    tenant on the cores): compare MFU within one run, or across runs as ratios. `fresh`: measure again."""
    if fresh:
        _measured.cache_clear()
    return _measured(str(torch.device(device)), dtype, torch.get_num_threads(), repeats,
                     torch.get_float32_matmul_precision())  # TF32 or not: a key of its own
