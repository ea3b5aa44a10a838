"""Ulysses sequence parallelism (parallel.sequence_parallel, grpo/parallel/sequence.py): the plain
decisions, the whole-row layouts against the unsplit forward, and real multi-process updates (torchrun,
gloo, DeepSpeed's all-to-all) equal to one process's, weights and loss, under every strategy."""

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from grpo.errors import ConfigError
from grpo.parallel import sequence
from grpo.update.layouts import split_multiple
from tests.conftest import FAST, compose_cfg, measured
from tests.test_parallel import (LOSS_TYPES, TORCHRUN, assert_same_metrics, assert_same_update, initial_weights,
                                 logged_metrics, run, updated_weights)


def test_groups_are_consecutive_ranks():
    assert sequence.sequence_groups(4, 2) == [[0, 1], [2, 3]]
    assert sequence.sequence_groups(4, 4) == [[0, 1, 2, 3]]
    assert sequence.sequence_groups(2, 1) == [[0], [1]]
    with pytest.raises(ValueError):
        sequence.sequence_groups(6, 4)


def test_columns_split_a_row_evenly():
    assert [sequence.columns(12, 3, r) for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    with pytest.raises(ValueError):
        sequence.columns(10, 4, 0)
    assert split_multiple("cpu", 4) == 4 and split_multiple("cpu", 1) == 1 and split_multiple("cuda", 1) == 128
    assert split_multiple("cuda", 2) == 128 and split_multiple("cuda", 3) == 384


def test_what_a_split_cannot_take_is_refused_with_what_to_change():
    sequence.check_size(1, "single", 1)
    sequence.check_size(2, "zero3", 4)
    with pytest.raises(ConfigError, match="parallel=single has one"):
        sequence.check_size(2, "single", 1)
    with pytest.raises(ConfigError, match="multiple of 2"):
        sequence.check_size(2, "zero2", 3)
    with pytest.raises(ConfigError, match=">= 1"):
        sequence.check_size(0, "ddp", 2)
    sequence.check_heads(2, 4, 4)
    sequence.check_heads(4, 8, 2)  # each rank a copy of one key/value head
    with pytest.raises(ConfigError, match="9 attention heads"):
        sequence.check_heads(2, 9, 3)  # SmolLM2-135M: 9 heads, 3 key/value heads
    with pytest.raises(ConfigError, match="3 key/value heads"):
        sequence.check_heads(2, 6, 3)
    with pytest.raises(ConfigError, match="the model has 2 attention heads, which 4 does not divide"):
        sequence.check_heads(4, 2, 2)  # 4 a multiple of the heads: half a head per rank


def test_validate_checks_the_tiny_models_heads_and_the_world():
    from grpo.config import validate

    cfg = compose_cfg("parallel=zero3", "parallel.sequence_parallel=3", "algo.batch_size=48", "algo.group_size=4")
    with pytest.raises(ConfigError, match="4 attention heads"):
        validate(cfg, world_size=3)
    cfg.parallel.sequence_parallel = 2
    with pytest.raises(ConfigError, match="multiple of 2"):
        validate(cfg, world_size=3)
    validate(cfg, world_size=4)
    cfg.model.tiny.num_heads = 3  # the smallest split (2) is checked too
    with pytest.raises(ConfigError, match="the model has 3 attention heads, which 2 does not divide"):
        validate(cfg, world_size=4)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_whole_rows_and_their_masks_give_the_unsplit_logprobs(tiny_lm, layout):
    """What every rank of a group builds before taking its columns: the micro-batch's rows, widened
    to a multiple of S, with the whole row's mask (grpo/update/layouts.py `rows` with split_size=S).
    Run unsplit with that mask, the logprobs at `hidden_at` equal the micro-batch's in its own layout
    (transformers' masks for padded and packed rows, the tree mask for shared)."""
    from grpo.update.forward import batch_logprobs, token_logprobs
    from grpo.update.layouts import MicroBatch, causal_mask, plan, rows
    from tests.test_gradient_invariance import make_batch

    model, tok = tiny_lm
    batch = make_batch(tok, B=8, group=2)
    assert plan(model, batch, layout, 10**6).layout == layout  # the model runs it (a shared prompt needs a probe first)
    # several sequences (packed) and trees of two completions (shared) per row, which the planner's rows,
    # as wide as the longest sequence, rarely hold on so small a batch
    mb = MicroBatch(batch, layout, {"padded": None, "packed": [3, 3, 2], "shared": [[2, 2], [2, 2]]}[layout])
    with torch.no_grad():
        want_BT = batch_logprobs(model, mb, temperature=1.0)[0]
        whole = rows(model, mb, split_size=4)
        assert whole.input_ids_RW.shape[1] % 4 == 0
        logits_RWV = model(input_ids=whole.input_ids_RW, position_ids=whole.position_ids_RW,
                           attention_mask=whole.mask, use_cache=False).logits
        logp_N = token_logprobs(logits_RWV[whole.hidden_at][None], whole.tokens_N[None], 1.0)[0]
    got_BT = torch.zeros_like(want_BT).index_put(whole.token_at, logp_N)
    assert ((got_BT - want_BT).abs() * batch.mask_BT).max() < 1e-5
    # a causal mask alone (the packed rows' sequences seeing each other) is not the layout's
    if layout != "padded":
        with torch.no_grad():
            wrong = model(input_ids=whole.input_ids_RW, position_ids=whole.position_ids_RW, use_cache=False,
                          attention_mask=causal_mask(torch.ones_like(whole.input_ids_RW, dtype=torch.bool))).logits
        wrong_N = token_logprobs(wrong[whole.hidden_at][None], whole.tokens_N[None], 1.0)[0]
        assert (wrong_N - logp_N).abs().max() > 1e-3


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process's updates (parallel=single, 4 micro-batches): packed (completions of up to 16 tokens:
    on 2 ranks some packed rows hold two sequences); padded with groups of 2 (the shared layout's
    reference); packed with a LoRA adapter."""
    root = tmp_path_factory.mktemp("single")
    return {name: updated_weights(root / name, 1, 4, "single", *flags) | {"dir": root / name}
            for name, flags in (("packed", ("long",)), ("grouped", ("padded", "grouped")), ("lora", ("lora", "long")))}


def losses(folder) -> dict[str, float]:
    return {lt: json.load(open(folder / f"{lt}_loss.json"))[0] for lt in LOSS_TYPES}


@pytest.mark.parametrize("strategy,procs,layout", [
    ("zero3", 2, "packed"), ("zero2", 2, "shared"), ("zero3", 4, "shared"), ("zero2", 4, "packed"),
    ("ddp", 2, "padded"), ("zero2", 2, "lora")])
def test_split_rows_update_equals_one_process(tmp_path, references, strategy, procs, layout):
    """S = 2 on 2 ranks (one group) and on 4 (two groups, data parallel 2): the two optimizer steps
    (num_iterations=2: old logprobs scored split too; KL on: the reference scored split) give one
    process's weights (gradients: SGD at lr 1) and loss, for every loss type, to 1e-5."""
    flags = {"packed": ("long",), "shared": ("shared",), "padded": ("padded", "grouped"), "lora": ("lora", "long")}[layout]
    ref = references[{"packed": "packed", "shared": "grouped", "padded": "grouped", "lora": "lora"}[layout]]
    got = updated_weights(tmp_path / "split", procs, 1, strategy, "sp2", *flags)
    if layout == "lora":
        for lt in LOSS_TYPES:
            init = torch.load(ref["dir"] / f"{lt}_init.pt", weights_only=True)
            update = max((ref[lt][k] - init[k]).abs().max().item() for k in init)
            diff = max((ref[lt][k] - got[lt][k]).abs().max().item() for k in init)
            assert update > 1e-3 and diff < 1e-5 * max(update, 1.0), (lt, update, diff)
    else:
        assert_same_update(ref, got, initial_weights(), f"{strategy} x{procs} S=2 {layout}")
    for lt, value in losses(tmp_path / "split").items():
        assert value == pytest.approx(losses(ref["dir"])[lt], abs=1e-5, rel=1e-5), lt
    # the split ran on every rank: without it (sequence_parallel ignored) the ranks share the rows out as
    # data parallel, and the weights above still equal one process's
    for rank in range(procs):
        assert json.load(open(tmp_path / "split" / f"layouts_rank{rank}.json")).get("attention_split", 0) > 0, rank


