"""`python -m grpo.verify [OVERRIDES]`: does my run compute what it claims?

`grpo.doctor` answers "is this machine ready"; this answers "does my run (model, task, backend,
strategy, processes: the same overrides as `grpo.train`) compute what the code promises". It sets the
run up as `grpo.train` does, in a scratch folder, draws real batches through the run's own engines,
and checks every equivalence the loss relies on, one PASS / FAIL / SKIP line each, with the numbers:

  sampler          the sampler's logprobs of its own tokens equal the trainer's (after the first sync)
  ratio            importance ratios are 1 at the first step: the loss's forward (training mode) scores
                   what the old-logprob pass (eval mode) does (dropout, LoRA dropout break it)
  reference        KL is 0 at the first step: a reference model scores as the policy does
  layouts          padded, packed and shared rows give the same logprobs and gradients, and which
                   layout the model really runs (a fallback is named); on rank 0, one fresh copy of
                   the model at a time, the gradients kept on the CPU
  micro-batches    one micro-batch and several give the same gradients
  routing          with rollout.routing_replay (a MoE policy): the update's forward routes every token to
                   the experts it is given; and how often the trainer's own routing differs from the sampler's
  ranks            ranks hold equal weights after an optimizer step (fingerprinted; ZeRO: SKIP, one by construction)
  split            with parallel.sequence_parallel > 1: rows split across a group of ranks give the
                   logprobs the same rows give unsplit (grpo/parallel/sequence.py)
  sync             after that step and a weight push, the sampler matches the trainer again; and the
                   step is one a missed push would show (else SKIP: the row could not tell)
  resume           a run stopped after step 2 and resumed gives steps 3 and 4's metrics (algo.max_staleness > 0:
                   prompts) of an unbroken run (runs in scratch folders of their own, whatever run_dir= says)
  render           with an environment and chat rendering: observations render as the template does

    python -m grpo.verify                                      # the default run
    python -m grpo.verify experiment=smollm2_arithmetic_cpu
    torchrun --nproc_per_node 2 -m grpo.verify parallel=zero3

Tolerances follow the dtype: fp32 compares to 1e-4 (logprobs) and 1e-4 of the gradient's size;
bf16/fp16 to what their rounding gives (docs/algorithm.md: one bf16 step of a logit is 0.0625 in
[8, 16)); the sampler and sync rows, which compare an engine, to grpo.guards.parity, as grpo.doctor
does: in fp32 the largest difference over the sampled tokens (1e-3 on CPU, 2e-2 on CUDA:
grpo/rollout/precision.py), in bf16 the mean (0.1), as single tokens round 0.1-0.4 apart right after
a healthy sync. The run's one optimizer step takes algo.lr without warmup, so that a missed push is
visible in bf16 too. Every row compares every sampled completion token, whichever the loss keeps
(`first_batch`), and one that compared none is a SKIP. Exit status 1 if any check fails: paste the
table into a bug report.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace

import torch
from omegaconf import OmegaConf

from grpo import dist, lora
from grpo.batch import batch_advantages, collate
from grpo.cli import exit_on_user_error
from grpo.config import compose_config, validate
from grpo.cpus import configure_threads
from grpo.guards import Parity, parity, ranks_can_differ, ranks_fingerprints, weight_fingerprint
from grpo.library_logs import quiet_library_logs
from grpo.log import read_metrics
from grpo.models import build_reference, load_model
from grpo.moe import routing
from grpo.parallel.single import SingleStrategy
from grpo.train import run_process_group, setup
from grpo.update import accumulate_gradients, layouts, loss_norm, policy_update, score_tokens
from grpo.update.step import forwarding
from grpo.update.layouts import layout_of

# (logprob, relative gradient) tolerances by the model's dtype
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (0.1, 5e-2), "float16": (0.02, 1e-2)}
REFERENCE_TOL = 1e-6  # the reference is the policy before any step: the same weights and forward, KL 0
RESUME_TOL = 1e-5  # of max(1, |value|): a resumed run's steps 3 and 4 against an unbroken run's
SCRATCH = ["eval_every=0", "checkpoint_every=0", "export_model=false", "logger.sample_every=0", "logger.log_every=1"]
# the in-process run's one optimizer step at algo.lr: at the default warmup's 1/21 of it, a bf16 engine
# that missed the push scored 0.006-0.018 (mean) from the trainer, as one that got it did (the tiny model)
ONE_STEP = ["steps=2", "algo.warmup_steps=0"]


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str

    def line(self) -> str:
        return f"{self.status:4}  {self.name:14} {self.detail}"


def check(name: str, ok: bool, detail: str) -> Check:
    return Check(name, "PASS" if ok else "FAIL", detail)


def max_diff(a_BT: torch.Tensor, b_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[float, int]:
    """The largest |a - b| over the tokens `mask_BT` marks, and how many it marks. On this process
    alone (the layout checks run on rank 0). A 0.0 over 0 tokens measured nothing: the row says so
    (`bounded`) instead of passing on it."""
    d = (a_BT - b_BT)[mask_BT.bool()].abs()
    return (float(d.max()) if d.numel() else 0.0), int(d.numel())


def first_batch(r, step: int = 1):
    """Step `step`'s batch as the loop draws it (every group kept), with every sampled completion token
    in its mask (multi-turn: not the environment's observations, `collate` reads them from the
    episodes' loss masks), and ±1 advantages standing in for the gradient checks where no group
    carries a signal. The run's loss mask would drop every token of a completion cut at
    max_new_tokens (algo.mask_truncated, DAPO's default) or whose reward failed; with all of them
    dropped, the rows compared 0 tokens and passed, and the layouts' gradients were all zero. What
    verify checks (the logprobs, the gradients' layouts, the step's push) holds token by token
    whatever the loss keeps, so it is checked on every token the sampler drew; the step verify takes
    trains them too (a step that trained nothing would let a missed push pass)."""
    scored = r.score(r.submit(step))
    G = r.G
    advantages_PG = batch_advantages(scored.rewards_PG, r.cfg.algo.adv_scale, r.cfg.algo.adv_estimator)
    batch = collate([p for p in scored.prompt_ids for _ in range(G)], scored.rollouts, advantages_PG.flatten(),
                    r.tokenizer.pad_token_id, mask_truncated=False)
    batch.replay_routes = r.cfg.rollout.routing_replay  # as the loop sets it (rollout.routing_observe: compared only)
    if not batch.advantages_B.abs().sum():
        batch.advantages_B = torch.tensor([1.0 if i % 2 else -1.0 for i in range(batch.size)])
    return batch


@dataclass
class Gap:
    """|trainer - sampler| logprob over one batch's sampled tokens, across ranks."""

    largest: float
    mean: float
    tokens: int

    def of(self, par: Parity) -> float:
        return self.largest if par.statistic == "max" else self.mean

    def judged(self, name: str, par: Parity, dtype: str) -> Check:
        """The sampler row: by the parity's statistic, a SKIP when no token was compared."""
        if not self.tokens:
            return nothing_compared(name, "|trainer - sampler| logprob")
        return check(name, par.holds(self.of(par)), self.line(par, dtype))

    def line(self, par: Parity, dtype: str) -> str:
        if par.statistic == "max":
            return f"max |trainer - sampler| logprob {self.largest:.2e} over {self.tokens} sampled tokens (tol {par.bound:g})"
        return (f"mean |trainer - sampler| logprob {self.mean:.2e} over {self.tokens} sampled tokens (tol {par.bound:g}; "
                f"the largest {self.largest:.2e}: {dtype} rounds single tokens apart, not judged)")


def gap(trainer_BT: torch.Tensor, sampler_BT: torch.Tensor, mask_BT: torch.Tensor) -> Gap:
    """|trainer - sampler| over the tokens `mask_BT` marks, on every rank (a collective: every rank
    calls it), with how many were compared."""
    d = (trainer_BT - sampler_BT)[mask_BT.bool()].abs().double()
    (largest,) = dist.all_reduce_max([float(d.max()) if d.numel() else 0.0])
    total, tokens = dist.all_reduce_sum([float(d.sum()), float(d.numel())])
    return Gap(largest, total / max(tokens, 1.0), int(tokens))


def nothing_compared(name: str, what: str) -> Check:
    """A row over 0 tokens: it measured nothing, so it neither passes nor fails."""
    return Check(name, "SKIP", f"{what} over 0 tokens: no sampled completion token to compare (every completion "
                               f"empty), so this row could not tell; a larger rollout.max_new_tokens, or "
                               f"prompts the model answers, give it tokens")


def bounded(name: str, g: Gap, tol: float, what: str) -> Check:
    """A row judged by the largest difference, `g`, against `tol`; a SKIP when no token was compared."""
    if not g.tokens:
        return nothing_compared(name, what)
    return check(name, g.largest <= tol, f"{what}: {g.largest:.2e} over {g.tokens} sampled tokens (tol {tol:g})")


def trainer_logprobs(r, batch) -> torch.Tensor:
    algo = r.cfg.algo
    return score_tokens(r.strategy.forward_model, batch, r.sampling.temperature, algo.micro_batch_tokens, r.strategy,
                        layout_of(algo))


def sampler_check(r, batch, par: Parity) -> Check:
    g = gap(trainer_logprobs(r, batch), batch.sampler_logprobs_BT, batch.mask_BT)
    return g.judged("sampler", par, r.cfg.model.dtype)


def sync_verdict(after: Gap, stale: Gap, par: Parity, dtype: str) -> Check:
    """`after`: a batch sampled after the step and the push; `stale`: the batch sampled before the step,
    scored by the trainer after it (what an engine that missed the push gives). A step within the
    bound would let a missed push pass: SKIP, with what to change."""
    if not after.tokens or not stale.tokens:
        return nothing_compared("sync", "|trainer - sampler| logprob after the step")
    line = f"{after.line(par, dtype)}; the step moved the batch sampled before it by {stale.of(par):.2e} ({par.statistic})"
    if not par.holds(after.of(par)):
        return check("sync", False, line)
    if par.holds(stale.of(par)):
        return Check("sync", "SKIP", f"{line}, within the bound: a missed push would pass too. A larger algo.lr "
                                     f"(verify's step takes it without warmup) lets this row tell")
    return check("sync", True, line)


def sync_check(r, before, par: Parity) -> Check:
    """After the step: `before` (the batch the engine sampled before it) against the trainer now, then
    a push and a new batch against the trainer (grpo.verify's run has pushed nothing yet)."""
    stale = gap(trainer_logprobs(r, before), before.sampler_logprobs_BT, before.mask_BT)
    r.push_weights(version=1)
    after = first_batch(r, step=2)
    return sync_verdict(gap(trainer_logprobs(r, after), after.sampler_logprobs_BT, after.mask_BT), stale, par,
                        r.cfg.model.dtype)


def ratio_check(r, batch, tol: float) -> Check:
    algo, model = r.cfg.algo, r.strategy.forward_model
    args = (batch, r.sampling.temperature, algo.micro_batch_tokens, r.strategy, layout_of(algo))
    old = score_tokens(model, *args)
    new = score_tokens(model, *args, training_mode=True)
    return bounded("ratio", gap(torch.exp(new - old), torch.ones_like(old), batch.mask_BT), tol,
                   "max |ratio - 1| at the first step (training-mode forward against the old-logprob pass)")


def reference_check(r, batch, tol: float) -> Check:
    cfg = copy.deepcopy(r.cfg)
    if cfg.algo.beta == 0:
        cfg.algo.beta = 1e-3  # only to build one: the check is about the reference, not the run's KL
    ref = build_reference(cfg, r.model_path, r.strategy)
    algo = r.cfg.algo
    args = (batch, r.sampling.temperature, algo.micro_batch_tokens, r.strategy, layout_of(algo))
    kl = gap(score_tokens(ref, *args), score_tokens(r.strategy.forward_model, *args), batch.mask_BT)
    del ref
    return bounded("reference", kl, tol, "max |policy - reference| logprob at the first step (KL 0)")


def local_copy(r):
    """A fresh copy of the run's model on this process alone (no collectives), as the run loads it:
    loaded anew for each use, so rank 0 holds one such copy at a time (with a 7B model, each fp32
    copy and its gradients are 56 GB beside the run's own shard)."""
    model, _ = load_model(r.model_path, r.cfg.model.dtype)
    if r.cfg.model.lora.rank > 0:
        model = lora.wrap(model, r.cfg.model.lora)
        with torch.no_grad():  # B starts at 0, which would leave A without a gradient to compare
            for _, p in lora.adapter_parameters(model):
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    return model.to(next(r.strategy.model.parameters()).device).train()


@dataclass
class Gradients:
    """One layout's fp32 gradients (on the CPU: a kept set does not hold the device), the logprobs
    its model gave, and the layout that model really ran."""

    by_name: dict
    logprobs_BT: torch.Tensor
    ran: str


def gradients(r, batch, algo) -> Gradients:
    """`batch`'s gradients under `algo` on a fresh local copy of the model, freed on return."""
    strategy = SingleStrategy(None, local_copy(r), algo, total_steps=1)
    norm = loss_norm(batch, max_len=batch.completion_ids_BT.shape[1], gen_tokens_per_step=float(batch.mask_BT.sum()))
    _, plan = accumulate_gradients(strategy, batch, algo, norm, r.sampling.temperature)
    logp = score_tokens(strategy.forward_model, batch, r.sampling.temperature, algo.micro_batch_tokens,
                        layout=layout_of(algo))
    ran = plan.layout
    grads = {n: p.grad.float().cpu() for n, p in strategy.model.named_parameters() if p.grad is not None}
    return Gradients(grads, logp, ran)


def grad_gap(a: dict, b: dict) -> float:
    """max |a - b| over every gradient, relative to the largest |b|; inf when b is all zero (nothing
    would be compared) or any gradient is not finite (Python's max skips a NaN that is not first)."""
    size = max((float(g.abs().max()) for g in b.values()), default=0.0)
    gaps = [float((a[n] - b[n]).abs().max()) for n in b]
    if size == 0 or not all(math.isfinite(g) for g in [size, *gaps]):
        return float("inf")
    return max(gaps) / size


def metric_gap(a: float, b: float) -> float:
    """|a - b| relative to max(1, |a|); 0 where both are the same non-finite value (a NaN the resumed
    run reproduced), inf where only one is."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else float("inf")
    return abs(a - b) / max(1.0, abs(a))


def few_groups(batch, G: int):
    """Two groups of `batch` with a learning signal (else ±1 advantages stand in); per-completion
    advantages or, with algo.turn_rewards, per token (B x T): a group's signal is all of its rows'."""
    signal_P = batch.advantages_B.abs().reshape(batch.size, -1).sum(1).view(-1, G).sum(1)
    groups = signal_P.argsort(descending=True)[:2]
    sub = batch.select((groups[:, None] * G + torch.arange(G)).flatten())
    if not sub.advantages_B.abs().sum():
        sub.advantages_B = torch.tensor([1.0 if i % 2 else -1.0 for i in range(sub.size)])
    return sub


def layout_checks(r, batch, tol_logp: float, tol_grad: float) -> list[Check]:
    """On rank 0 alone, a few groups, local copies of the model: each layout against padded, and one
    micro-batch against several. One copy at a time, and at most two gradient sets kept (on the CPU):
    the configured layout's is compared with several micro-batches', then with padded's, then freed
    before the other layout runs."""
    sub = few_groups(batch, r.G)
    algo, configured = r.cfg.algo, layout_of(r.cfg.algo)
    names = ("layout/packed", "layout/shared", "micro-batches")
    if not sub.mask_BT.any():  # `first_batch` marks every sampled token: only a batch of empty completions
        return [nothing_compared(name, "logprobs and gradients against padded") for name in names]

    def settings(layout: str, micro_batch_tokens: int = 1 << 20):
        # no router load-balancing loss: a MoE's is a statistic of each forward's tokens (expert fractions
        # times mean scores), which no split into micro-batches adds up to exactly (grpo/moe_model.py)
        return OmegaConf.merge(algo, {"packing": layout != "padded", "shared_prompt": layout == "shared",
                                      "micro_batch_tokens": micro_batch_tokens, "beta": 0.0, "router_aux_loss_coef": 0.0})

    one = gradients(r, sub, settings(configured))
    width = int(sub.attention_mask_BL.sum(1).max()) if configured != "padded" else sub.input_ids_BL.shape[1]
    g = grad_gap(gradients(r, sub, settings(configured, width)).by_name, one.by_name)
    several = check("micro-batches", g <= tol_grad, f"{configured}, {sub.size} sequences: one micro-batch against one "
                                                     f"per {width} tokens: gradients {g:.2e} of their size "
                                                     f"(tol {tol_grad:g})")
    padded = one if configured == "padded" else gradients(r, sub, settings("padded"))
    if not any(g.any() for g in padded.by_name.values()):  # the reference layout's: a layout that lost them fails
        return [Check(name, "SKIP", f"{sub.size} sequences, {int(sub.mask_BT.sum())} tokens: every gradient of the "
                                    f"padded layout is 0 (|advantages| {float(sub.advantages_B.abs().sum()):.2g} in "
                                    f"all): nothing to compare") for name in names]
    rows = {}
    for layout in sorted(("packed", "shared"), key=lambda layout: layout != configured):  # the configured one first
        if layout == configured:
            run, one = one, None  # compared once, then freed
        else:
            run = gradients(r, sub, settings(layout))
        d, tokens = max_diff(run.logprobs_BT, padded.logprobs_BT, sub.mask_BT)
        g = grad_gap(run.by_name, padded.by_name)
        rows[layout] = check(f"layout/{layout}", d <= tol_logp and g <= tol_grad,
                             f"against padded: logprobs {d:.2e} over {tokens} tokens (tol {tol_logp:g}), gradients "
                             f"{g:.2e} of their size "
                             f"(tol {tol_grad:g}); the model ran {run.ran}" + ("" if run.ran == layout else " (a fallback)"))
        del run
    return [rows["packed"], rows["shared"], several]


def routing_check(r, batch) -> Check:
    """rollout.routing_replay, on rank 0 with a local copy: the update's forward routes every token as it
    is told. The sampler's routes moved to other experts (so a forward that ignored them would route
    differently even where trainer and sampler agree) go through the run's layout; the experts the
    routers then used must be the given ones at every routed token. Also reports how often the trainer's
    own routing differs from the sampler's (what replay corrects)."""
    if batch.routes_BLMK is None:
        return Check("routing", "SKIP", "rollout.routing_replay=false (or a dense policy): nothing is replayed")
    model = local_copy(r).eval()
    experts = routing.moe_layers(model)[0][1].num_experts
    with torch.no_grad(), routing.record(model) as own:
        model(input_ids=batch.input_ids_BL.to(next(model.parameters()).device),
              attention_mask=batch.attention_mask_BL.to(next(model.parameters()).device),
              position_ids=batch.position_ids_BL.to(next(model.parameters()).device))
    flips = routing.flip_fraction(own.routes(batch.size), batch.routes_BLMK, batch.attention_mask_BL)
    if not batch.replay_routes:
        del model
        return Check("routing", "SKIP", f"rollout.routing_observe: routes compared, not replayed; the trainer's own "
                                        f"routing differs from the sampler's on {flips:.2%} of the token-layers")
    routes = batch.routes_BLMK
    moved = replace(batch, routes_BLMK=torch.where(routes >= 0, (routes + 1) % experts, routes))
    plan = layouts.plan(model, moved, layout_of(r.cfg.algo), 1 << 30)
    wrong = total = 0
    device = next(model.parameters()).device
    for mb in plan.micro_batches:
        mb = mb.to(device)
        given = layouts.rows(model, mb).routes_RWMK.cpu()
        with torch.no_grad(), routing.record(model) as rec, forwarding(None, model, mb, r.sampling.temperature):
            pass
        used = rec.calls[0].reshape(given.shape)
        valid = (given >= 0).all(dim=-1)
        total += int(valid.sum())
        wrong += int(((used.sort(-1).values != given.sort(-1).values).any(-1) & valid).sum())
    del model
    return routing_verdict(plan.layout, wrong, total, flips)


def routing_verdict(layout: str, wrong: int, total: int, flips: float) -> Check:
    """PASS where every routed token-layer of the update used the experts it was told, and there was one:
    a batch with no routed token replays nothing, which is no pass."""
    if total == 0:
        return Check("routing", "FAIL", f"{layout}: no token-layer of the batch was routed (every route -1): nothing "
                                        f"was replayed to compare")
    return check("routing", wrong == 0, f"{layout}: {wrong} of {total} token-layers routed otherwise than told; the "
                                        f"trainer's own routing differs from the sampler's on {flips:.2%} of them")


def split_check(r, batch, tol: float) -> Check:
    """Every rank scores its batch with its rows split across its group (as the run's update does)
    and unsplit (the same strategy without the split: ZeRO-3's lockstep kept), in eval mode."""
    split = r.strategy.sequence
    if split is None:
        return Check("split", "SKIP", "parallel.sequence_parallel=1: rows are not split")
    algo = r.cfg.algo
    args = (batch, r.sampling.temperature, algo.micro_batch_tokens)
    whole = copy.copy(r.strategy)
    whole.sequence = None
    split_BT = score_tokens(r.strategy.forward_model, *args, r.strategy, layout_of(algo))
    whole_BT = score_tokens(r.strategy.forward_model, *args, whole, layout_of(algo))
    return bounded("split", gap(split_BT, whole_BT, batch.mask_BT), tol,
                   f"rows split across {split.size} ranks against unsplit: max logprob difference")


def ranks_check(r) -> Check:
    if not ranks_can_differ(r.strategy):  # the run's guards skip it alike
        return Check("ranks", "SKIP", f"parallel={r.cfg.parallel.strategy}: weights one by construction (one owner per shard)")
    every, differ = ranks_fingerprints(weight_fingerprint(r.strategy.weight_buckets(r.bucket_bytes)))
    if len(every) == 1:
        return Check("ranks", "SKIP", "one process: nothing to compare")
    return check("ranks", not differ, f"weight fingerprints after a step, rank by rank: {', '.join(f'{f:.10g}' for f in every)}"
                 + (f"; ranks {differ} differ from rank 0" if differ else ""))


def render_check(r) -> Check:
    if r.rollout.episodes is None or r.cfg.env.render != "chat":
        return Check("render", "SKIP", "no environment with chat rendering")
    render = r.rollout.episodes.render
    probe = getattr(render, "check", None)
    if probe is None:
        return Check("render", "SKIP", "this renderer has no self-check")
    ok, detail = probe()
    return check("render", ok, detail)


COMPARED = ("reward/mean", "loss", "grad_norm", "clip_frac", "entropy", "completion_len", "sampler_diff", "kl")
# grpo.train's `  sample @ <step>: <repr of the prompt> -> ...` (grpo/log.py); repr takes " for a prompt with '
PRINTED_PROMPT = re.compile(r"^  sample @ (\d+): ('(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")", re.MULTILINE)


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def child_env(environ) -> dict:
    """The environment of the resume check's one-process runs: this one's without its rendezvous. A
    ZeRO or DDP strategy gave this process a store on MASTER_PORT (grpo.dist.init_distributed), which it
    still holds: a child given that port failed with EADDRINUSE (seen on the first GPU run, and on CPU)."""
    return {k: v for k, v in environ.items() if k not in RENDEZVOUS}


# where a run lives and whether it resumes: the resume check's runs set these themselves
PLACEMENT = ("run_dir", "resume", "hydra.run.dir")


def child_overrides(overrides: list[str]) -> list[str]:
    """The run's overrides without PLACEMENT's (also as +key= / ++key= / ~key): a user's run_dir= won
    over the check's hydra.run.dir=, so both of its runs resumed the user's real run folder
    (config.yaml overwritten, a step appended to metrics.jsonl; a finished run's folder crashed verify)."""
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in PLACEMENT]


