"""Data parallel with 2 real processes (torchrun, gloo): loss-scale invariance and a training run."""

import glob
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from tests.conftest import FAST, ROOT, measured, server_scratch

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def run(cmd, env: dict[str, str] | None = None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, **kw)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def updated_weights(out, n_procs: int, n_micro: int, strategy: str, *extra: str) -> dict[str, dict]:
    out.mkdir()
    launch = [sys.executable] if n_procs == 1 else [*TORCHRUN, "--standalone", "--nproc_per_node", str(n_procs)]
    run([*launch, "tests/ddp_step.py", str(out), str(n_micro), strategy, *extra])
    return {lt: torch.load(out / f"{lt}.pt", weights_only=True) for lt in LOSS_TYPES}


def logged_losses(out) -> dict[str, float]:
    """The loss each loss type's step logged (grpo.metrics.reduce_metrics over the ranks)."""
    return {lt: json.load(open(out / f"{lt}_loss.json"))[0] for lt in LOSS_TYPES}


def logged_metrics(out) -> dict[str, dict]:
    """Every number each loss type's update logged (grpo.metrics.reduce_metrics over the ranks)."""
    return {lt: json.load(open(out / f"{lt}_metrics.json")) for lt in LOSS_TYPES}


# the update's ratios and statistics, which must be the whole batch's whatever the ranks hold
BATCH_METRICS = ("clip_frac", "kl", "entropy", "sampler_diff", "sampler_diff_mean", "sampler_kl")


def assert_same_metrics(one: dict, two: dict, keys=BATCH_METRICS) -> None:
    for lt in LOSS_TYPES:
        for key in keys:
            assert two[lt][key] == pytest.approx(one[lt][key], rel=1e-4, abs=1e-6), (lt, key, one[lt][key], two[lt][key])


def initial_weights() -> dict:
    from grpo.config import TinyModelConfig
    from grpo.tiny.text import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    return build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id).state_dict()


def assert_same_update(a: dict, b: dict, init: dict, label: str) -> None:
    for loss_type in LOSS_TYPES:
        update = max((a[loss_type][k] - init[k]).abs().max().item() for k in init)
        diff = max((a[loss_type][k] - b[loss_type][k]).abs().max().item() for k in init)
        print(f"{label} {loss_type}: largest update {update:.3g}, max difference {diff:.2e}")
        assert update > 1e-3, loss_type  # the steps did move the weights
        assert diff < 1e-5 * max(update, 1.0), (label, loss_type, diff, update)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@pytest.mark.starts_process
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_one_process_four_micro_equals_two_processes_two_micro(tmp_path, strategy):
    """Same global batch, same two optimizer steps (num_iterations=2, KL on): 1 process x 4
    micro-batches vs. 2 processes x 2 micro-batches give the same weights for every loss type.
    DeepSpeed's strategies run as one process too; DDP's one-process reference is parallel=single. And
    one more step that clips (algo.max_grad_norm=0.05, the norm is about 5): the norm is the summed
    gradient's, so the same weights and logged grad_norm (clipping each rank's half before the all-reduce
    would not be: both differ)."""
    one = updated_weights(tmp_path / "one", 1, 4, "single" if strategy == "ddp" else strategy, "clip")
    two = updated_weights(tmp_path / "two", 2, 2, strategy, "clip")
    init = initial_weights()
    assert_same_update(one, two, init, f"{strategy} 1x4 vs 2x2")
    # each rank's loss is its share of the one global loss: the run logs their sum, the one process's
    # (averaged over ranks, 2 ranks logged half of it)
    assert logged_losses(tmp_path / "two") == pytest.approx(logged_losses(tmp_path / "one"), rel=1e-5, abs=1e-7)
    clipped = [torch.load(tmp_path / out / "grpo_clipped.pt", weights_only=True) for out in ("one", "two")]
    norms = [json.load(open(tmp_path / out / "grpo_clipped_metrics.json"))["grad_norm"] for out in ("one", "two")]
    assert norms[0] > 1.0 and norms[1] == pytest.approx(norms[0], rel=1e-4), f"clipped step's grad_norm 1x4 vs 2x2: {norms}"
    update = max((clipped[0][k] - init[k]).abs().max().item() for k in init)
    diff = max((clipped[0][k] - clipped[1][k]).abs().max().item() for k in init)
    assert update > 1e-3 and diff < 1e-5 * max(update, 1.0), f"clipped step 1x4 vs 2x2: max difference {diff:.2e}, largest update {update:.3g}"