@pytest.mark.starts_process
def test_split_rows_replay_each_ranks_own_routes(tmp_path):
    """A MoE policy with the sampler's routes (rollout.routing_replay, issue 50): each rank of a split
    group runs its own columns' tokens through the MoE layers, so it replays those columns' routes.
    The tiny Qwen3-MoE, random routes (not its own choice), zero3 with S = 2 on 2 ranks: one process's
    weights and loss, for every loss type (measured: largest update 0.65-1.6, max difference 5e-7 to
    4.7e-6). Every rank replaying the first columns' routes instead: 0.72 off. The logged routing
    (routing/flip_fraction, the expert load) counts every rank's columns: one process's (the owner's
    columns alone logged a flip fraction of the first ~2/3 of the tokens)."""
    one = updated_weights(tmp_path / "one", 1, 1, "single", "moe", "long") | {"dir": tmp_path / "one"}
    got = updated_weights(tmp_path / "split", 2, 1, "zero3", "sp2", "moe", "long")
    assert_same_update(one, got, torch.load(tmp_path / "one" / "init.pt", weights_only=True), "zero3 x2 S=2 moe")
    for lt, value in losses(tmp_path / "split").items():
        assert value == pytest.approx(losses(tmp_path / "one")[lt], abs=1e-5, rel=1e-5), lt
    assert_same_metrics(logged_metrics(tmp_path / "one"), logged_metrics(tmp_path / "split"),
                        ("routing/flip_fraction", "moe/expert_load_max", "moe/routing_entropy"))
    for rank in range(2):
        assert json.load(open(tmp_path / "split" / f"layouts_rank{rank}.json")).get("attention_split", 0) > 0, rank


