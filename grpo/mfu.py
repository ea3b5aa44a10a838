"""Model FLOPs utilisation per phase of a step: the FLOPs each phase needed (grpo/flops.py) over its
seconds, against the device's measured dense matmul peak (grpo/peak.py).

What a step logs (metrics.jsonl, wandb; the console line shows `mfu/update`):

    flops/generate            the engines' work for the step's batches (every draw's)
    flops/update              old logprobs + reference + the training forwards and backwards
    flops/update_recompute    gradient checkpointing's second forward of the decoder layers (an upper
                              bound: their last matmuls are not redone): hardware work, not in the MFU
    mfu/update                flops/update / time/update_s / peak
    mfu/generate              flops/generate / time/batch_generate_s / peak, where the engines run on the
                              trainer's device (hf, colocated); a dedicated or remote engine's device
                              and its share of it are not the trainer's to measure
    mfu/step                  the step's counted FLOPs (generation where local) / step_s / peak (with
                              local generation, NaN at an asynchronous run's first and last max_staleness
                              steps: their seconds generate other than the one batch counted)
    update/real_token_frac    real tokens over the tokens the training forwards computed: the padding
                              waste of the layout (padded, packed, shared)
    update_tokens_per_s       real tokens through the training forwards per second of the update

Scoring runs reward functions (rules, a reward model's own forward, a judge's requests) and the sync
moves bytes: their seconds are in time/score_s and time/sync_s, and neither gets an MFU. On several
ranks flops/* and update_tokens_per_s are summed, mfu/* averaged (each rank against its own device).

The peak is measured once, at the start. A CPU shared with other work gives less then than later
(2.1x on this project's 2-core machines, under load), and a step could read above 100%: a phase that runs
faster than the peak raises it, with a warning, so no MFU exceeds 1 and later steps are measured
against the raised figure (summary.json: `peak_tflops_measured`, `peak_tflops_achieved`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import torch

from grpo import flops, peak
from grpo.flops import Shape, Work
from grpo.metrics import Count, Ratio

LOCAL_ENGINES = ("hf", "colocated")  # backends whose engines run on the trainer's own device


@dataclass
class Meter:
    shape: Shape
    peak: float  # FLOP/s, measured on the trainer's device in the run's compute dtype (raised: `against`)
    dtype: torch.dtype
    nominal: float | None  # the datasheet's, where known
    local_generation: bool
    recompute: bool  # gradient checkpointing
    achieved: float = 0.0  # the fastest phase so far, FLOP/s
    measured: float = field(init=False)  # the peak as measured at the start

    def __post_init__(self):
        self.measured = self.peak

    def against(self, rates: list[float]) -> float:
        """The peak this step's MFU is against: the measured one, raised to a phase's rate above it
        (the measurement was taken while the device was busier; an MFU above 1 is no utilisation)."""
        best = max(rates, default=0.0)
        self.achieved = max(self.achieved, best)
        if best > self.peak:
            if self.peak == self.measured:
                warnings.warn(f"mfu: a phase ran at {best / 1e12:.3g} TFLOP/s, above the matmul peak measured at the "
                              f"start ({self.measured / 1e12:.3g}; the device was busier then, e.g. another tenant on "
                              "a shared CPU). MFU is against the fastest phase from here; summary.json keeps both.",
                              stacklevel=2)
            self.peak = best
        return self.peak

    def metrics(self, generation: Work, update: dict[str, Work], times: dict[str, float], handed: int = 1) -> dict[str, float]:
        """`handed`: the batches the step handed to the engines; with local generation mfu/step needs one
        (the step's seconds then generate one batch, whose FLOPs are counted), else it is NaN."""
        train = update["train"]
        update_flops = (flops.forward_flops(self.shape, update["old"] + update["reference"] + train)
                        + flops.backward_flops(self.shape, train))
        gen_flops = flops.forward_flops(self.shape, generation)
        update_s, gen_s, step_s = times["time/update_s"], times["time/batch_generate_s"], times["step_s"]
        rate = lambda work, s: work / s if s > 0 else 0.0  # noqa: E731
        peak = self.against([rate(update_flops, update_s), rate(gen_flops, gen_s) if self.local_generation else 0.0])
        # work and throughput are summed over ranks, the padding share is the whole batch's (grpo/metrics.py);
        # an MFU is each rank's against its own device: the ranks' mean
        out = {
            "flops/generate": Count(gen_flops),
            "flops/update": Count(update_flops),
            "mfu/update": rate(update_flops, update_s) / peak,
            "update/real_token_frac": Ratio(train.tokens, train.computed),
            "update_tokens_per_s": Count(train.tokens / update_s if update_s > 0 else 0.0),
        }
        if self.recompute:
            # the decoder layers' forward again (the LM head is outside what transformers checkpoints); an
            # upper bound: non-reentrant checkpointing stops before each layer's last matmul, whose output
            # the backward does not need (1.25x the recompute counted by torch's FlopCounter on the tiny model)
            out["flops/update_recompute"] = Count(flops.forward_flops(self.shape, replace(train, head=0)))
        local = update_flops
        if self.local_generation:
            out["mfu/generate"] = rate(gen_flops, gen_s) / peak
            local += gen_flops
        out["mfu/step"] = rate(local, step_s) / peak if handed == 1 or not self.local_generation else math.nan
        return out

    def summary(self, model) -> dict:
        """The peak measured at the start, the fastest phase (the steps' MFU is against the larger so far),
        the peak measured again now (a shared machine's cores give more or less over a run), and the
        datasheet's."""
        device = next(model.parameters()).device
        return {"peak_tflops_measured": self.measured / 1e12,
                "peak_tflops_achieved": self.achieved / 1e12,
                "peak_tflops_at_end": peak.measured_peak(device, self.dtype, fresh=True) / 1e12,
                "peak_tflops_nominal": None if self.nominal is None else self.nominal / 1e12}


def meter(model, dtype: torch.dtype, backend: str, gradient_checkpointing: bool) -> Meter:
    """The run's meter: `model`'s shape, its device's peak in the run's `dtype` (model.dtype: the
    matmuls' dtype, also where fp32 master weights run under bf16 autocast), measured now."""
    device = next(model.parameters()).device
    return Meter(flops.shape_of(model), peak.measured_peak(device, dtype), dtype, peak.nominal_peak(device, dtype),
                 backend in LOCAL_ENGINES, gradient_checkpointing)

