"""Typed schemas for every config group, registered in Hydra's ConfigStore, and `validate(cfg)`.

YAML files under conf/ only set values: each starts with `defaults: [/base_<group>]`, so a key that
is not declared here is an error at compose time (one added with Hydra's `+`, in `validate`). The
defaults here suit a real model (lr 1e-6, 512 new tokens); the tiny model's own values are in
conf/model/tiny.yaml. `validate` checks the rules that span fields
before any model is built, and its messages say what to change: each group's choices here, each
part's rules in that part's own `check` (the algo group's in grpo/algo_config.py, a backend, a
strategy, LoRA, the rewards, the environment, the model folder), beside the code they protect.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from grpo import algo_config, envs, log, lora, models, moe_model, vision
from grpo.algo_config import AlgoConfig  # the algo group's schema and rules (batch shape, loss, trust region)
from grpo.dist import dist_info
from grpo.errors import ConfigError, did_you_mean
from grpo.moe import routing
from grpo.packaged import PACKAGED, packaged_model_dir
from grpo.parallel import STRATEGIES, strategy_class
from grpo.parallel.sequence import check_heads, check_size
from grpo.reward_config import RewardConfig  # the reward group's schema (reward functions, `rm`, `judge`)
from grpo.rewards import check_rewards, reward_names
from grpo.rollout import BACKENDS, backend_class
from grpo.rollout.engine_memory import model_config_of, read_model_config
from grpo.rollout.render import RENDERERS
from grpo.rollout_config import RolloutConfig  # the rollout group's (sampling, vLLM, servers, scheduling)
from grpo.tasks import TASKS, check_task
from grpo.tiny import folders
from grpo.tiny.text import TINY_CONTEXT
from grpo.tiny.warm_start import TINY_KINDS
from grpo.update.layouts import SHARED_PROMPT_SETTINGS


@dataclass
class TinyMoeConfig:
    """The tiny MoE's own sizes (`model.path=tiny_moe`, grpo/tiny/moe.py); its width is TinyModelConfig's."""

    experts: int = 8
    top_k: int = 2  # experts per token
    moe_intermediate_size: int = 256  # each expert's; top-2 x 256 is the dense model's 512 active
    layers: int = 4  # 4, not 2: a routing flip has layers to reach the completion's logprobs through


@dataclass
class TinyModelConfig:
    """The embedded model: a small Qwen2 built in code, warm-started on the synthetic task."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32  # vLLM's CPU attention needs 32 or more
    intermediate_size: int = 512
    seed: int = 0
    # Supervised warm start, part of building the model: stop once greedy accuracy on training
    # prompts reaches `warm_start_accuracy` (0 disables it); an error if `warm_start_max_steps` pass
    # first. AdamW with a linear warmup and the gradient norm clipped: without them (lr 3e-3 from
    # step 0, batch 64) the outcome hung on float rounding, 225 steps on one CPU and no target in
    # 3000 on another. With them, 8 seeds x 2 CPU settings reach it in 150-400 steps (docs/results/warm_start.md).
    warm_start_accuracy: float = 0.15
    warm_start_max_steps: int = 3000
    warm_start_lr: float = 3e-3
    warm_start_warmup_steps: int = 50
    warm_start_clip: float = 1.0  # max gradient norm; 0 = no clipping
    warm_start_batch: int = 128
    warm_start_check_every: int = 25  # supervised steps between greedy checks of the target
    moe: TinyMoeConfig = field(default_factory=TinyMoeConfig)  # model.path=tiny_moe only


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (grpo/lora.py, through peft): rank 0 trains every weight."""

    rank: int = 0  # r; 0 = off (full fine-tuning)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # > 0 makes the trainer's logprobs differ from the sampler's (dropout in training mode)
    # the linear layers that get an adapter (names inside each decoder layer); vLLM's LoRA supports these
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class ModelConfig:
    # "tiny" builds the embedded model; a key of grpo.packaged.PACKAGED (smollm2-135m) converts a model
    # shipped in a PyPI package once into the cache; anything else is a hub id or a local HF folder.
    path: str = "tiny"
    dtype: str = "float32"  # float32 | bfloat16 (float16: refused, no loss scaling)
    # recompute each layer's activations in the backward pass instead of keeping them: for
    # SmolLM2-135M, one 8192-token micro-batch's peak falls from 15.4 GB to about a fifth (grpo.bench update-memory)
    gradient_checkpointing: bool = False
    cache_dir: str = "${oc.env:GRPO_CACHE,'~/.cache/grpo'}"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # vision-language models (grpo/vision.py): the vision tower takes no gradient and is not sent to
    # the engines; only the language model trains
    freeze_vision: bool = True


@dataclass
class TaskConfig:
    name: str = MISSING  # a key of grpo.tasks.TASKS
    eval_size: int = 256  # held-out prompts used for evaluation
    seed: int = 1234  # fixes the train/eval split, independent of the run seed
    digits: int = 2  # addition, arithmetic: operand width
    size: Optional[int] = None  # shapes: how many images are drawn (null: the task's own, 2,048)
    # Data sets (gsm8k, math, countdown): a local .jsonl/.parquet file with the hub set's columns
    # (jsonl task: {"prompt", "answer"} rows), else the hub id through `datasets.load_dataset`.
    path: Optional[str] = None
    eval_path: Optional[str] = None  # the held-out file; null: hold out eval_size rows of `path`
    hub_id: Optional[str] = None
    hub_config: Optional[str] = None
    train_split: str = "train"
    eval_split: Optional[str] = "test"  # null: hold out eval_size rows of the train split
    # How a prompt is put to the model: the tokenizer's chat template (auto: if it has one |
    # always | never), an optional system prompt, and the instruction after each question that says
    # how to give the answer (null: the task's own, e.g. gsm8k's 'output the final answer after "####"').
    chat_template: str = "auto"
    system_prompt: Optional[str] = None
    answer_format: Optional[str] = None
    # jsonl: what eval counts as correct: exact (the completion, stripped, equals the answer) or
    # math_verify (equal by value, as reward=math_verify scores it)
    correct: str = "exact"


@dataclass
class ParallelConfig:
    strategy: str = MISSING  # a key of grpo.parallel.STRATEGIES
    sync_bucket_mb: float = 64.0  # size of one weight-sync bucket (full parameters, also under ZeRO-3)
    offload_optimizer: bool = False  # zero2/zero3: optimizer state in CPU memory
    deepspeed_config: Optional[str] = None  # zero2/zero3: a DeepSpeed JSON merged in; conflicts are errors
    cpu_shm_allreduce: bool = False  # zero2/zero3 on CPU: DeepSpeed's shared-memory all-reduce (JIT-built once)
    peer_timeout_s: float = 60.0  # a rank whose heartbeat stops this long is named and the others stop (grpo/dist.py)
    # every collective's timeout (gloo and NCCL): the longest one rank may work while the others wait in
    # a collective (a dedicated engine's start or generation, rank 0's export); a dead peer is found by
    # the heartbeat (peer_timeout_s), not by this
    collective_timeout_s: float = 1800.0
    allreduce_bucket_mb: float = 25.0  # ddp: gradients all-reduced in buckets of this size (torch DDP's default)
    # with several ranks: at step 1 and every this many steps the ranks compare a fingerprint of their
    # weights and a mismatch stops the run (grpo/guards.py; one pass over the weights); 0 = never
    check_ranks_every: int = 50
    # Ulysses: groups of this many consecutive ranks share each row of the update (its columns split
    # among them, DeepSpeed's all-to-all in the attention); rollouts unchanged; grpo/parallel/sequence.py
    sequence_parallel: int = 1


@dataclass
class EnvConfig:
    """Multi-turn episodes (grpo/envs/, grpo/rollout/episodes.py); `none` keeps single completions."""

    name: str = "none"  # none | a key of grpo.envs.ENVS | a dotted path to a class or factory
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the environment's constructor
    max_turns: int = 4  # policy turns per episode (each up to rollout.max_new_tokens)
    # the span after the prompt (sampled + observation tokens); 0: max_turns x (max_new_tokens +
    # max_observation_tokens). A trajectory with no room for a whole next turn ends as "length".
    max_total_tokens: int = 0
    max_observation_tokens: int = 64  # one observation, cut in the middle beyond this
    step_timeout_s: float = 10.0  # an env.reset/step that raises or runs longer ends its episode as "error"
    # environments called at once (reset, step, close; one per trajectory, each its own env): 1 = one after another
    max_concurrency: int = 32
    render: str = "raw"  # raw (the text tokenized alone) | chat (a message of the chat template); grpo/rollout/render.py
    role: str = "user"  # chat: the observations' role (user | tool, as the template knows it)


@dataclass
class LoggerConfig:
    backend: str = "console"  # console | wandb | module.Class of one's own (console and metrics.jsonl are always written)
    log_every: int = 10  # console line every N steps
    sample_every: int = 100  # print a few completions every N steps (0 = never)
    num_samples: int = 3
    project: str = "grpo"
    entity: Optional[str] = None
    mode: str = "${oc.env:WANDB_MODE,online}"
    kwargs: dict[str, Any] = field(default_factory=dict)  # a backend of one's own: its keyword arguments


@dataclass
class Config:
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    reward: RewardConfig = MISSING
    rollout: RolloutConfig = MISSING
    parallel: ParallelConfig = MISSING
    algo: AlgoConfig = MISSING
    logger: LoggerConfig = MISSING
    env: EnvConfig = MISSING
    seed: int = 0
    steps: int = 300  # GRPO steps (one generated batch each)
    eval_every: int = 0  # 0 = only before and after training
    eval_samples: int = 1  # > 1: also sample this many per held-out prompt and report pass@1,2,4..
    checkpoint_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the run folder's latest checkpoint if there is one
    export_model: bool = True  # at the end, a consolidated HF folder of the policy in RUN_DIR/model
    run_dir: str = "${hydra:runtime.output_dir}"
    # torch threads per process: auto (this process's share of the CPUs it may use, no more than
    # are idle at start; grpo/cpus.py) or a number
    threads: Any = "auto"


GROUPS = {
    "model": ModelConfig,
    "task": TaskConfig,
    "reward": RewardConfig,
    "rollout": RolloutConfig,
    "parallel": ParallelConfig,
    "algo": AlgoConfig,
    "logger": LoggerConfig,
    "env": EnvConfig,
}


def register_configs() -> None:
    """Each schema is stored at the top of the ConfigStore, not in its group: a schema in `algo/` would
    be an option (`algo=base_algo`, listed by --help) that composes with no preset's values."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in GROUPS.items():
        cs.store(name=f"base_{group}", node=schema)


CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def compose_config(overrides: list[str], hydra_config: bool = False) -> DictConfig:
    """The run config that `python -m grpo.train <overrides>` would get, composed outside a Hydra app
    (grpo.launch, grpo.serve, the bench, the tests)."""
    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_config)


def task_preset(name: str) -> dict:
    """The values conf/task/<name>.yaml sets (none for a task without one): what a run changed is told
    from what the task's own file chose."""
    path = Path(CONF_DIR) / "task" / f"{name}.yaml"
    preset = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
    return {k: v for k, v in preset.items() if k != "defaults"}


def _choices(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {sorted(allowed)}; pick one of those.")


PER_JOB = re.compile(r"\$\{hydra:(job\.num|job\.id|job\.override_dirname|runtime\.output_dir)\}|\$\{(?!hydra:)[^}]+\}")


def check_sweep_folder(cfg, multirun: bool) -> None:
    """A Hydra multirun's jobs each need their own folder. A `run_dir` fixed for the sweep sent every job
    to one: the first trained, and each later one resumed it, said "already finished" and returned the
    first job's summary (exit 0), its config.yaml now the last job's; run at once (hydra/launcher=slurm)
    they would write one folder's checkpoints together. Per job: the default (the job's own output
    folder), a value that names the job through Hydra (`${hydra:job.num}`, `${hydra:job.override_dirname}`)
    or one that interpolates a setting (`/runs/lr${algo.lr}`, the swept value). `${hydra:runtime.cwd}`,
    `${hydra:sweep.dir}` or a plain path are one folder for all. grpo.train checks it in each job, and the
    SLURM launcher's callback before submitting (grpo/slurm.py `SlurmCheck`)."""
    raw = str(OmegaConf.to_container(cfg, resolve=False).get("run_dir"))
    if multirun and not PER_JOB.search(raw):
        raise ConfigError(f"run_dir={raw} is one folder for every job of this sweep (-m): the first job would "
                          f"train and the others resume it. Drop run_dir and set hydra.sweep.dir={raw} (each job "
                          f"gets <dir>/<job number>), or name the job in it: run_dir={raw}/${{hydra:job.num}}.")


def check_declared(node, path: str = "") -> None:
    """Refuse a key its schema does not declare. Hydra refuses `algo.learning_rate=1e-3` at compose time,
    but its own advice, `+algo.learning_rate=1e-3`, adds the key to the typed node, where no code reads it:
    the run went ahead at the default lr. Walks every node typed by a dataclass (OmegaConf.get_type), the
    items of a list of them (reward.funcs) included; a node typed as a dict (env.kwargs,
    reward.judge.choices) takes any key. `hydra` (compose_config(hydra_config=True)) is Hydra's own."""
    if isinstance(node, ListConfig):
        for i in range(len(node)):
            if not (OmegaConf.is_missing(node, i) or OmegaConf.is_interpolation(node, i)):
                check_declared(node[i], f"{path}[{i}]")
        return
    if not isinstance(node, DictConfig):  # a value, or a typed node set to null
        return
    schema = OmegaConf.get_type(node)
    declared = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    prefix = f"{path}." if path else ""
    for key in node.keys():
        if key == "hydra" and not path:
            continue
        if declared is not None and key not in declared:
            raise ConfigError(f"{prefix}{key} is not a setting of {path or 'the config'}{did_you_mean(key, declared, prefix)}; "
                              f"remove it (the + adds keys no code reads).")
        if not (OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key)):
            check_declared(node[key], f"{prefix}{key}")