@pytest.mark.starts_process
# slow: zero2 and ddp runs (their split updates equal one process's: test_split_rows_update_equals_one_process)
@pytest.mark.parametrize("strategy,extra", [("zero3", []), pytest.param("zero2", ["model.gradient_checkpointing=true"], marks=pytest.mark.slow),
                                            pytest.param("ddp", [], marks=pytest.mark.slow)])
def test_two_process_training_run_with_split_rows(tmp_path, cache_dir, strategy, extra):
    """`torchrun --nproc_per_node 2 -m grpo.train parallel=zero3 parallel.sequence_parallel=2` on the
    default task (and zero2, with checkpointed layers recomputed in the backward, still split; and
    ddp): 2 steps, and the sampler-trainer parity holds (the split scores what the sampler sampled)."""
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, "steps=2",
           f"parallel={strategy}", "parallel.sequence_parallel=2", *extra, f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    run(cmd)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    assert all(d < 1e-3 for d in measured(steps)), [r["sampler_diff"] for r in steps]


# run by torchrun in place of `-m grpo.verify`: the split attention gets no whole-row mask (each
# sequence of a packed or shared row then attends to the others, a left-padded row to its padding)
MASK_DROPPED = """
import sys

from grpo.parallel import sequence
from grpo.verify import main

real = sequence.active
sequence.active = lambda split, mask_R1WW: real(split, None)
main(sys.argv[1:])
"""


