"""The step guards (grpo/guards.py): a planted non-finite gradient is skipped and counted; a run of
them stops with what to try; diverged ranks are named; a drifting sampler is warned. Each is planted
once directly and once through `grpo.train.train`'s loop (deleting the loop's call must fail a test)."""

import copy
import json
import math
import os
import re
import threading
import warnings
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

import grpo.train
import grpo.update.step
from grpo import guards
from grpo.config import AlgoConfig
from grpo.guards import (NonFiniteSteps, RankCheck, RanksDiverged, RunGuards, SamplerWatch, StepGuard, healthy,
                         ranks_fingerprints, weight_fingerprint)
from grpo.log import read_metrics
from grpo.parallel import STRATEGIES, strategy_class
from grpo.parallel.single import SingleStrategy
from grpo.update import policy_update
from tests.test_packing import spread_batch
from tests.test_parallel import TORCHRUN, run


def planted_step(strategy, model, ids, nan: bool) -> float:
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    strategy.backward(loss)
    if nan:  # one NaN in one gradient, as cuDNN's backward gives (REVIEW Part 4, G1)
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    return strategy.step()


def test_a_non_finite_gradient_skips_the_optimizer_step_and_holds_the_schedule(tiny_lm):
    """The skipped step takes nothing, the schedule included, as DeepSpeed's ZeRO holds it on an overflow
    (grpo/parallel/zero.py): one rule under every strategy. Linear decay over 4 steps, no warmup: the
    factor at optimizer step s is (4 - s) / 4, so lr 1e-2 at step 0 and 7.5e-3 once one step is counted;
    a schedule that counted the skipped step reads 7.5e-3 before any step was taken."""
    base, _ = tiny_lm
    model = copy.deepcopy(base).train()
    algo = OmegaConf.structured(AlgoConfig(lr=1e-2, warmup_steps=0, lr_schedule="linear"))
    strategy = SingleStrategy(None, model, algo, total_steps=4)
    ids = torch.tensor([[1, 5, 6, 7]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not math.isfinite(planted_step(strategy, model, ids, nan=True))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing applied, no NaN
    assert all(p.grad is None for p in model.parameters())  # and nothing carried into the next step
    assert (strategy.scheduler.last_epoch, strategy.lr) == (0, pytest.approx(1e-2))  # the schedule held
    assert math.isfinite(planted_step(strategy, model, ids, nan=False))
    assert (strategy.scheduler.last_epoch, strategy.lr) == (1, pytest.approx(7.5e-3))  # the applied step counts
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_guard_counts_skips_and_stops_a_run_of_them():
    guard = StepGuard(max_in_a_row=3)
    # the layout is the one policy_update says its micro-batches ran (its stats' `layout`)
    ok, bad = {"loss": 0.1, "grad_norm": 1.0, "layout": "shared"}, {"loss": 0.1, "grad_norm": float("nan"), "layout": "shared"}
    assert guard.check(1, ok) == {"guard/skipped_steps": 0}
    with pytest.warns(UserWarning, match="step 2: non-finite grad_norm nan \\(shared layout\\): 1 of 1 optimizer steps"):
        assert guard.check(2, bad) == {"guard/skipped_steps": 1}
    with pytest.warns(UserWarning, match="step 3: non-finite loss inf"):
        assert guard.check(3, {"loss": float("inf"), "grad_norm": 1.0, "layout": "shared"}) == {"guard/skipped_steps": 2}
    assert guard.check(4, ok) == {"guard/skipped_steps": 2}  # in a row: counted anew
    bad = {**bad, "layout": "packed"}
    with pytest.warns(UserWarning):
        guard.check(5, bad)
        guard.check(6, bad)
    with pytest.raises(NonFiniteSteps, match="3 steps in a row.*'packed' layout.*algo.lr.*grpo.verify"):
        guard.check(7, bad)


@pytest.mark.starts_process
@pytest.mark.parametrize("strategy,dtype", [("ddp", "float32"), ("zero2", "bfloat16"), ("zero3", "float32")])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank_and_a_diverged_rank_is_named(tmp_path, strategy, dtype):
    """2 processes: rank 1's loss is NaN at one step. Every rank sees the non-finite norm after the
    reduction and no weight moves (DeepSpeed's ZeRO optimizers treat it as an overflow, in fp32 and
    bf16); the next clean step moves them, finite. Then rank 1 alone changes a weight: the rank check
    fails on both ranks, naming rank 1 (and passes before that; ZeRO-3 holds each weight once, so
    there only the agreement is checked)."""
    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "tests/guard_step.py", str(tmp_path), strategy, dtype])
    for rank in (0, 1):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        print(rank, got)
        assert not math.isfinite(got["planted_norm"]) and not got["moved_at_planted"], got
        assert math.isfinite(got["clean_norm"]) and got["moved_at_clean"] and got["finite"], got
        assert got["rank_check"][0] == "agree", got
        if strategy != "zero3":  # replicated weights: rank 1's change is named on both ranks
            assert "ranks [1] hold weights that differ from rank 0's" in got["rank_check"][1], got


