"""The algo group's typed schema (`algo.*`) and its cross-field rules: the batch shape across
processes, the loss, clip and importance-weight settings, the trust region and staleness (`check`),
a band replaced without a word (`check_behaviour_band`), a setting of a feature that is off
(`check_inert`), per-turn credit (`check_turn_rewards`). Part of the config (grpo/config.py registers
the schema with the other groups and calls these from `validate`); the math they protect is
grpo/algorithm.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

from grpo.algorithm import trust_region
from grpo.errors import ConfigError


@dataclass
class AlgoConfig:
    batch_size: int = 512  # B: completions generated per step (P x G)
    group_size: int = 16  # G: completions per prompt; P = batch_size / group_size prompts per step
    lr: float = 1e-6  # DeepSeekMath's and verl's policy rate for full fine-tuning; the tiny model sets 1e-3
    warmup_steps: int = 20  # optimizer steps of linear warm-up (grpo.parallel.base.build_optimizer)
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
    # kept inside each sequence by restarting position ids): grpo/update/layouts.py. false: padded rows
    packing: bool = True
    # packed rows that hold each prompt once for several of its completions, which attend to it
    # through a 4D mask (grpo/update/layouts.py `pack_shared`). A model that cannot (flash attention, a
    # sliding window) is packed without sharing, with a warning. No effect with packing=false.
    # true | false | auto: on for the CPU (measured there), off on CUDA until measured on a GPU
    # (grpo/update/layouts.py `shares_prompts`)
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
    # a MoE policy's router load-balancing loss, added to the loss with this weight (grpo/moe_model.py):
    # null = the model config's router_aux_loss_coef (Qwen3-MoE: 0.001), 0 = off (slime's RL setting)
    router_aux_loss_coef: Optional[float] = None


def check_turn_rewards(algo, env: str, reward_names: list[str]) -> None:
    """algo.turn_rewards / turn_discount (validate's part; `env`: env.name, `reward_names`: reward.funcs'
    names): per-turn credit needs an environment whose steps are weighted by reward `env`, and GRPO's
    own group normalisation (grpo/batch.py `step_advantages`)."""
    if not 0 < algo.turn_discount <= 1:
        raise ConfigError(f"algo.turn_discount={algo.turn_discount}: the discount gamma must be in (0, 1] (1: undiscounted).")
    if algo.turn_rewards == "none":
        if algo.turn_discount != 1:
            raise ConfigError(f"algo.turn_discount={algo.turn_discount} discounts turn rewards, but algo.turn_rewards=none "
                              "gives one reward per episode: set algo.turn_rewards=per_turn or process, or leave the discount at 1.")
        return
    what = f"algo.turn_rewards={algo.turn_rewards} credits each turn with its environment step's reward"
    if env == "none":
        raise ConfigError(f"{what}, but env=none has no turns: pick an environment (env=guess, env=calc, ...) or set "
                          "algo.turn_rewards=none.")
    if "env" not in reward_names:
        raise ConfigError(f"{what}, weighted by reward `env`, which reward.funcs lacks: add it (reward=env) or set "
                          "algo.turn_rewards=none.")
    if algo.adv_estimator != "grpo" or algo.adv_scale not in ("group", "none"):
        raise ConfigError(f"{what} and normalises within each group: it needs algo.adv_estimator=grpo with "
                          f"algo.adv_scale=group or none (got {algo.adv_estimator} / {algo.adv_scale}).")
    if algo.ratio_level != "token" or algo.dynamic_sampling:
        raise ConfigError(f"{what}, one advantage per token: it needs algo.ratio_level=token (GSPO's sequence ratio "
                          "takes one per sequence) and algo.dynamic_sampling=false (which picks groups by their final "
                          "reward).")


def check(algo, rollout, world: int) -> None:
    """The algo group's cross-field rules (validate's part; its choices are validate's own): the batch
    shape across `world` processes, the loss, clip and importance-weight settings, the trust region
    and staleness. `rollout`: its sampling, which the importance weights assume untruncated."""
    a = algo
    if a.group_size < 2:
        raise ConfigError(f"algo.group_size={a.group_size}: GRPO needs at least 2 completions per prompt to compare.")
    if a.batch_size < a.group_size or a.batch_size % a.group_size:
        what = "is below" if a.batch_size < a.group_size else "is not a multiple of"  # 0 is a multiple: "below" then
        raise ConfigError(
            f"algo.batch_size={a.batch_size} {what} algo.group_size={a.group_size}: every prompt "
            f"needs a full group. Use e.g. algo.batch_size={max(1, a.batch_size // a.group_size) * a.group_size}."
        )
    prompts = a.batch_size // a.group_size
    if prompts % world:
        raise ConfigError(
            f"algo.batch_size / algo.group_size = {prompts} prompts per step cannot be shared evenly by {world} "
            f"processes; make it a multiple of {world}."
        )
    mine = prompts // world  # each process cuts its own prompts into the minibatches (grpo/update/step.py)
    if a.num_minibatches < 1 or mine % a.num_minibatches:
        raise ConfigError(
            f"algo.num_minibatches={a.num_minibatches} must be >= 1 and divide each process's {mine} prompts per "
            f"step (batch_size / group_size / {world} processes), so no group is split across optimizer steps and "
            f"every step holds the same groups on every process; use a divisor of {mine}."
        )
    if a.dynamic_sampling and a.max_staleness > 0:
        raise ConfigError(f"algo.dynamic_sampling draws more prompts after scoring the step's batch, but with "
                          f"algo.max_staleness={a.max_staleness} the next batches are already drawn and generating: "
                          f"set algo.max_staleness=0, or algo.dynamic_sampling=false.")
    for key in ("num_iterations", "micro_batch_tokens", "max_draws"):
        if getattr(a, key) < 1:
            raise ConfigError(f"algo.{key}={getattr(a, key)} must be at least 1.")
    # CISPO's two bounds are independent (its lower one is usually off: clip_eps=1); PPO's clip-higher raises the upper
    if a.lr <= 0 or a.clip_eps <= 0 or (a.pg_loss == "ppo" and a.clip_eps_high is not None and a.clip_eps_high < a.clip_eps):
        raise ConfigError(f"algo.lr={a.lr}, algo.clip_eps={a.clip_eps}, algo.clip_eps_high={a.clip_eps_high} "
                          f"(algo.pg_loss={a.pg_loss}): algo.lr and algo.clip_eps must be > 0, and with pg_loss=ppo "
                          f"algo.clip_eps_high (if set) >= algo.clip_eps (a preset such as algo=cispo sets its own: "
                          f"give both bounds when you change pg_loss).")
    if a.zero_std_groups == "drop" and a.beta > 0:
        raise ConfigError(f"algo.zero_std_groups=drop skips the groups whose rewards are all equal, whose advantage "
                          f"is 0; with algo.beta={a.beta} their tokens still carry the KL term's gradient, so skipping "
                          f"them would change the update. Set algo.zero_std_groups=keep (or algo.beta=0).")
    if a.pg_loss == "cispo" and a.clip_eps_high is not None and a.clip_eps_high <= 0:
        raise ConfigError(f"algo.pg_loss=cispo caps the importance weight to [1 - clip_eps, 1 + clip_eps_high] = "
                          f"[{1 - a.clip_eps:g}, {1 + a.clip_eps_high:g}]: an on-policy token (weight 1) would be capped "
                          f"below 1, at 0 or under no policy gradient at all. algo.clip_eps_high must be > 0.")
    if not a.max_grad_norm > 0:  # single/ddp clip to it (0: no step at all, below 0: gradients flipped); DeepSpeed reads <= 0 as off
        raise ConfigError(f"algo.max_grad_norm={a.max_grad_norm} must be > 0 (the gradient norm is clipped to it); for "
                          f"practically no clipping give a large value, e.g. algo.max_grad_norm=1e9.")
    if a.adv_estimator != "grpo" and a.adv_scale != "none":
        raise ConfigError(
            f"algo.adv_estimator={a.adv_estimator} sets its own scale (rloo: none; reinforce_pp: the batch std of "
            f"the centred rewards), so algo.adv_scale={a.adv_scale} would be ignored: set algo.adv_scale=none, or use "
            f"the preset algo={a.adv_estimator}."
        )
    if a.pg_loss == "cispo" and a.ratio_level != "token":
        raise ConfigError("algo.pg_loss=cispo weights each token's gradient: it needs algo.ratio_level=token "
                          "(sequence is GSPO's, for pg_loss=ppo).")
    if a.beta < 0:
        raise ConfigError(f"algo.beta={a.beta} must be >= 0 (0 disables the KL term and the reference model).")
    if a.warmup_steps < 0:  # build_optimizer's decay runs over total - warmup steps: -1 gave a 1-step run half algo.lr
        raise ConfigError(f"algo.warmup_steps={a.warmup_steps} must be >= 0 (0: the full algo.lr from the first step).")
    if a.weight_decay < 0:  # AdamW would grow every weight instead of shrinking it
        raise ConfigError(f"algo.weight_decay={a.weight_decay} must be >= 0 (0: no decay).")
    if a.is_cap <= 1.0:
        raise ConfigError(f"algo.is_cap={a.is_cap} must be > 1: it caps the sampler/trainer probability ratio.")
    if a.is_level != "none" and (rollout.top_p < 1 or rollout.top_k > 0):
        raise ConfigError(
            "algo.is_level needs rollout.top_p=1 and rollout.top_k=0: with truncated sampling the sampler's "
            "logprobs come from a renormalised distribution the trainer does not compute."
        )
    # the behaviour trust region's ratio is pi_trainer / mu: with truncation mu is renormalised over the kept
    # tokens and the trainer's full softmax never equals it (top_k=2, a fresh batch: clip_frac 0.29, not 0)
    if (trust_region(a.trust_region, a.max_staleness, a.is_level) == "behaviour"
            and (rollout.top_p < 1 or rollout.top_k > 0)):
        raise ConfigError(
            f"rollout.top_k={rollout.top_k} / rollout.top_p={rollout.top_p} with the behaviour trust region "
            f"(algo.trust_region={a.trust_region}, algo.max_staleness={a.max_staleness}): its ratio divides by the "
            f"sampler's logprobs, which come from a truncated, renormalised distribution the trainer does not "
            f"compute, so even a fresh batch is clipped. Set rollout.top_k=0 and rollout.top_p=1.0, or "
            f"algo.max_staleness=0 with algo.trust_region=auto (or proximal), whose ratio is the trainer's own."
        )
    if a.max_staleness < 0:
        raise ConfigError(f"algo.max_staleness={a.max_staleness} must be >= 0 (0: synchronous; k: batches up to k versions old).")
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


def check_behaviour_band(algo, defaults) -> None:
    """Under the behaviour trust region a set `behaviour_clip_eps` replaces clip_eps and clip_eps_high
    (`decoupled_loss`): a band given there (GSPO's 3e-4 / 4e-4, DAPO's 0.2 / 0.28) would be read nowhere,
    and GSPO's sequence ratio clipped 250 times wider. Refused; `defaults`: the schema's (AlgoConfig())."""
    if trust_region(algo.trust_region, algo.max_staleness, algo.is_level) != "behaviour" or algo.behaviour_clip_eps is None:
        return
    given = [f"algo.{k}={getattr(algo, k)}" for k in ("clip_eps", "clip_eps_high") if getattr(algo, k) != getattr(defaults, k)]
    if given:
        raise ConfigError(
            f"{', '.join(given)} with the behaviour trust region (algo.trust_region={algo.trust_region}, "
            f"algo.max_staleness={algo.max_staleness}): its band around the sampler is algo.behaviour_clip_eps="
            f"{algo.behaviour_clip_eps}, which replaces {' and '.join(k.split('=')[0] for k in given)}. Set "
            f"algo.behaviour_clip_eps=null to clip by your band around the sampler, or drop the clip_eps setting(s).")


def inert_settings(algo, defaults) -> list[str]:
    """The algo.* settings given (other than `defaults`', the schema's) to a feature that is off, each
    with what would turn it on: they would change nothing, without a word (algo.is_cap=4 with
    is_level=none). A preset's None for behaviour_clip_eps (algo=cispo) is not counted."""
    region = trust_region(algo.trust_region, algo.max_staleness, algo.is_level)
    off = {
        "max_draws": (not algo.dynamic_sampling, "algo.dynamic_sampling=true"),
        "is_mode": (algo.is_level == "none", "algo.is_level=token (or sequence)"),
        "is_cap": (algo.is_level == "none", "algo.is_level=token (or sequence)"),
        "behaviour_clip_eps": (region != "behaviour" and algo.behaviour_clip_eps is not None,
                               "algo.max_staleness >= 1 with algo.is_level=none (trust_region=auto), or "
                               "algo.trust_region=behaviour"),
        "shared_prompt": (not algo.packing and algo.shared_prompt is True, "algo.packing=true"),
    }
    return [f"algo.{key}={getattr(algo, key)!r} (read only with {needs})"
            for key, (is_off, needs) in off.items() if is_off and getattr(algo, key) != getattr(defaults, key)]


def check_inert(algo, defaults, steps: int) -> None:
    """validate's part: `inert_settings` refused; a warm-up as long as the run warned of (algo.lr is never
    reached: warm-up and decay count optimizer steps, steps x num_iterations x num_minibatches, and the
    last one's lr is total / (warmup_steps + 1) of it: grpo.parallel.base.build_optimizer)."""
    check_behaviour_band(algo, defaults)
    inert = inert_settings(algo, defaults)
    if inert:
        raise ConfigError(f"{'; '.join(inert)}: the feature is off, so the setting has no effect. Turn the feature on, "
                          f"or remove the setting.")
    total = steps * algo.num_iterations * algo.num_minibatches
    if 0 < total <= algo.warmup_steps:
        warnings.warn(f"algo.warmup_steps={algo.warmup_steps} is as long as the run's {total} optimizer steps (steps x "
                      f"num_iterations x num_minibatches): the learning rate only reaches {total / (algo.warmup_steps + 1):.2g}"
                      f" x algo.lr={algo.lr:g}. Set algo.warmup_steps below {total} (0: no warm-up).", stacklevel=2)