def resume_settings(threads: int) -> list[str]:
    """What both of the resume check's runs set. Both run on `threads`, this process's count: with
    threads=auto each run would pick its own from the CPUs idle when it starts, and another count sums
    in another order (1 against 2 threads: sampler_diff about 2e-6 apart within 4 steps of the default
    run; a flip of a sampled token would make it more)."""
    return [*SCRATCH, "algo.lr_schedule=constant", "checkpoint_every=1", "resume=true", f"threads={threads}"]


def resume_check(overrides: list[str], world_size: int, max_staleness: int) -> Check:
    """Two 4-step runs of `grpo.train` in subprocesses, each in its own scratch folder: one unbroken,
    one stopped after step 2 and resumed: steps 3 and 4's metrics must agree (the same prompts, seeds
    and weights; from step 4 on, the optimizer's and the schedule's state too: a step's metrics come
    before its optimizer step, and step 1 may train nothing); asynchronous, their prompts (`resume_kept`).
    `world_size` is the launch's (the process group is gone by now): each rank's subprocess would
    inherit torchrun's rank variables and join another's rendezvous."""
    if world_size > 1:
        return Check("resume", "SKIP", "run grpo.verify on one process for the resume check")
    # The stop is a 2-step run: a linear schedule's decay would then differ from the unbroken run's
    # (it ends at `steps`), and the resumed run's step 3 would take the 2-step run's last LR. Warmup,
    # then constant, is the same in both, and still needs the schedule's position restored.
    same = resume_settings(torch.get_num_threads())
    if max_staleness:  # every prompt of every step printed: what an asynchronous resume keeps
        same += ["logger.sample_every=1", "logger.num_samples=1000000"]
    base = tempfile.mkdtemp(prefix="grpo-verify-resume-")
    try:
        rows, started, printed = {}, {}, {}
        for name, parts in (("unbroken", ["steps=4"]), ("resumed", ["steps=2", "steps=4"])):
            folder, printed[name] = os.path.join(base, name), {}
            for steps in parts:
                cmd = [sys.executable, "-m", "grpo.train", *child_overrides(overrides), *same, steps,
                       f"run_dir={folder}", f"hydra.run.dir={folder}"]
                out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(os.environ))
                if out.returncode:
                    return Check("resume", "FAIL", f"{' '.join(cmd[2:])} exited {out.returncode}: {out.stderr.strip()[-400:]}")
                for step, prompt in PRINTED_PROMPT.findall(out.stdout):  # a step printed twice: its prompts twice
                    printed[name].setdefault(int(step), []).append(prompt)
            rows[name] = read_metrics(os.path.join(folder, "metrics.jsonl"))  # null: NaN, as the run computed it
            started[name] = json.load(open(os.path.join(folder, "summary.json")))["resumed_from"]
        return (resume_started(started) or resume_kept(rows, printed)) if max_staleness else resume_verdict(rows, started)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def resume_started(started: dict[str, int]) -> Check | None:
    """A FAIL unless the resumed run started after step 2: one that found no checkpoint logs the unbroken run's."""
    for name, expected in (("unbroken", 0), ("resumed", 2)):
        if started[name] != expected:
            return Check("resume", "FAIL", f"the {name} run started after step {started[name]}, not {expected} "
                                           f"(summary.json's resumed_from): the checkpoint of step 2 was not found or not loaded")