@pytest.mark.starts_process
# slow: packed (the same uneven micro-batch counts; shared stays the default tier's)
@pytest.mark.parametrize("layout", [pytest.param("packed", marks=pytest.mark.slow), "shared"])
def test_zero3_ranks_with_different_micro_batch_counts(tmp_path, layout):
    """Rank 0 holds 3 groups, rank 1 one: rank 1 pads with zero-weight micro-batches so ZeRO-3's
    gathers and reductions line up, and the update still equals one process's over all rows. The
    ranks' micro-batches are packed (algo.packing; shared: each prompt once per tree of its group's
    completions, algo.shared_prompt), the one process's padded: they equal padded under ZeRO-3's
    lockstep too. The ranks' LM head runs on pieces of 3 tokens (`pieces`): under ZeRO-3 each piece
    gathers the head's weight, so every rank makes as many calls as the micro-batch cap asks, not as
    its own tokens would (rank 1's padding micro-batches have none), and each piece is recomputed in
    backward, the weight gathered again (`partitioned`: the tiny head is not kept whole)."""
    one = updated_weights(tmp_path / "one", 1, 4, "single", "padded", "grouped")
    two = updated_weights(tmp_path / "two", 2, 2, "zero3", "uneven", layout, "grouped", "pieces", "partitioned")
    counts = json.load(open(tmp_path / "two" / "micro_batches.json"))
    assert counts[0] > counts[1], counts  # rank 1 padded its count in lockstep
    pieces = [json.load(open(tmp_path / "two" / f"pieces_rank{rank}.json")) for rank in (0, 1)]
    assert pieces[0] == pieces[1] and max(pieces[0]) > 1, pieces  # the same gathers, in more than one piece
    recomputed = [json.load(open(tmp_path / "two" / f"recomputed_rank{rank}.json")) for rank in (0, 1)]
    assert recomputed[0] == recomputed[1] > 0, recomputed  # the pieces were recomputed, alike on both ranks
    for rank in (0, 1):  # the layout really ran on both ranks (a shared fallback would pack: the same numbers)
        ran = json.load(open(tmp_path / "two" / f"layouts_rank{rank}.json"))
        assert ran.get(layout, 0) > 0 and (layout == "packed" or "packed" not in ran), (rank, ran)
    assert_same_update(one, two, initial_weights(), f"zero3 uneven {layout} 2x vs single padded")
    # the logged ratios are the batch's: rank 0's 3 groups and rank 1's one, summed before dividing
    assert_same_metrics(logged_metrics(tmp_path / "one"), logged_metrics(tmp_path / "two"))