def verify_rows(stdout: str) -> dict[str, str]:
    """grpo.verify's table, row by row (not its closing "FAIL: ..." line)."""
    return {line[6:21].strip(): line[:4] for line in stdout.splitlines()
            if line[:4] in ("PASS", "FAIL", "SKIP") and line[4:6] == "  "}


@pytest.mark.starts_process
def test_verify_checks_the_split_on_two_processes(cache_dir):
    """grpo.verify under S = 2: its `split` row compares split rows with unsplit ones on the run's own
    batch, and the sampler and sync rows score through the split."""
    out = run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.verify", *FAST,
               "parallel=zero3", "parallel.sequence_parallel=2", f"model.cache_dir={cache_dir}"])
    status = verify_rows(out.stdout)
    assert status.get("split") == "PASS" and status.get("sampler") == "PASS" and status.get("sync") == "PASS", out.stdout


@pytest.mark.starts_process
def test_verify_names_a_split_without_its_whole_row_mask(tmp_path, cache_dir):
    """The same run with the whole-row mask dropped from the split attention: split, sampler and sync
    fail (the unsplit forward, the layouts and the reference keep theirs and pass)."""
    script = tmp_path / "mask_dropped.py"
    script.write_text(MASK_DROPPED)
    out = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", str(script), *FAST, "parallel=zero3",
                          "parallel.sequence_parallel=2", f"model.cache_dir={cache_dir}"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    status = verify_rows(out.stdout)
    assert out.returncode == 1 and {k for k, v in status.items() if v == "FAIL"} == {"split", "sampler", "sync"}, (
        out.stdout + out.stderr[-3000:])


