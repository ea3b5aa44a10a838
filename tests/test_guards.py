"""The step guard (grpo/guards.py): a planted non-finite gradient is skipped and counted; a run of
them stops with what to try."""

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import AlgoConfig
from grpo.guards import NonFiniteSteps, StepGuard
from grpo.parallel.single import SingleStrategy


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