@pytest.mark.starts_process
@pytest.mark.parametrize("head", [pytest.param("untied", marks=pytest.mark.slow), "lora"])  # tied: the test above
def test_zero3_head_pieces_with_a_head_of_its_own_or_frozen(tmp_path, head):
    """The LM head on pieces of 3 tokens under ZeRO-3, its weight partitioned: an untied head (its own
    weight, trained) is recomputed in backward, a frozen one (LoRA: only the adapter trains) is not
    (checkpoint would read its released placeholder): its pieces gather the weight once and take their
    gradient in the forward (grpo/update/frozen_head.py); both updates equal one process's, whose
    frozen head runs through autograd. The frozen head once more under DeepSpeed's default persistence
    threshold, which keeps the tiny head whole: no piece that found it whole leaves it partitioned
    (GatheredParameters re-partitions whatever it is given, and every later piece gathered it again)."""
    one = updated_weights(tmp_path / "one", 1, 4, "single", head, "autograd_head")
    two = updated_weights(tmp_path / "two", 2, 2, "zero3", head, "pieces", "partitioned")
    recomputed, frozen = ([json.load(open(tmp_path / "two" / f"{what}_rank{rank}.json")) for rank in (0, 1)]
                          for what in ("recomputed", "frozen"))
    pieces, other = (frozen, recomputed) if head == "lora" else (recomputed, frozen)
    assert pieces[0] == pieces[1] > 0 and other == [0, 0], (recomputed, frozen)
    init = torch.load(tmp_path / "one" / ("grpo_init.pt" if head == "lora" else "init.pt"), weights_only=True)
    assert_same_update(one, two, init, f"zero3 {head} head in pieces vs single")
    if head == "lora":
        whole = updated_weights(tmp_path / "whole", 2, 2, "zero3", head, "pieces")
        counts = [json.load(open(tmp_path / "whole" / f"{what}_rank0.json")) for what in ("frozen", "released")]
        assert counts[0] > 0 and counts[1] == 0, counts
        assert_same_update(one, whole, init, "zero3 lora head kept whole vs single")


@pytest.mark.starts_process
def test_a_rank_with_no_rows_logs_the_batchs_metrics_and_routing(tmp_path):
    """Rank 1 holds nothing (its groups all dropped, say): the logged statistics are still the whole
    batch's (a rank's 0 averaged in halved them), and under routing replay both ranks log
    routing/flip_fraction (one rank without it made the metrics' all-reduce mismatch and abort)."""
    one = updated_weights(tmp_path / "one", 1, 4, "single", "moe")
    two = updated_weights(tmp_path / "two", 2, 2, "ddp", "moe", "empty")
    init = torch.load(tmp_path / "one" / "init.pt", weights_only=True)
    assert_same_update(one, two, init, "ddp, rank 1 empty, vs single")
    assert_same_metrics(logged_metrics(tmp_path / "one"), logged_metrics(tmp_path / "two"),
                        (*BATCH_METRICS, "routing/flip_fraction", "moe/expert_load_max", "moe/routing_entropy"))
    # the episode/turns_max, async/staleness_max ... of the ranks: the largest (averaged, 4 and 1 logged 2.5)
    # over the 6 rewards [0, 0, 1, 1, 1, 0]: mean 1/2, std sqrt(1.5 / 5) (the ranks' means averaged: 3/8, their
    # stds 0.25; a rank that scored nothing made reward/f NaN; the judge's 3 failures read 1.5)
    probe = json.load(open(tmp_path / "two" / "reduce_probe.json"))
    assert probe == {"probe_max": 1.0, "probe": 0.5, "reward/mean": 0.5, "reward/std": pytest.approx((1.5 / 5) ** 0.5),
                     "judge/failed": 3.0, "reward/f": 0.5}


@pytest.mark.starts_process
def test_two_process_training_run(tmp_path, cache_dir):
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST,
           "parallel=ddp", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}", "checkpoint_every=2"]
    out = run(cmd)
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]  # rank 0 alone writes the log
    assert sorted(os.listdir(tmp_path / "checkpoints" / "step_00000003")) == [
        "COMPLETE", "grpo_layout.json", "state_rank0.pt", "state_rank1.pt", "trainer.pt"]
    assert out.stdout.count("eval accuracy") == 1