def test_a_row_of_one_sequence_attends_with_no_mask_at_all(tiny_lm):
    """One sequence per row and no left padding (the long-sequence row) is plain causal: no W x W
    mask is built and SDPA runs causal; two packed sequences or a left-padded prompt keep theirs."""
    from grpo.batch import Batch
    from grpo.update.layouts import MicroBatch, rows

    model = tiny_lm[0]

    ids = torch.tensor([[0, 5, 6, 7, 8], [4, 5, 6, 7, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    padded = Batch(ids, mask, pos, ids[:, 3:], torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2), prompt_width=3)
    assert rows(model, MicroBatch(padded, "padded"), 2).mask is not None  # row 0 is left-padded
    assert rows(model, MicroBatch(padded.select(slice(1, 2)), "padded"), 2).mask is None
    assert rows(model, MicroBatch(padded, "packed", [1, 1]), 4).mask is None
    two = rows(model, MicroBatch(padded, "packed", [2]), 4).mask[0, 0]
    assert not two[5, :4].any() and two[5, 4:6].all()  # the second sequence sees itself only


def split_worker(tmp_path, check: str, procs: int = 2) -> list[dict]:
    """tests/split_worker.py `check` on `procs` ranks (S = 2): each rank's JSON."""
    run([*TORCHRUN, "--standalone", "--nproc_per_node", str(procs), "tests/split_worker.py", check, str(tmp_path)])
    name = {"kv_heads": "kv_heads", "moe_routing": "moe"}[check]
    return [json.load(open(tmp_path / f"{name}_rank{r}.json")) for r in range(procs)]


@pytest.mark.starts_process
def test_a_split_with_fewer_key_value_heads_than_ranks_leaves_the_model_whole(tmp_path):
    """4 heads, 1 key/value head, S = 2 (each rank a copy of it): DeepSpeed's wrapper sets every
    attention's num_key_value_groups to the split's (2) and left it there, so the model's next unsplit
    forward failed on a shape (grpo.verify's split row, hf generation). After a split forward and a
    backward whose checkpointed layers recompute through the split (4 split attention calls: 2 layers,
    run and recomputed), the attentions hold 4 again and the unsplit logprobs are the ones before; the
    split's logprobs and the group's gradient are the unsplit ones."""
    for rank, got in enumerate(split_worker(tmp_path, "kv_heads")):
        assert got["before"] == got["after"] == [4, 4], (rank, got)
        assert got.get("error") is None and got["unsplit_diff"] == 0.0, (rank, got)
        assert got["split_calls"] == 4 and got["split_diff"] < 1e-5, (rank, got)
        assert got["grad_max"] > 1.0 and got["grad_diff"] < 1e-5 * got["grad_max"], (rank, got)


def column_aux_losses(model, batch, procs: int, layout: str, max_tokens: int) -> list[float]:
    """The load-balancing loss of each split rank's forward in a group of 2, computed without a split: each
    rank's micro-batches as whole rows (S = 2), run unsplit, their router logits cut at the columns. A
    token's router logits are its hidden state's, which the split attention leaves as they are."""
    from grpo import moe_model
    from grpo.update.layouts import plan, rows

    experts = moe_model.routed_experts(model)
    per = batch.size // procs
    out = []
    for r in range(procs):
        for mb in plan(model, batch.select(slice(r * per, (r + 1) * per)), layout, max_tokens).micro_batches:
            whole = rows(model, mb, split_size=2)
            assert whole.mask is None or layout == "packed"  # packed rows: block-causal from the position ids
            with torch.no_grad():
                logits = model(input_ids=whole.input_ids_RW, position_ids=whole.position_ids_RW, use_cache=False,
                               output_router_logits=True).router_logits
            R, W = whole.input_ids_RW.shape
            for cols in (slice(0, W // 2), slice(W // 2, W)):
                mine = [l.reshape(R, W, -1)[:, cols].reshape(-1, l.shape[-1]) for l in logits]
                out.append(moe_model.routing_of(mine, whole.real_RW[:, cols], experts).aux_loss.item())
    return out


@pytest.mark.starts_process
@pytest.mark.parametrize("procs", [2, 4])
def test_a_split_moe_update_logs_the_whole_batchs_routing(tmp_path, procs):
    """The tiny MoE's update under S = 2, on one group (2 ranks) and on two (4 ranks: data parallel 2),
    each rank a share of the batch. Each split rank's MoE layers route its own columns only; the logged
    expert load counted the micro-batch's owner's columns alone (496 of 776 token-layer assignments, the
    prompt-heavy first half): moe/expert_load_max 0.2722 against one process's 0.2758. Now it is one
    process's, to 1e-6, on every rank; moe/aux_loss is the mean over the split ranks' forwards of the
    loss each trained on (its own columns', docs/moe.md), worked out here without a split."""
    from grpo.config import AlgoConfig, ParallelConfig, TinyModelConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.tiny.moe import build_tiny_moe
    from grpo.tiny.text import build_char_tokenizer
    from grpo.update import policy_update
    from tests.test_gradient_invariance import make_batch

    tok = build_char_tokenizer()
    torch.manual_seed(0)  # the worker's model and batch
    model = build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    batch = make_batch(tok, B=8, group=2, T=16)
    want_aux = column_aux_losses(model, batch, procs, "packed", 10_000)
    algo = OmegaConf.structured(AlgoConfig(group_size=2, batch_size=8, lr=1e-6, warmup_steps=0, packing=True,
                                           shared_prompt=False, micro_batch_tokens=10_000, router_aux_loss_coef=0.01))
    one = policy_update(SingleStrategy(OmegaConf.structured(ParallelConfig(strategy="single")), model, algo, 10),
                        batch, algo, 16, 1.0)
    for rank, got in enumerate(split_worker(tmp_path, "moe_routing", procs)):
        for key in ("moe/expert_load_max", "moe/routing_entropy"):
            assert got[key] == pytest.approx(one[key], abs=1e-6), (rank, key, got[key], one[key])
        assert got["moe/aux_loss"] == pytest.approx(sum(want_aux) / len(want_aux), abs=1e-5), (rank, got, want_aux)