def resume_kept(rows: dict[str, list[dict]], printed: dict[str, dict[int, list[str]]]) -> Check:
    """Under algo.max_staleness > 0 the metrics differ by design: the 2-step run's last checkpoint has no batch
    in flight (`batches_to_submit`), so the resumed run samples batch 3 from the step-2 weights, the unbroken one
    from older ones (sampler_diff 1.0 apart at step 3, k = 1). What the design keeps is compared: steps 1-4
    logged once, steps 3 and 4's prompts (`printed`). A batch in flight at a stop: tests/test_async.py."""
    logged = [row["step"] for row in rows["resumed"] if "loss" in row]
    if logged != [1, 2, 3, 4]:
        return Check("resume", "FAIL", f"the resumed run logged steps {logged}, not 1 to 4 once each (metrics.jsonl)")
    for step in (3, 4):
        want, got = printed["unbroken"].get(step, []), printed["resumed"].get(step, [])
        if not want or got != want:
            return Check("resume", "FAIL", f"step {step}: the resumed run trained {len(got)} prompts, the first {got[:1]}, "
                                           f"where the unbroken run trained {len(want)}, the first {want[:1]}")
    return Check("resume", "PASS", f"algo.max_staleness > 0: steps 3 and 4 trained the unbroken run's prompts ({len(want)} "
                                   f"each), steps 1-4 logged once; metrics not compared (newer weights sample batch 3)")