@pytest.mark.starts_process
def test_dynamic_sampling_keeps_two_zero3_ranks_in_step(tmp_path, cache_dir):
    """algo.dynamic_sampling across 2 ZeRO-3 ranks (rollout=hf: every generate is a collective): the
    ranks draw as many batches as the rank short of most informative groups, so none waits on a
    collective the other never joins; the steps end, with more than one batch drawn in some."""
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, "parallel=zero3",
           "algo.dynamic_sampling=true", "algo.max_draws=3", "algo.zero_std_groups=drop", "eval_every=0",
           "export_model=false", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    run(cmd)
    trained = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert any(r["dynamic/draws"] > 1 for r in trained), trained  # the tiny policy leaves flat groups
    assert all(r["dynamic/draws"] <= 3 for r in trained)


@pytest.mark.starts_process
def test_two_processes_share_one_tensor_parallel_colocated_engine(tmp_path, cache_dir):
    """parallel=ddp rollout=colocated with tensor_parallel_size=2: vLLM's external_launcher across
    both ranks (gloo), prompts pooled every turn, each rank training on its own completions. Multi-turn
    episodes that end at turn 1 on rank 0 and go on to turn 4 on rank 1 (tests/test_episodes.py
    RankTurns): rank 0 joins rank 1's later turns, since the pooled generate is a collective."""
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, "parallel=ddp",
           "rollout=colocated", "rollout.vllm.tensor_parallel_size=2",
           "experiment=guess_tiny", "env.name=tests.test_episodes.RankTurns", "eval_every=0", "checkpoint_every=0",
           "rollout.max_new_tokens=2", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}",
           "algo.zero_std_groups=keep"]  # RankTurns' groups are all flat: kept, their tokens are scored after each sync
    with server_scratch() as scratch:  # the run's TMPDIR: what it leaves there is seen, and removed after
        run(cmd, env=scratch)
        # the engine's broadcast queue bound 2 ZMQ sockets; in a folder of its own, removed at close (2 left before)
        left = glob.glob(os.path.join(scratch["TMPDIR"], "**"), recursive=True)
        assert [f for f in left if stat.S_ISSOCK(os.stat(f).st_mode)] == []
        assert glob.glob(os.path.join(scratch["TMPDIR"], "grpo-rpc-*")) == []
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    trained = [r for r in rows if "loss" in r]
    assert [r["weight_version"] for r in trained] == [0, 1, 2]
    assert all(d < 1e-3 for d in measured(trained))
    assert all(r["completion_len"] > 0 and r["episode/turns_max"] > 1 for r in trained)


@pytest.mark.starts_process
def test_tensor_parallel_colocated_parity(tmp_path):
    from tests.parity import assert_round_trip

    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "tests/tp_parity.py", str(tmp_path)])
    for rank in (0, 1):
        assert_round_trip(json.load(open(tmp_path / f"rank{rank}.json")), f"colocated tp=2 rank {rank}")