USER_KWARGS = ("env.kwargs", "logger.kwargs")  # passed as they are to user code, whose meaning of inf is its own


def check_finite(node, path: str = "") -> None:
    """Refuse a NaN or infinite number anywhere in the config. The range checks compare (`lr <= 0`,
    `beta < 0`, `timeout_s <= 0`), and every comparison with NaN is false: algo.lr=nan passed validate and
    ended in torch's `ValueError: Invalid learning rate: nan` traceback once the model was built,
    algo.beta=nan loaded the reference model and then skipped the KL term (`beta > 0` is false),
    parallel.peer_timeout_s=nan never named a dead peer. The kwargs handed to user code are theirs."""
    if isinstance(node, ListConfig):
        items = [(i, f"{path}[{i}]") for i in range(len(node))]
    elif isinstance(node, DictConfig):
        items = [(key, f"{path}.{key}" if path else str(key)) for key in node.keys()
                 if not (key == "hydra" and not path)]
    else:
        return
    for key, where in items:
        if where in USER_KWARGS or OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}={value} is not a finite number: set {where} to a real value "
                              f"(every range check compares, and nothing compares true with nan).")
        check_finite(value, where)


def validate(cfg: DictConfig | Config, world_size: int | None = None, cuda: bool | None = None) -> None:
    """Cross-field rules, checked before any heavy work: each group's choices, then each part's `check`.
    Raises ConfigError saying what to change. `world_size`: the processes the run will have (grpo.launch
    checks a job before submitting it); by default the ones this process was launched with. `cuda`:
    whether the run will have GPUs (grpo.launch: it asked for some); by default whether this process sees one."""
    check_declared(cfg)  # a key added with `+` that no schema declares
    check_finite(cfg)  # a nan or inf, which every `value < low` check lets through
    a, r = cfg.algo, cfg.rollout
    _choices("task.name", cfg.task.name, TASKS)
    _choices("rollout.backend", r.backend, BACKENDS)
    _choices("rollout.schedule", r.schedule, {"auto", "turns", "trajectories"})
    _choices("parallel.strategy", cfg.parallel.strategy, STRATEGIES)
    _choices("algo.loss_type", a.loss_type, {"grpo", "bnpo", "dr_grpo", "dapo"})
    _choices("algo.adv_scale", a.adv_scale, {"group", "batch", "none"})
    _choices("algo.adv_estimator", a.adv_estimator, {"grpo", "rloo", "reinforce_pp"})
    _choices("algo.turn_rewards", a.turn_rewards, {"none", "per_turn", "process"})
    _choices("algo.ratio_level", a.ratio_level, {"token", "sequence"})
    _choices("algo.pg_loss", a.pg_loss, {"ppo", "cispo"})
    _choices("algo.lr_schedule", a.lr_schedule, {"linear", "constant"})
    _choices("algo.zero_std_groups", a.zero_std_groups, {"keep", "drop"})
    _choices("algo.is_level", a.is_level, {"none", "token", "sequence"})
    _choices("algo.is_mode", a.is_mode, {"truncate", "mask", "reject"})
    _choices("algo.trust_region", a.trust_region, {"auto", "proximal", "behaviour"})
    _choices("task.chat_template", cfg.task.chat_template, {"auto", "always", "never"})
    _choices("task.correct", cfg.task.correct, {"exact", "math_verify"})
    if cfg.model.dtype == "float16":  # no loss scaling anywhere (REVIEW L5)
        raise ConfigError("model.dtype=float16 is not supported: nothing scales the loss, so small gradients underflow "
                          "to 0; use model.dtype=bfloat16 (GPUs from Ampere on) or float32.")
    _choices("model.dtype", cfg.model.dtype, {"float32", "bfloat16"})
    _choices("env.render", cfg.env.render, RENDERERS)
    if cfg.env.render == "chat":  # a role the template renders whatever its name: a typo, or the policy's own turn
        _choices("env.role", cfg.env.role, {"user", "tool"})

    if not 0 <= cfg.seed < 2**31:
        raise ConfigError(f"seed={cfg.seed}: give a seed from 0 to 2147483647 (2**31 - 1); the engines' sampling "
                          "seeds are built from it and must stay below 2**63.")
    sampling = {"rollout.max_new_tokens": (r.max_new_tokens, r.max_new_tokens >= 1, "must be >= 1"),
                "rollout.temperature": (r.temperature, r.temperature > 0, "must be > 0 (greedy rollouts make every group "
                                        "flat; evaluation is greedy anyway)"),
                "rollout.top_p": (r.top_p, 0 < r.top_p <= 1, "must be in (0, 1]"),
                "rollout.top_k": (r.top_k, r.top_k >= 0, "must be >= 0 (0: off)")}
    for key, (value, ok, rule) in sampling.items():
        if not ok:
            raise ConfigError(f"{key}={value} {rule}.")
    world = world_size or dist_info().world_size
    algo_config.check(a, r, world)  # batch shape, loss, clip, importance weights, trust region, staleness
    algo_config.check_inert(a, AlgoConfig(), cfg.steps)  # a setting of a feature that is off; a warm-up past the run
    moe_model.check(a)  # algo.router_aux_loss_coef
    if a.shared_prompt not in SHARED_PROMPT_SETTINGS or not isinstance(a.shared_prompt, (bool, str)):
        raise ConfigError(f"algo.shared_prompt={a.shared_prompt!r}: use true, false or auto (on for the CPU, off on "
                          f"CUDA until measured on a GPU).")
    algo_config.check_turn_rewards(a, cfg.env.name, reward_names(cfg))  # per-turn credit (reward_names: each named once)
    backend, strategy = backend_class(r.backend), strategy_class(cfg.parallel.strategy)
    backend.check(r, world)  # each backend its own settings (grpo/rollout/)
    backend.check_unread(r)  # a rollout.vllm.*, remote.* or dedicated.* setting the backend never reads
    backend.check_hardware(r, cuda if cuda is not None else torch.cuda.is_available())  # CPU engines' settings on GPUs
    backend.check_staleness(r, a.max_staleness)  # engines elsewhere overlap; in-process ones warn
    backend.check_schedule(r, a, cfg.env.name)  # rollout.schedule, algo.partial_rollouts
    backend.check_routing(r, cfg.env.name)  # rollout.routing_replay: a backend that returns routes, single-turn
    routing.check(cfg)  # rollout.routing_replay against sequence parallelism and VLMs
    strategy.check(cfg.parallel, world)  # each strategy its own (grpo/parallel/)
    check_sequence_parallel(cfg, world)
    lora.check(cfg, backend, strategy, world, cuda)  # model.lora, and whether backend and strategy take it
    if cfg.parallel.peer_timeout_s <= 0:
        raise ConfigError(f"parallel.peer_timeout_s={cfg.parallel.peer_timeout_s} must be > 0 seconds.")
    check_collective_timeout(cfg.parallel.collective_timeout_s, cfg.rollout, world)
    if cfg.threads != "auto" and not (str(cfg.threads).isdigit() and int(cfg.threads) >= 1):
        raise ConfigError(f"threads={cfg.threads!r}: use auto or a positive number of threads per process.")
    counts = {"steps": (cfg.steps, 0), "task.eval_size": (cfg.task.eval_size, 1), "eval_samples": (cfg.eval_samples, 1),
              "logger.log_every": (cfg.logger.log_every, 1), "keep_checkpoints": (cfg.keep_checkpoints, 1),
              "eval_every": (cfg.eval_every, 0), "checkpoint_every": (cfg.checkpoint_every, 0),
              "logger.sample_every": (cfg.logger.sample_every, 0), "logger.num_samples": (cfg.logger.num_samples, 1)}
    for key, (value, low) in counts.items():
        if value < low:
            never = " (0: never, or only at the start and end)" if key.endswith("_every") and low == 0 else ""
            raise ConfigError(f"{key}={value} must be >= {low}{never}.")
    check_task(cfg.task, task_preset(cfg.task.name))  # the data fields the chosen task reads
    check_rewards(cfg)  # each name resolves; a reward that holds a model checks its settings (grpo/rewards/)
    if cfg.task.name == "jsonl" and cfg.task.correct == "exact" and "math_verify" in reward_names(cfg):
        warnings.warn("task=jsonl counts eval/accuracy by exact match (task.correct=exact) while reward math_verify "
                      "trains on answers equal by value: '0.5' for '1/2' scores 1 and counts as wrong. Set "
                      "task.correct=math_verify to evaluate what is trained.", stacklevel=2)
    envs.check(cfg)  # env.*: the environment can be found, its budgets leave room for a turn
    log.check(cfg.logger, LoggerConfig())  # logger.project/entity without wandb
    folders.check_tiny_settings(cfg.model, TinyModelConfig())  # model.tiny.* for a model not built in code
    folders.check_path(cfg.model.path)  # tiny, packaged, a local folder, or a hub id whose config loads
    model_config = known_model_config(cfg.model)
    folders.check_task_model(cfg, model_config)  # an image task, a system prompt, a chat template against the model
    # the engines' context against the model's own: fitted with a warning, or refused (engine_memory.engine_context)
    backend.check_context(r, model_config)
    backend.check_memory(r, model_config, cuda if cuda is not None else torch.cuda.is_available())  # memory_fraction where read
    vision.check_config(cfg, model_config)  # a vision-language model's refusals
    models.check_freeze_vision(cfg, model_config)  # model.freeze_vision=false where no tower would train