@pytest.mark.starts_process
def test_a_rank_diverged_in_the_loop_is_named_on_every_rank(tmp_path, cache_dir):
    """Issue 46 item 3, the rank check through grpo.train's loop on 2 ddp processes: rank 1 alone
    changes a weight after step 1's update; the check due at step 1 ends the run on both ranks, naming
    rank 1 (tests/guard_step.py `train`)."""
    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "tests/guard_step.py", str(tmp_path), "train", cache_dir])
    for rank in (0, 1):
        said = json.load(open(tmp_path / f"rank{rank}.json"))["said"]
        assert said.startswith("after step 1 ranks [1] hold weights that differ from rank 0's"), (rank, said)


def test_the_rank_check_runs_at_step_1_and_every_n_and_never_alone():
    check = RankCheck(every=50, world=2)
    assert [s for s in range(1, 201) if check.due(s)] == [1, 50, 100, 150, 200]
    assert not any(RankCheck(every=50, world=1).due(s) for s in range(1, 201))  # one rank: nothing to compare
    assert not any(RankCheck(every=0, world=8).due(s) for s in range(1, 201))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_rank_check_gathers_only_where_ranks_hold_their_own_copy(monkeypatch, name):
    """Each registered strategy as the run hands it to its guards, on 2 ranks at step 1 (the check is due).
    single's replica, stepped by each ddp rank itself, can drift apart: its weights are fingerprinted.
    Under ZeRO every weight has one owner per shard and every rank's full weights are the owners'
    (ZeRO-3 gathers each from its owner, ZeRO-2 all-gathers them after each step): they cannot differ,
    so the check could only pass, and under ZeRO-3 it cost a full gather of the weights."""
    gathers = {"single": True, "ddp": True, "zero2": False, "zero3": False}[name]  # a new strategy: say which
    strategy = object.__new__(strategy_class(name))  # the class's own declaration, no engine built
    asked = []
    strategy.weight_buckets = lambda bucket_bytes: asked.append(bucket_bytes) or [[("w", torch.arange(6.0))]]
    monkeypatch.setattr(guards.dist, "world_size", lambda: 2)
    monkeypatch.setattr(guards.dist, "rank", lambda: 0)
    monkeypatch.setattr(guards.dist, "all_reduce_sum", lambda v: [v[0], v[0]])  # rank 1's weights are rank 0's
    run_guards = RunGuards(strategy, 64, healthy("float32", "cpu", {}), check_ranks_every=50, world=2)
    run_guards.after_update(1, {"loss": 0.1, "grad_norm": 1.0, "trained_completions": 0}, 0)
    assert asked == ([64] if gathers else []), asked


def test_the_weight_fingerprint_sees_a_swap_and_a_shift():
    a, b = torch.arange(6.0), torch.arange(6.0) + 10
    base = weight_fingerprint([[("a", a), ("b", b)]])
    assert weight_fingerprint([[("a", a), ("b", b)]]) == base
    assert weight_fingerprint([[("a", b), ("b", a)]]) != base  # tensors swapped: the same sum
    assert weight_fingerprint([[("a", a.roll(1)), ("b", b)]]) != base  # one tensor's values shifted
    # by value: a = 0..5 weighted by 1, 1.2, ..., 2 -> sum i * (1 + i / 5) = 15 + 55 / 5 = 26
    assert weight_fingerprint([[("a", a)]]) == pytest.approx(26.0)