def resume_verdict(rows: dict[str, list[dict]], started: dict[str, int]) -> Check:
    """The resume check's verdict from its runs' metrics.jsonl rows and summary.json's `resumed_from`
    ("unbroken" and "resumed"): the resumed run must have started after step 2 (`resume_started`), and
    steps 3 and 4's COMPARED metrics must agree within RESUME_TOL of max(1, |value|); a metric or a step
    the resumed run did not log is a gap."""
    if failed := resume_started(started):
        return failed
    gaps = {}
    for step in (3, 4):
        at = {k: next((x for x in v if x.get("step") == step and "loss" in x), None) for k, v in rows.items()}
        missing = [k for k, row in at.items() if row is None]
        if missing:
            return Check("resume", "FAIL", f"the {' and the '.join(missing)} run logged no step {step} (metrics.jsonl)")
        gaps |= {(step, k): metric_gap(at["unbroken"][k], at["resumed"].get(k, math.nan))
                 for k in COMPARED if k in at["unbroken"]}
    worst = max(gaps, key=gaps.get)
    return check("resume", gaps[worst] <= RESUME_TOL, f"steps 3 and 4 of an unbroken run against one stopped after step 2 "
                                                      f"and resumed: {len(gaps)} metrics, largest gap {gaps[worst]:.2e} "
                                                      f"of max(1, |value|) ({worst[1]} at step {worst[0]})")


