"""DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded) and stage 3 (parameters too),
optionally with the optimizer state offloaded to CPU. gloo on CPU, NCCL on GPU.

The DeepSpeed config is built from the `parallel` and `algo` groups. A user's own DeepSpeed JSON
(`parallel.deepspeed_config`) is merged in for everything the groups do not decide (bucket sizes,
prefetch, ...); a key both set to different values is an error that names both, never a silent
override. The optimizer and LR schedule are always the loop's own (`build_optimizer`), so the same
AdamW runs under every strategy and no DeepSpeed optimizer is JIT-compiled.

Gradient accumulation is the loop's, not DeepSpeed's (`managed_gradient_accumulation: false`):
any number of `backward()` calls, then one `step()` that is the boundary. Two consequences:
  - ZeRO reduces gradients during every backward and ZeRO-3 gathers parameters during every
    forward, so every rank must make the same number of forward/backward calls. `lockstep = True`
    tells the update to pad a rank with fewer micro-batches with zero-weight ones.
  - DeepSpeed averages gradients over ranks; the loop's losses are normalised by counts over all
    ranks already, so `backward` multiplies by the world size to get the sum DDP computes.

Under ZeRO-3 no rank ever holds a whole model: the policy and the reference are built inside
`deepspeed.zero.Init` (`partitioned_loading`, transformers' HfDeepSpeedConfig hook), so each rank
allocates its own shard and `from_pretrained` copies the checkpoint in module by module. The
reference (algo.beta > 0) is a DeepSpeed engine without optimizer: partitioned like the policy
under stage 3, a plain replica under stage 2 (stage 0: it has no gradients or optimizer state).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os

import torch
import torch.distributed as tdist

from grpo import dist, lora
from grpo.moe import zero3
from grpo.parallel import sequence
from grpo.errors import ConfigError
from grpo.weights import engine_parameters, group_by_size
from grpo.parallel.base import Strategy, build_optimizer


# DeepSpeed's batch keys; DeepSpeed computes train_batch_size from the other two (1 and 1) and the world size
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def deepspeed_config(cfg, algo, stage: int, dtype: torch.dtype) -> dict:
    """The group's DeepSpeed config, merged with the user's JSON; conflicts raise ConfigError."""
    ours = {
        "train_micro_batch_size_per_gpu": 1,  # the loop cuts its own micro-batches
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": algo.max_grad_norm,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": True},  # a NaN/inf norm skips the step (guards.py)
        "fp16": {"enabled": False},
        # bf16 parameters, fp32 gradients: the loop's many micro-batches (lockstep padding included)
        # are summed and reduce-scattered in fp32, as under single/ddp; without this DeepSpeed
        # accumulates in the model's dtype
        **({"data_types": {"grad_accum_dtype": "fp32"}} if dtype == torch.bfloat16 else {}),
        "zero_allow_untested_optimizer": True,  # torch AdamW, the loop's own
        "zero_force_ds_cpu_optimizer": False,  # offload keeps torch AdamW: no CPU-Adam build
        "steps_per_print": 2**31 - 1,
    }
    if cfg.offload_optimizer:
        ours["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if not cfg.deepspeed_config:
        return ours
    path = os.path.expanduser(cfg.deepspeed_config)
    try:
        with open(path) as f:
            user = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"parallel.deepspeed_config={path!r} could not be read as JSON: {e}") from e
    for key in ("optimizer", "scheduler"):
        if key in user:
            raise ConfigError(
                f"{path} sets '{key}', but the optimizer and LR schedule come from algo.* (lr, warmup_steps, "
                f"lr_schedule, weight_decay) under every strategy; remove '{key}' from the JSON."
            )
    for key in BATCH_KEYS:  # DeepSpeed's batch accounting is unused: the loop cuts and accumulates its own batches
        if user.get(key) == "auto":  # HF Trainer's placeholder: DeepSpeed would compare the string with numbers
            del user[key]
        elif key in user and user[key] != ours.get(key):
            raise ConfigError(
                f"{path} sets '{key}': {user[key]!r}, but the batch comes from algo.* (batch_size, group_size, "
                f"num_minibatches, micro_batch_tokens); remove '{key}' from the JSON (or set it to \"auto\")."
            )
    conflicts = []
    merged = _merge(user, ours, "", conflicts)
    if conflicts:
        lines = "\n  ".join(conflicts)
        raise ConfigError(
            f"{path} disagrees with the parallel/algo config groups:\n  {lines}\n"
            "Remove these keys from the JSON (or set them to \"auto\"), or change the group's value on the command line."
        )
    return merged


def zero_init_config(cfg, algo, stage: int, dtype: torch.dtype) -> dict | None:
    """The DeepSpeed config models are built under (`deepspeed.zero.Init`: each rank allocates only
    its shard), or None where every rank holds full parameters anyway (stage 2)."""
    return deepspeed_config(cfg, algo, stage, dtype) if stage == 3 else None


def reference_config(config: dict) -> dict:
    """The frozen reference's engine config from the policy's, as TRL's `prepare_deepspeed`: no
    optimizer, so nothing about optimizer state or gradients; stage 3 stays stage 3 (parameters
    partitioned), a lower stage becomes 0 (a replica: it has nothing else to shard)."""
    ref = copy.deepcopy(config)
    ref.pop("data_types", None)
    zero = ref["zero_optimization"]
    zero.pop("offload_optimizer", None)
    if zero["stage"] != 3:
        zero["stage"] = 0
    return ref


@contextlib.contextmanager
def partitioned_loading(config: dict | None, cpu_shm_allreduce: bool):
    """While open, transformers' `from_pretrained` builds a model under `deepspeed.zero.Init(config)`
    and loads the checkpoint into it module by module (each module's full parameters gathered, filled
    on rank 0, re-partitioned), so no rank holds the whole model. The hook is a live
    `HfDeepSpeedConfig` (transformers keeps a weak reference to it); it is removed on exit so later
    loads in this process are plain ones. With config None nothing happens."""
    if config is None:
        yield
        return
    # transformers' DeepSpeed integration: loads deepspeed (as below)
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    init_deepspeed_comm(cpu_shm_allreduce)  # zero.Init partitions over DeepSpeed's process group
    hook = HfDeepSpeedConfig(config)  # noqa: F841 (kept alive: transformers holds a weakref)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def _merge(user: dict, ours: dict, prefix: str, conflicts: list[str]) -> dict:
    out = dict(user)
    for key, value in ours.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            sub = user.get(key, {})
            if not isinstance(sub, dict):
                conflicts.append(f"{name}: JSON has {sub!r}, the config needs a section")
                continue
            out[key] = _merge(sub, value, name + ".", conflicts)
        elif key not in user or user[key] == "auto" or user[key] == value:
            out[key] = value
        else:
            conflicts.append(f"{name}: JSON has {user[key]!r}, the config groups give {value!r}")
    return out


def init_deepspeed_comm(cpu_shm_allreduce: bool) -> None:
    """A process group for DeepSpeed: the trainer's own, or a one-rank gloo/NCCL group when a single
    process runs without a launcher. DeepSpeed's shared-memory all-reduce for CPU ranks is compiled
    on first use (about 45 s, cached); it is skipped unless asked for, with identical results."""
    import deepspeed  # deepspeed: heavy, only with parallel=zero2/3

    if not cpu_shm_allreduce:
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    info = dist.dist_info()  # from torchrun or SLURM; DeepSpeed reads these variables itself
    for key, value in dist.rank_env(info).items():
        os.environ.setdefault(key, value)
    if not tdist.is_initialized():  # one process: a group of one, on a store port bound, not picked (grpo/dist.py)
        dist.init_distributed(dist.DistInfo(), force=True)
    deepspeed.init_distributed(dist_backend=tdist.get_backend(), auto_mpi_discovery=False)


class ZeroStrategy(Strategy):
    @classmethod
    def check(cls, cfg, world: int) -> None:
        super().check(cfg, world)
        if cfg.deepspeed_config and not os.path.isfile(os.path.expanduser(cfg.deepspeed_config)):
            raise ConfigError(f"parallel.deepspeed_config={cfg.deepspeed_config!r} is not a file.")

    lockstep = True
    stage = 3
    reads = ("offload_optimizer", "deepspeed_config", "cpu_shm_allreduce")

    @classmethod
    def loading(cls, cfg, algo, dtype: torch.dtype):
        return partitioned_loading(zero_init_config(cfg, algo, cls.stage, dtype), cfg.cpu_shm_allreduce)

    def __init__(self, cfg, model: torch.nn.Module, algo, total_steps: int):
        import deepspeed  # deepspeed: heavy, only with parallel=zero2/3

        init_deepspeed_comm(cfg.cpu_shm_allreduce)
        dtype = next(model.parameters()).dtype
        config = deepspeed_config(cfg, algo, self.stage, dtype)
        optimizer, scheduler = build_optimizer(model, algo, total_steps)
        if self.stage == 3:  # every rank gathers each MoE block whole, whatever its routing (a dense model: none)
            zero3.mark_leaves(model)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.model = self.engine.module
        self.config = config
        self.world = tdist.get_world_size()
        self.sequence = sequence.build(cfg.sequence_parallel, self.model)

    def prepare_reference(self, ref: torch.nn.Module) -> torch.nn.Module:
        """An engine without optimizer, in the policy's dtype (the policy's forward runs its bf16 or
        fp32 parameters directly, and so does this). Under stage 3 its forwards gather parameters:
        every rank must score the reference in lockstep, as it does the policy."""
        import deepspeed  # deepspeed: heavy, only with parallel=zero2/3

        if self.stage == 3:
            zero3.mark_leaves(ref)
        engine, _, _, _ = deepspeed.initialize(model=ref, config=reference_config(self.config))
        engine.eval()  # DeepSpeed's eval() returns None, not the module
        return engine

    @property
    def forward_model(self) -> torch.nn.Module:
        return self.engine  # its forward advances ZeRO-3's micro-step count: accumulate, not overwrite

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def step(self) -> float:
        """DeepSpeed's step; an invalid global gradient norm (NaN, inf) is an overflow to its ZeRO
        optimizers in fp32 and bf16 alike: no update on any rank (the norm is all-reduced), gradients
        dropped, the schedule held. Such a step reports an inf norm (grpo/guards.py counts it)."""
        self.engine.step()
        if not self.engine.was_step_applied():
            return float("inf")
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def weight_buckets(self, bucket_bytes: int):
        """Full weights, bucket by bucket. Under ZeRO-3 each bucket is gathered from every rank's
        shards when it is requested and released before the next, so at most one bucket of full
        parameters exists at a time; buckets are sized by a parameter's full element count
        (`ds_numel`), not its empty local placeholder. Every rank must consume the same buckets
        (the gathers are collectives); a bucket's tensors are valid until the next is requested."""
        return self._buckets(engine_parameters(self.model.named_parameters(remove_duplicate=False)), bucket_bytes)

    def _buckets(self, named, bucket_bytes: int):
        """`named` (tied weights under both names) gathered bucket by bucket; with LoRA the adapter alone."""
        import deepspeed  # deepspeed: heavy, only with parallel=zero2/3

        if lora.is_lora(self.model):  # the adapter alone, in peft's saved names
            named = lora.adapter_parameters(self.model)
        for bucket in group_by_size(named, bucket_bytes):  # sized by full_nbytes (ds_numel)
            yield from self._gathered(bucket, deepspeed)

    def _gathered(self, bucket, deepspeed):
        params = list({id(p): p for _, p in bucket}.values())
        with deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3):
            yield [(name, p.data.detach()) for name, p in bucket]

    def export_buckets(self, bucket_bytes: int):
        """With LoRA, the merged weights, each module's parameters gathered (ZeRO-3) while merged."""
        if not lora.is_lora(self.model):  # every weight, a frozen vision tower's too
            return self._buckets(self.model.named_parameters(remove_duplicate=False), bucket_bytes)
        import deepspeed  # deepspeed: heavy, only with parallel=zero2/3

        def gathered(params):
            return deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3)

        return group_by_size(lora.merged_tensors(self.model, gathered, copy=True), bucket_bytes)

    def save(self, folder: str) -> None:
        # with LoRA the adapter and its optimizer state; the frozen base is the model folder's
        self.engine.save_checkpoint(folder, tag="deepspeed", save_latest=False,
                                    exclude_frozen_parameters=lora.is_lora(self.model))

    def load(self, folder: str) -> None:
        # with LoRA the module file holds the adapter alone: loaded as single's trainer.pt is, every adapter
        # weight required (DeepSpeed's non-strict load would leave a missing one as initialised)
        adapter = (lambda src, dst: lora.load_trainable_state(dst, src)) if lora.is_lora(self.model) else None
        path, _ = self.engine.load_checkpoint(folder, tag="deepspeed", load_optimizer_states=True,
                                              load_lr_scheduler_states=True, custom_load_fn=adapter)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}/deepspeed")

    @property
    def scheduler(self):
        return self.engine.lr_scheduler

    @property
    def lr(self) -> float:
        return self.engine.lr_scheduler.get_last_lr()[0]


class Zero2Strategy(ZeroStrategy):
    stage = 2


class Zero3Strategy(ZeroStrategy):
    stage = 3