def test_a_fingerprint_that_differs_beyond_summation_noise_names_the_rank(monkeypatch):
    """Two ranks (the other's fingerprint put in as the all-reduce would): 1e-7 relative apart is far
    beyond float64 summation order, so the weights differ: rank 1 is named, and the check stops the
    run; 1e-12 apart is summation order, not reported. A tolerance of 1e-3 would let ranks whose
    weights differ by a small update run on unnoticed."""
    mine = 1234.5678
    monkeypatch.setattr(guards.dist, "world_size", lambda: 2)
    monkeypatch.setattr(guards.dist, "rank", lambda: 0)
    for theirs, differ in ((mine * (1 + 1e-7), [1]), (mine * (1 + 1e-12), [])):
        monkeypatch.setattr(guards.dist, "all_reduce_sum", lambda v, theirs=theirs: [v[0], v[1] + theirs])
        assert ranks_fingerprints(mine) == ([mine, theirs], differ)
    monkeypatch.setattr(guards.dist, "all_reduce_sum", lambda v: [v[0], v[1] + mine * (1 + 1e-7)])
    monkeypatch.setattr(guards, "weight_fingerprint", lambda buckets: mine)
    with pytest.raises(RanksDiverged, match=r"after step 3 ranks \[1\] hold weights that differ from rank 0's"):
        RankCheck(every=1, world=2).check(3, [])


def on_two_ranks(monkeypatch, work) -> list[str]:
    """`work(rank)` on two threads standing for ranks 0 and 1, grpo.guards' dist made theirs: all_reduce_sum
    sums what both ranks put in, as the real one does (a rank's own fingerprint sits in its own slot
    only). What each rank said: "agree", or its RanksDiverged message."""
    local, meet, put, said = threading.local(), threading.Barrier(2, timeout=30), [None, None], [None, None]

    def all_reduce_sum(values):
        put[local.rank] = list(values)
        meet.wait()
        summed = [a + b for a, b in zip(*put)]
        meet.wait()  # both have read before either puts in again
        return summed

    def rank(r):
        local.rank = r
        try:
            work(r)
            said[r] = "agree"
        except RanksDiverged as e:
            said[r] = str(e)

    monkeypatch.setattr(guards.dist, "rank", lambda: local.rank)
    monkeypatch.setattr(guards.dist, "world_size", lambda: 2)
    monkeypatch.setattr(guards.dist, "all_reduce_sum", all_reduce_sum)
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return said


def test_a_rank_whose_weights_went_non_finite_is_named(monkeypatch):
    """Rank 1's weights hold a NaN (a step it alone applied with a non-finite gradient). Each rank put
    `mine * (i == rank)` into the all-reduce: NaN x 0 is NaN, so every slot summed to NaN, and NaN > tol
    is False: the check passed on both ranks exactly when a rank's weights were lost. Both ranks must
    name rank 1; equal finite weights (26 on each: 0..5 weighted by 1, 1.2, ..., 2) agree."""
    weights = {0: torch.arange(6.0), 1: torch.arange(6.0)}
    assert on_two_ranks(monkeypatch, lambda r: RankCheck(1, 2).check(1, [[("w", weights[r])]])) == ["agree", "agree"]
    weights[1] = torch.tensor([0.0, 1.0, float("nan"), 3.0, 4.0, 5.0])
    said = on_two_ranks(monkeypatch, lambda r: RankCheck(1, 2).check(1, [[("w", weights[r])]]))
    assert all(s.startswith("after step 1 ranks [1] hold non-finite weights (fingerprints 26, nan)") for s in said), said