def run_checks(cfg, overrides: list[str]) -> list[Check]:
    info = dist.dist_info()
    tol_logp, tol_grad = TOLERANCES.get(cfg.model.dtype, TOLERANCES["float32"])
    results = []
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(run_process_group(cfg, info))
        r = setup(cfg, info, cleanup)
        batch = first_batch(r)
        # the doctor's and the `gpu` tier's parity: by dtype and device (grpo.guards.PARITY)
        par = parity(cfg.model.dtype, "cuda" if torch.cuda.is_available() else "cpu")
        results.append(sampler_check(r, batch, par))
        results.append(ratio_check(r, batch, tol_logp))
        results.append(reference_check(r, batch, REFERENCE_TOL))
        results.append(split_check(r, batch, tol_logp))
        if info.is_main:
            results += layout_checks(r, batch, tol_logp, tol_grad)
            results.append(routing_check(r, batch))
        dist.barrier()
        policy_update(r.strategy, batch, cfg.algo, batch.completion_ids_BT.shape[1], r.sampling.temperature)
        results.append(ranks_check(r))
        results.append(sync_check(r, batch, par))
        results.append(render_check(r))
    results.append(resume_check(overrides, info.world_size, cfg.algo.max_staleness))
    return results


def verify(overrides: list[str]) -> int:
    scratch = tempfile.mkdtemp(prefix="grpo-verify-")  # rank 0's is the run folder (setup broadcasts it)
    try:  # removed on every way out, an override that does not compose or validate included
        cfg = compose_config([*overrides, *SCRATCH, *ONE_STEP, f"run_dir={scratch}"])
        validate(cfg)
        info = dist.dist_info()
        quiet_library_logs(info.rank)
        configure_threads(cfg.threads)
        results = run_checks(cfg, overrides)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if info.is_main:
        print(f"grpo.verify {' '.join(overrides) or '(the default run)'}: model.dtype={cfg.model.dtype}, "
              f"{info.world_size} process(es), layout {layout_of(cfg.algo)}")
        for c in results:
            print(c.line())
        failed = [c.name for c in results if c.status == "FAIL"]
        print(f"{'FAIL: ' + ', '.join(failed) if failed else 'all checks passed'} "
              f"({sum(c.status == 'PASS' for c in results)} pass, {sum(c.status == 'SKIP' for c in results)} skipped)")
    failed = any(c.status == "FAIL" for c in results)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m grpo.verify [HYDRA OVERRIDES ...]   (torchrun --nproc_per_node N -m grpo.verify ...)\n")
        print(__doc__)
        return
    sys.exit(exit_on_user_error(verify, args))


if __name__ == "__main__":
    main()
