"""The step guards on real ranks (test_guards.py): a NaN planted in rank 1's gradient skips the step on
every rank; a weight changed on rank 1 alone is caught by the rank check, on every rank.

    torchrun --nproc_per_node 2 tests/guard_step.py OUT STRATEGY DTYPE    # ddp, zero2 or zero3; float32 or bfloat16
    torchrun --nproc_per_node 2 tests/guard_step.py OUT train CACHE       # through grpo.train's loop (ddp)

Writes OUT/rank<r>.json: the planted step's norm, whether any weight moved at it, whether the clean
step after it moved them and left them finite, and what the rank check said before and after the
planted divergence. With `train`: what ended the run on each rank, when rank 1 alone changes a weight
after step 1's update (the rank check is due at step 1).
"""

import json
import os
import sys

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo.train  # noqa: E402
from grpo.config import AlgoConfig, ParallelConfig, TinyModelConfig  # noqa: E402
from grpo.dist import dist_info, init_distributed, shutdown  # noqa: E402
from grpo.guards import RankCheck, RanksDiverged  # noqa: E402
from grpo.tiny.text import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpo.parallel import strategy_class  # noqa: E402
from tests.conftest import FAST, compose_cfg  # noqa: E402
from tests.ddp_step import exit_process  # noqa: E402


def full_weights(strategy) -> dict:
    return {n: t.float().clone() for bucket in strategy.weight_buckets(2**20) for n, t in bucket}  # gathered under ZeRO-3


def main(out: str, name: str, dtype: str) -> None:
    info = dist_info()
    init_distributed(info)
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    algo = OmegaConf.structured(AlgoConfig(lr=1e-2, warmup_steps=0, lr_schedule="constant"))
    parallel = OmegaConf.structured(ParallelConfig(strategy=name))
    model = model.to(getattr(torch, dtype))  # as build_policy loads it; ZeRO-3 partitions it in its engine
    strategy = strategy_class(name)(parallel, model, algo, total_steps=10)
    ids = torch.tensor([[1, 5, 6, 7 + info.rank]])

    def step(plant: bool) -> float:
        loss = strategy.forward_model(input_ids=ids).logits.float().logsumexp(-1).mean()
        if plant and info.rank == 1:  # one rank's gradient non-finite, as one bad micro-batch makes it
            loss = loss * float("nan")
        strategy.backward(loss)
        return strategy.step()

    before = full_weights(strategy)
    norm = step(plant=True)
    after_planted = full_weights(strategy)
    clean = step(plant=False)
    after_clean = full_weights(strategy)
    check = RankCheck(every=1, world=info.world_size)
    said = []
    # ZeRO-3 holds each weight once (gathered, every rank sees the same): nothing can diverge to plant
    for diverge in (False, True) if name != "zero3" else (False,):
        if diverge and info.rank == 1:  # rank 1 alone changes one weight: the ranks no longer agree
            with torch.no_grad():
                p = next(p for p in strategy.model.parameters() if p.numel() > 0)
                p.view(-1)[0] += 0.5
        try:
            check.check(2, strategy.weight_buckets(2**20))
            said.append("agree")
        except RanksDiverged as e:
            said.append(str(e))
    json.dump({
        "planted_norm": norm,
        "moved_at_planted": any(not torch.equal(before[k], after_planted[k]) for k in before),
        "clean_norm": clean,
        "moved_at_clean": any(not torch.equal(after_planted[k], after_clean[k]) for k in before),
        "finite": all(bool(torch.isfinite(t).all()) for t in after_clean.values()),
        "rank_check": said,
    }, open(os.path.join(out, f"rank{info.rank}.json"), "w"))
    shutdown()


def diverge_rank_1(update):
    """`policy_update`, after which rank 1 alone adds 0.5 to one weight: a step the other rank did not take."""

    def diverged(strategy, *args, **kwargs):
        stats = update(strategy, *args, **kwargs)
        if dist_info().rank == 1:
            with torch.no_grad():
                next(strategy.model.parameters()).view(-1)[0] += 0.5
        return stats

    return diverged


def train_main(out: str, cache: str) -> None:
    """Two ddp ranks through `grpo.train.train`, rank 1 diverging at step 1: what stopped each rank."""
    grpo.train.policy_update = diverge_rank_1(grpo.train.policy_update)
    cfg = compose_cfg(*FAST, "parallel=ddp", "task.eval_size=8", "export_model=false", run_dir=os.path.join(out, "run"),
                      cache=cache)
    try:
        grpo.train.train(cfg)
        said = "finished"
    except RanksDiverged as e:
        said = str(e)
    json.dump({"said": said}, open(os.path.join(out, f"rank{dist_info().rank}.json"), "w"))


if __name__ == "__main__":
    if sys.argv[2] == "train":
        train_main(sys.argv[1], sys.argv[3])
    else:
        main(*sys.argv[1:4])
    exit_process(0)