def test_bf16_training_keeps_fp32_master_weights(tiny_lm):
    """model.dtype=bfloat16 under single/ddp: forward in bf16, AdamW on fp32 master weights. AdamW on
    the bf16 weights themselves loses updates below bf16's spacing (~8e-5 near 0.02): 100 steps at
    lr 1e-6 (about 1e-6 each) leave them unchanged; kept in fp32 they add up to ~1e-4 and show."""
    import copy

    import torch
    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig, ParallelConfig
    from grpo.parallel.single import SingleStrategy

    model, _ = tiny_lm
    algo = OmegaConf.structured(AlgoConfig(lr=1e-6, warmup_steps=0, lr_schedule="constant", max_grad_norm=1e9))
    ids = torch.tensor([[1, 5, 6, 7, 8, 2]])

    def train_100(forward, params, step) -> float:
        """The fraction of weights of size >= 0.02 whose bf16 value changed in 100 steps."""
        start = {n: p.detach().to(torch.bfloat16).clone() for n, p in params()}
        for _ in range(100):
            logits = forward(input_ids=ids).logits
            assert logits.dtype == torch.bfloat16  # the compute runs in bf16 either way
            logits.float().logsumexp(-1).mean().backward()
            step()
        changed = total = 0
        for n, p in params():
            big = start[n].float().abs() >= 0.02
            changed += int((p.detach().to(torch.bfloat16) != start[n])[big].sum())
            total += int(big.sum())
        return changed / total

    s = SingleStrategy(OmegaConf.structured(ParallelConfig(strategy="single")), copy.deepcopy(model).to(torch.bfloat16), algo, 100)
    assert next(s.model.parameters()).dtype == torch.float32  # the master copy
    moved = train_100(s.forward_model, s.model.named_parameters, s.step)

    naive = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(naive.parameters(), lr=1e-6, weight_decay=0.0)

    def naive_step():
        opt.step()
        opt.zero_grad()

    moved_naive = train_100(naive, naive.named_parameters, naive_step)
    print(f"bf16 weights changed after 100 steps: {moved:.2f} with fp32 master weights, {moved_naive:.2f} without")
    assert moved > 0.5 and moved_naive < 0.1


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero2", "zero3"])
@pytest.mark.parametrize("override, message", [
    ("parallel.check_ranks_every=-1", "parallel.check_ranks_every=-1 must be >= 0 (steps between the ranks' weight "
                                      "comparisons; 0: never)."),
    ("parallel.sync_bucket_mb=0", "parallel.sync_bucket_mb=0 must be > 0 (MB of weights sent to the engines per bucket; "
                                  "the default is 64)."),
])
def test_every_strategy_refuses_a_negative_rank_check_and_an_empty_sync_bucket(strategy, override, message):
    from grpo.config import validate
    from grpo.errors import ConfigError
    from tests.conftest import compose_cfg

    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(f"parallel={strategy}", override), world_size=1 if strategy == "single" else 2)
    assert str(e.value) == message
    validate(compose_cfg(f"parallel={strategy}", "parallel.check_ranks_every=0", "parallel.sync_bucket_mb=0.5"),
             world_size=1 if strategy == "single" else 2)  # 0: never compare; half a MB per bucket


def test_ddp_gradient_buckets_cover_every_parameter_once_by_dtype():
    from grpo.parallel.ddp import gradient_buckets

    params = [torch.nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
              [(100, torch.float32), (50, torch.float32), (300, torch.float32), (10, torch.bfloat16), (20, torch.float32)]]
    buckets = gradient_buckets(params, bucket_bytes=600)  # 150 fp32 numbers
    # fp32: [100, 50] = 600 bytes, [300] alone (larger than a bucket), [20]; bf16: [10]
    assert [[p.numel() for p in b] for b in buckets] == [[100, 50], [300], [20], [10]]
    assert all(len({p.dtype for p in b}) == 1 for b in buckets)


def test_adamw_runs_fused_where_torch_has_the_kernel_and_steps_as_foreach_does():
    """torch's fused AdamW (one pass per parameter; 5x faster than foreach on SmolLM2 on 2 CPU cores)
    for floating-point parameters on CPU or CUDA; the same update as foreach to float rounding."""
    from grpo.parallel.base import fused_adamw

    assert fused_adamw([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    assert not fused_adamw([torch.zeros(2, device="meta")]) and not fused_adamw([])
    torch.manual_seed(0)
    params = {name: [torch.nn.Parameter(torch.randn(300)) for _ in range(3)] for name in ("fused", "foreach")}
    params["foreach"] = [torch.nn.Parameter(p.detach().clone()) for p in params["fused"]]
    opts = {name: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=name == "fused") for name, ps in params.items()}
    for _ in range(5):
        grads = [torch.randn(300) for _ in range(3)]
        for name, ps in params.items():
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opts[name].step()
    for a, b in zip(params["fused"], params["foreach"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.base import build_optimizer

    opt, _ = build_optimizer(torch.nn.Linear(3, 3), OmegaConf.structured(AlgoConfig()), total_steps=2)
    assert opt.param_groups[0]["fused"]  # what every strategy builds
