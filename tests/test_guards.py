"""The step guard (grpo/guards.py): a planted non-finite gradient is skipped and counted; a run of
them stops with what to try."""

import copy
import json
import math
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import AlgoConfig
from grpo.guards import NonFiniteSteps, RankCheck, SamplerWatch, StepGuard, weight_fingerprint
from grpo.parallel.single import SingleStrategy
from tests.test_parallel import TORCHRUN, run


def planted_step(strategy, model, ids, nan: bool) -> float:
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    strategy.backward(loss)
    if nan:  # one NaN in one gradient, as cuDNN's backward gives (REVIEW Part 4, G1)
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    return strategy.step()


def test_a_non_finite_gradient_skips_the_optimizer_step(tiny_lm):
    base, _ = tiny_lm
    model = copy.deepcopy(base).train()
    algo = OmegaConf.structured(AlgoConfig(lr=1e-2, warmup_steps=0))
    strategy = SingleStrategy(None, model, algo, total_steps=4)
    ids = torch.tensor([[1, 5, 6, 7]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not math.isfinite(planted_step(strategy, model, ids, nan=True))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing applied, no NaN
    assert all(p.grad is None for p in model.parameters())  # and nothing carried into the next step
    assert strategy.scheduler.last_epoch == 1  # the schedule counts the spent step
    assert math.isfinite(planted_step(strategy, model, ids, nan=False))
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_guard_counts_skips_and_stops_a_run_of_them():
    guard = StepGuard(max_in_a_row=3)
    ok, bad = {"loss": 0.1, "grad_norm": 1.0}, {"loss": 0.1, "grad_norm": float("nan")}
    assert guard.check(1, ok, "shared") == {"guard/skipped_steps": 0}
    with pytest.warns(UserWarning, match="step 2: non-finite grad_norm nan \\(shared layout\\)"):
        assert guard.check(2, bad, "shared") == {"guard/skipped_steps": 1}
        assert guard.check(3, {"loss": float("inf"), "grad_norm": 1.0}, "shared") == {"guard/skipped_steps": 2}
    assert guard.check(4, ok, "shared") == {"guard/skipped_steps": 2}  # in a row: counted anew
    with pytest.warns(UserWarning):
        guard.check(5, bad, "packed")
        guard.check(6, bad, "packed")
    with pytest.raises(NonFiniteSteps, match="3 steps in a row.*'packed' layout.*algo.lr.*grpo.verify"):
        guard.check(7, bad, "packed")


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


def test_the_rank_check_runs_at_step_1_and_every_n_and_never_alone():
    check = RankCheck(every=50, world=2)
    assert [s for s in range(1, 201) if check.due(s)] == [1, 50, 100, 150, 200]
    assert not any(RankCheck(every=50, world=1).due(s) for s in range(1, 201))  # one rank: nothing to compare
    assert not any(RankCheck(every=0, world=8).due(s) for s in range(1, 201))


def test_the_weight_fingerprint_sees_a_swap_and_a_shift():
    a, b = torch.arange(6.0), torch.arange(6.0) + 10
    base = weight_fingerprint([[("a", a), ("b", b)]])
    assert weight_fingerprint([[("a", a), ("b", b)]]) == base
    assert weight_fingerprint([[("a", b), ("b", a)]]) != base  # tensors swapped: the same sum
    assert weight_fingerprint([[("a", a.roll(1)), ("b", b)]]) != base  # one tensor's values shifted
    # by value: a = 0..5 weighted by 1, 1.2, ..., 2 -> sum i * (1 + i / 5) = 15 + 55 / 5 = 26
    assert weight_fingerprint([[("a", a)]]) == pytest.approx(26.0)


def test_the_sampler_watch_warns_once_after_three_on_policy_steps_above_the_bound():
    watch = SamplerWatch("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may warn
        for step, diff, behind in ((1, 0.2, 0), (2, 0.2, 0), (3, 1e-5, 0), (4, 0.2, 0), (5, 0.2, 0), (6, 0.9, 1),
                                   (7, 0.01, 0)):
            watch.check(step, diff, behind)  # a reset at 3 and 7; the stale batch at 6 is not counted
    for step in (8, 9):
        watch.check(step, 0.2, 0)
    with pytest.warns(UserWarning, match="step 10: sampler_diff 0.2 > 0.05 for 3 on-policy steps.*weights do not reach"):
        watch.check(10, 0.2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.check(11, 0.2, 0)  # once
    assert SamplerWatch("bfloat16").bound == 0.5