def check_sequence_parallel(cfg, world: int) -> None:
    """parallel.sequence_parallel against the strategy, the processes and (the tiny model: known before
    loading) the heads; a loaded model's attention and heads are checked when the strategy is built."""
    size = cfg.parallel.sequence_parallel
    check_size(size, cfg.parallel.strategy, world)
    if size > 1 and cfg.model.path == "tiny":
        check_heads(size, cfg.model.tiny.num_heads, cfg.model.tiny.num_heads)


def known_model_config(model) -> dict:
    """What validate can know of the model's config.json without building anything: the tiny model's
    context (set in code), a packaged model's or a local folder's config.json once it is on disk, a
    hub id's config as transformers cached it; {} where none is known yet."""
    if model.path in TINY_KINDS:
        return {"max_position_embeddings": TINY_CONTEXT}
    if model.path in PACKAGED:
        return read_model_config(packaged_model_dir(model.path, model.cache_dir))
    return model_config_of(model.path)


def check_collective_timeout(timeout_s: float, rollout, world: int) -> None:
    """parallel.collective_timeout_s must outlast what the other ranks wait for in a collective: with
    rollout=dedicated, the local main's engine start (start_timeout_s) and one generation request."""
    if timeout_s <= 0:
        raise ConfigError(f"parallel.collective_timeout_s={timeout_s:g} must be > 0 seconds.")
    if rollout.backend == "dedicated" and world > 1:
        longest = max(rollout.dedicated.start_timeout_s, rollout.dedicated.request_timeout_s)
        if timeout_s <= longest:
            raise ConfigError(
                f"parallel.collective_timeout_s={timeout_s:g} s: with rollout=dedicated the other ranks of a node wait "
                f"in a collective while its local main starts the engines (rollout.dedicated.start_timeout_s="
                f"{rollout.dedicated.start_timeout_s:g}) and generates (request_timeout_s={rollout.dedicated.request_timeout_s:g}); "
                f"set parallel.collective_timeout_s above {longest:g}.")