def test_the_sampler_watch_warns_once_after_three_on_policy_steps_above_the_bound():
    watch = SamplerWatch(healthy("float32", "cpu", {}))  # the largest difference, 0.05

    def step(diff):
        return {"sampler_diff": diff, "sampler_diff_mean": diff / 100}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may warn
        for n, diff, behind in ((1, 0.2, 0), (2, 0.2, 0), (3, 1e-5, 0), (4, 0.2, 0), (5, 0.2, 0), (6, 0.9, 1),
                                (7, 0.01, 0)):
            watch.check(n, step(diff), behind)  # a reset at 3 and 7; the stale batch at 6 is not counted
    for n in (8, 9):
        watch.check(n, step(0.2), 0)
    with pytest.warns(UserWarning, match="step 10: sampler_diff 0.2 > 0.05 for 3 on-policy steps.*weights do not reach"):
        watch.check(10, step(0.2), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.check(11, step(0.2), 0)  # once


def test_the_sampler_watch_judges_the_mean_in_bf16():
    """A healthy bf16 colocated run (the tiny model, 150 steps on CPU) rounds single tokens up to 2.24
    apart (above 0.5 at 18 steps, 3 in a row by step 58) while the mean stays 0.004-0.021: judged by the
    largest it warned that the engines sample something else. The mean is judged (0.2); a missed sync
    gives 0.48-0.70."""
    watch = SamplerWatch(healthy("bfloat16", "cpu", {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(1, 6):
            watch.check(n, {"sampler_diff": 2.24, "sampler_diff_mean": 0.021}, 0)
    for n in (6, 7):
        watch.check(n, {"sampler_diff": 6.0, "sampler_diff_mean": 0.5}, 0)
    with pytest.warns(UserWarning, match="step 8: sampler_diff_mean 0.5 > 0.2 for 3 on-policy steps"):
        watch.check(8, {"sampler_diff": 6.0, "sampler_diff_mean": 0.5}, 0)


def test_the_sampler_watch_follows_a_users_tf32():
    """On the H200 (vLLM 0.26.0, the tiny fp32 run with Triton's TF32, docs/results/gpu_vllm.md) the
    largest difference per step was 5.3e-3 to 7.6e-2, one step above 0.05: a fixed fp32 watch of 0.05
    sits inside that spread, and three such steps in a row (constructed below from that range) would
    warn on a healthy run. Under a user's TRITON_F32_DEFAULT=tf32 the watch is twice its parity, 0.2;
    with ieee (grpo's default for an fp32 engine) it stays 0.05."""
    h200 = [1.4e-2, 5.3e-2, 6.1e-2, 7.6e-2, 5.5e-2, 2.0e-2]
    tf32 = SamplerWatch(healthy("float32", "cuda", {"TRITON_F32_DEFAULT": "tf32"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n, diff in enumerate(h200, 1):
            tf32.check(n, {"sampler_diff": diff}, 0)
    ieee = SamplerWatch(healthy("float32", "cuda", {"TRITON_F32_DEFAULT": "ieee"}))
    with pytest.warns(UserWarning, match="step 4: sampler_diff 0.076 > 0.05 for 3"):
        for n, diff in enumerate(h200, 1):
            ieee.check(n, {"sampler_diff": diff}, 0)


def test_the_fingerprint_in_chunks_is_the_whole_tensors_value():
    """REVIEW Part 5 finding 9: the ramp is built per chunk from the global offset, so any chunk size
    gives the whole-tensor value (up to float64 summation order); 26 as worked out above."""
    torch.manual_seed(0)
    buckets = [[("a", torch.randn(1000)), ("b", torch.randn(7, 13))], [("c", torch.randn(1)), ("d", torch.randn(64))]]
    whole = weight_fingerprint(buckets, chunk=10**6)
    for chunk in (1, 7, 64, 999):
        assert weight_fingerprint(buckets, chunk=chunk) == pytest.approx(whole, rel=1e-12), chunk
    assert weight_fingerprint([[("a", torch.arange(6.0))]], chunk=4) == pytest.approx(26.0)


class LargestFloat64(TorchDispatchMode):
    """Records the most elements of any float64 tensor an op makes: the fingerprint's transient."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.most = max(self.most, t.numel())
        return out


def test_the_fingerprint_holds_one_chunk_in_float64_at_a_time():
    """REVIEW Part 5 finding 9: a float64 copy of the whole weight and a float64 ramp as long (8.7 GB
    for Qwen2.5-7B's embedding, at step 1 of every multi-rank run) became one chunk of each."""
    weight = torch.randn(10_000)
    with LargestFloat64() as spy:
        weight_fingerprint([[("embed", weight)]], chunk=1024)
    assert 0 < spy.most <= 1024, spy.most


def plant_nan_loss(monkeypatch, steps: set[int]) -> None:
    """A NaN loss in every micro-batch of the given steps' updates, as a kernel's NaN makes it: the
    real loop, strategy and guards see it (grpo.train calls policy_update once per step)."""
    step = [0]
    real_update, real_loss = grpo.train.policy_update, grpo.update.step.decoupled_loss

    def counted_update(*args, **kwargs):
        step[0] += 1
        return real_update(*args, **kwargs)

    def planted_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan") if step[0] in steps else loss), stats

    monkeypatch.setattr(grpo.train, "policy_update", counted_update)
    monkeypatch.setattr(grpo.update.step, "decoupled_loss", planted_loss)


def logged_steps(cfg) -> list[dict]:
    return [r for r in read_metrics(os.path.join(cfg.run_dir, "metrics.jsonl")) if "loss" in r]  # null: NaN


SHORT = ("task.eval_size=8", "export_model=false")  # the guards act per step: the evaluations can be tiny


@pytest.mark.starts_process
def test_non_finite_steps_through_the_loop_are_logged_and_three_in_a_row_stop_it(make_cfg, monkeypatch):
    """REVIEW Part 5, tests that cannot fail 1: steps 2, 3 and 4 of a 4-step run have a NaN loss. Steps
    2 and 3 are skipped, warned and logged as guard/skipped_steps 1 and 2; step 4, the third in a
    row, ends the run with NonFiniteSteps."""
    plant_nan_loss(monkeypatch, {2, 3, 4})
    cfg = make_cfg("steps=4", "algo.zero_std_groups=keep", *SHORT)  # every step trains: a NaN loss reaches backward
    with pytest.warns(UserWarning) as said, pytest.raises(NonFiniteSteps, match="3 steps in a row \\(to step 4\\)"):
        grpo.train.train(cfg)
    guard_said = [str(w.message) for w in said if "optimizer steps were skipped" in str(w.message)]
    assert len(guard_said) == 2 and all(re.match(rf"step {s}: non-finite loss nan, grad_norm nan \(\w+ layout\): 1 of 1 "
                                                 "optimizer steps", m) for s, m in zip((2, 3), guard_said)), guard_said
    rows = logged_steps(cfg)
    assert [(r["step"], r["guard/skipped_steps"]) for r in rows] == [(1, 0), (2, 1), (3, 2)], rows
    assert math.isfinite(rows[0]["grad_norm"]) and not math.isfinite(rows[1]["grad_norm"]), rows


@pytest.mark.starts_process
def test_a_drifting_sampler_through_the_loop_is_logged_and_warned(make_cfg, monkeypatch):
    """Issue 46 item 3, the sampler watch: every batch's sampler logprobs are shifted by 1 (as an
    engine that never got the weights gives them): sampler_diff logs 1 at every step, and the third
    on-policy step in a row above float32's bound (0.05) warns with the likely causes."""
    real = grpo.train.collate

    def drifted(*args, **kwargs):
        batch = real(*args, **kwargs)
        return replace(batch, sampler_logprobs_BT=batch.sampler_logprobs_BT - 1.0)

    monkeypatch.setattr(grpo.train, "collate", drifted)
    cfg = make_cfg("algo.zero_std_groups=keep", *SHORT)  # every step trains (the tiny policy's first groups are flat)
    with pytest.warns(UserWarning, match="step 3: sampler_diff 1 > 0.05 for 3 on-policy steps.*weights do not reach"):
        grpo.train.train(cfg)
    assert [round(r["sampler_diff"], 4) for r in logged_steps(cfg)] == [1.0, 1.0, 1.0]


def test_a_step_that_trained_nothing_does_not_reset_the_sampler_watch():
    """A step whose groups were all dropped (zero std) scores no token: its sampler_diff is 0 for want
    of tokens, not a sign of a healthy sampler. Three drifted steps around it still warn."""
    guards = RunGuards(None, 0, healthy("float32", "cpu", {}), check_ranks_every=50, world=1)
    drifted, empty = {"loss": 0.1, "grad_norm": 1.0, "sampler_diff": 0.9, "trained_completions": 8}, {
        "loss": 0.0, "grad_norm": 0.0, "sampler_diff": 0.0, "trained_completions": 0}
    guards.after_update(1, drifted, 0)
    guards.after_update(2, drifted, 0)
    guards.after_update(3, empty, 0)
    with pytest.warns(UserWarning, match="step 4: sampler_diff 0.9 > 0.05 for 3 on-policy steps"):
        guards.after_update(4, drifted, 0)


def test_one_skipped_minibatch_step_of_two_is_reported_as_one_of_two(tiny_lm, monkeypatch):
    """REVIEW Part 5, tests that cannot fail 7: algo.num_minibatches=2, a NaN loss in the first
    minibatch. Its step is skipped, the second is applied: the update reports 1 of 2 optimizer steps
    skipped, the applied step's norm as grad_norm (not inf for the whole update), and the guard counts
    one skipped step and says "1 of 2"."""
    base, tok = tiny_lm
    model = copy.deepcopy(base).train()
    algo = OmegaConf.structured(AlgoConfig(group_size=2, batch_size=8, num_minibatches=2, lr=1e-2, warmup_steps=0))
    strategy = SingleStrategy(None, model, algo, total_steps=4)
    calls, norms = [0], []
    real_loss, real_step = grpo.update.step.decoupled_loss, strategy.step

    def planted_loss(*args, **kwargs):  # one micro-batch per minibatch: call 1 is minibatch 1's
        calls[0] += 1
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan") if calls[0] == 1 else loss), stats

    def step():
        norms.append(real_step())
        return norms[-1]

    monkeypatch.setattr(grpo.update.step, "decoupled_loss", planted_loss)
    monkeypatch.setattr(strategy, "step", step)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = policy_update(strategy, spread_batch(tok), algo, 14, 1.0)
    # the layout policy_update says ran: AlgoConfig's defaults share prompts on the CPU (a caller's guess could differ)
    assert stats["layout"] == "shared"
    with pytest.warns(UserWarning, match="step 5: non-finite loss nan \\(shared layout\\): 1 of 2 optimizer steps were skipped"):
        assert StepGuard().check(5, stats) == {"guard/skipped_steps": 1}
    assert calls[0] == 2 and not math.isfinite(norms[0]) and math.isfinite(norms[1]), norms
    assert (stats["optimizer_steps"], stats["skipped_optimizer_steps"], stats["grad_norm"]) == (2, 1, norms[1])
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # the second step applied
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_guard_counts_skipped_optimizer_steps_not_updates():
    """2 of 4 minibatch steps skipped, then 1 of 4: guard/skipped_steps counts 3 optimizer steps (2
    updates in a row); a bf16 overflow that left loss and the applied steps' norm finite still counts."""
    guard = StepGuard(max_in_a_row=3)
    with pytest.warns(UserWarning, match="step 1: non-finite loss nan \\(packed layout\\): 2 of 4 optimizer steps"):
        assert guard.check(1, {"loss": float("nan"), "grad_norm": 0.5, "optimizer_steps": 4,
                               "skipped_optimizer_steps": 2, "layout": "packed"}) == {"guard/skipped_steps": 2}
    with pytest.warns(UserWarning, match="step 2: non-finite gradient \\(packed layout\\): 1 of 4 optimizer steps.*2 steps in a row"):
        assert guard.check(2, {"loss": 0.1, "grad_norm": 0.5, "optimizer_steps": 4,
                               "skipped_optimizer_steps": 1, "layout": "packed"}) == {"guard/skipped_steps": 3}
