"""Packed micro-batches (algo.packing, grpo/update/layouts.py), and packed with each prompt once per tree of
its completions (algo.shared_prompt): the same logprobs, gradients and metrics as the padded update,
to 1e-5 in fp32, on one process and with LoRA (ZeRO-3's lockstep: test_parallel.py); in bf16 within
the rounding measured in docs/algorithm.md.

A model that cannot share prompts falls back to packing, with the same numbers, so every equality
test here also asserts which layout really ran (`ran`: the forwards of each layout), and warnings are
errors in this file (a fallback warns)."""

import collections
import copy

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import AlgoConfig, ConfigError, LoraConfig
from grpo.update.layouts import first_fit_rows, pack, pack_shared, shared_plan
from grpo.parallel.single import SingleStrategy
from grpo.rollout.base import Rollouts
from grpo.update import accumulate_gradients, loss_norm, policy_update, score_tokens
from grpo.batch import collate
from grpo.update.forward import batch_logprobs
from grpo.update.layouts import MicroBatch, micro_batches, plan

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture
def ran(monkeypatch):
    """How many forwards ran packed and shared (grpo/update/layouts.py `rows` lays them out with pack, pack_shared)."""
    import grpo.update.layouts

    counts = collections.Counter()
    for name, layout in (("pack", "packed"), ("pack_shared", "shared")):
        real = getattr(grpo.update.layouts, name)
        monkeypatch.setattr(grpo.update.layouts, name, lambda *a, _real=real, _layout=layout, **k: (
            counts.update([_layout]), _real(*a, **k))[1])
    return counts


def assert_ran(ran, layout):
    """`layout` ran, and shared never fell back to packed."""
    assert ran[layout] > 0, dict(ran)
    if layout == "shared":
        assert ran["packed"] == 0, dict(ran)


def spread_batch(tok, B=8, seed=0, group=2):
    """Ragged prompts (2-9 tokens; each the prompt of `group` consecutive completions) and completions
    (0-14 tokens, one empty), advantages of both signs, and a loss mask with holes inside completions
    (what multi-turn observation tokens will be)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[tok.bos_token_id] + torch.randint(4, 20, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B // group)]
    prompts = [p for p in prompts for _ in range(group)]
    lengths = [0] + torch.randint(1, 15, (B - 1,), generator=g).tolist()
    comps = [torch.randint(4, 20, (n,), generator=g).tolist() for n in lengths]
    logps = [(-torch.rand(n, generator=g)).tolist() for n in lengths]
    batch = collate(prompts, Rollouts(comps, logps, ["stop"] * B, 0), torch.randn(B, generator=g), tok.pad_token_id, False)
    batch.mask_BT[1:, 2] = 0.0  # observation tokens: context, not loss
    return batch


def completion_tokens(batch):
    return torch.arange(batch.completion_ids_BT.shape[1])[None, :] < batch.attention_mask_BL[:, batch.prompt_width:].sum(1)[:, None]


def test_first_fit_rows_by_value():
    # lengths 5, 3, 4, 2, 1 into rows of 5, longest first: 5 | 4 (+1) | 3 (+2)
    assert first_fit_rows([5, 3, 4, 2, 1], 5) == [[0], [2, 4], [1, 3]]
    assert first_fit_rows([2, 2, 2], 10) == [[0, 1, 2]]
    assert first_fit_rows([], 4) == []


def test_padded_micro_batches_take_as_many_rows_as_the_cap_holds(tiny_lm):
    """Five sequences of 3 + 2 = 5 positions: a cap of 10 takes 2 rows a forward (2, 2, 1), never a
    third (15 positions); a cap below one row still takes one; rows rounded up to 8 take 2 of 16."""
    from grpo.update.layouts import micro_batch_plan

    _, tok = tiny_lm
    b = tok.bos_token_id
    batch = collate([[b, 5, 6]] * 5, Rollouts([[10, 11]] * 5, [[0.0] * 2] * 5, ["stop"] * 5, 0), torch.zeros(5),
                    tok.pad_token_id, False)
    assert batch.input_ids_BL.shape == (5, 5)
    assert micro_batch_plan(batch, 10, "padded") == [(slice(0, 2), None), (slice(2, 4), None), (slice(4, 6), None)]
    assert micro_batch_plan(batch, 14, "padded") == [(slice(0, 2), None), (slice(2, 4), None), (slice(4, 6), None)]
    assert micro_batch_plan(batch, 4, "padded") == [(slice(i, i + 1), None) for i in range(5)]
    assert micro_batch_plan(batch, 16, "padded", multiple=8) == micro_batch_plan(batch, 10, "padded")
    assert [mb.batch.size for mb in micro_batches(batch, 10)] == [2, 2, 1]


def test_pack_lays_sequences_end_to_end_by_value(tiny_lm):
    _, tok = tiny_lm
    b = tok.bos_token_id
    batch = collate([[b, 5, 6], [b, 7]], Rollouts([[10, 11], [12, 13, 14]], [[0.0] * 2, [0.0] * 3], ["stop"] * 2, 0),
                    torch.zeros(2), tok.pad_token_id, False)
    one_row = pack(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [2])
    assert one_row.input_ids_RW.tolist() == [[b, 5, 6, 10, 11, b, 7, 12, 13, 14]]
    assert one_row.position_ids_RW.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    # token t of a completion is predicted at prompt_len + t - 1 into its sequence: 2, 3 | 5 + 1, 2, 3
    assert one_row.hidden_at[1].tolist() == [2, 3, 6, 7, 8] and one_row.hidden_at[0].tolist() == [0] * 5
    assert [list(x) for x in zip(*(t.tolist() for t in one_row.token_at))] == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]
    two_rows = pack(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [1, 1])
    assert two_rows.input_ids_RW.tolist() == [[b, 5, 6, 10, 11], [b, 7, 12, 13, 14]]
    assert two_rows.hidden_at[0].tolist() == [0, 0, 1, 1, 1] and two_rows.hidden_at[1].tolist() == [2, 3, 1, 2, 3]


LAYOUTS = ["packed", "shared"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_tokens", [10_000, 40])  # one micro-batch; several, of several rows
def test_packed_logprobs_equal_the_padded_ones(tiny_lm, max_tokens, layout, ran):
    model, tok = tiny_lm
    batch = spread_batch(tok)
    mbs = micro_batches(batch, max_tokens, layout)
    rows = [mb.groups for mb in mbs]
    assert (len(mbs) > 1) == (max_tokens == 40) and any(len(r) > 1 for r in rows)
    if layout == "packed":
        assert any(n > 1 for r in rows for n in r)  # rows holding several sequences
    else:  # trees holding several completions of one prompt, and rows holding several trees
        assert any(n > 1 for r in rows for row in r for n in row) and any(len(row) > 1 for r in rows for row in r)
    real = completion_tokens(batch)
    padded = score_tokens(model, batch, 0.7, max_tokens)
    packed = score_tokens(model, batch, 0.7, max_tokens, layout=layout)
    torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=1e-5)
    assert (packed[~real] == 0).all()
    logp, ent = batch_logprobs(model, mbs[0], 0.7, with_entropy=True)
    ref_logp, ref_ent = batch_logprobs(model, replace_rows(mbs[0]), 0.7, with_entropy=True)
    real0 = completion_tokens(mbs[0].batch)
    torch.testing.assert_close(logp[real0], ref_logp[real0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[real0], ref_ent[real0], rtol=0, atol=1e-5)
    assert_ran(ran, layout)


def test_trees_of_two_completions_give_the_padded_logprobs(tiny_lm):
    """One row of three trees, each a prompt and two non-empty completions: every completion attends to
    its prompt and itself only (the tree mask), so each gets its padded logprobs; without the mask
    the second completion of a tree would attend to the first."""
    model, tok = tiny_lm
    batch = spread_batch(tok).select(slice(2, 8))  # 3 prompts x 2 completions, none empty
    assert (batch.mask_BT.sum(dim=1) > 0).all()
    assert plan(model, batch, "shared", 10_000).layout == "shared"  # the model shares (probed once)
    shared = MicroBatch(batch, "shared", [[2, 2, 2]])
    with torch.no_grad():
        logp, _ = batch_logprobs(model, shared, 0.7)
        ref, _ = batch_logprobs(model, replace_rows(shared), 0.7)
    real = completion_tokens(batch)
    torch.testing.assert_close(logp[real], ref[real], rtol=0, atol=1e-5)


def replace_rows(mb):
    """The micro-batch's sequences, padded."""
    return MicroBatch(mb.batch, "padded")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_logprobs_through_a_head_of_its_own(tiny_lm, layout, ran):
    """A model whose logits are not lm_head(hidden) takes its own logits, packed as well."""
    from tests.test_algorithm import ScaledHead

    model, tok = tiny_lm
    batch = spread_batch(tok)
    real = completion_tokens(batch)
    scaled = ScaledHead(model)
    torch.testing.assert_close(score_tokens(scaled, batch, 1.0, 10_000, layout=layout)[real],
                               score_tokens(scaled, batch, 1.0, 10_000)[real], rtol=0, atol=1e-5)
    assert_ran(ran, layout)


def algo_for(loss_type, layout, max_tokens):
    return OmegaConf.structured(AlgoConfig(loss_type=loss_type, beta=0.05, clip_eps=0.1, is_level="token",
                                           packing=layout != "padded", shared_prompt=layout == "shared",
                                           micro_batch_tokens=max_tokens))


def gradients(model, batch, algo, norm):
    stats, _ = accumulate_gradients(SingleStrategy(None, model, algo, total_steps=1), batch, algo, norm, temperature=1.0)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_packed_gradients_and_statistics_equal_the_padded_ones(tiny_lm, loss_type, layout, ran):
    """Off-policy old logprobs (some tokens clipped), a reference, importance weights: every
    gradient and every summed statistic of accumulate_gradients, packed against padded."""
    base, tok = tiny_lm
    batch = spread_batch(tok)
    noise = 0.3 * torch.randn(batch.completion_ids_BT.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs_BT = score_tokens(base, batch, 1.0, 10_000) + noise
    batch.ref_logprobs_BT = batch.old_logprobs_BT - 0.2
    norm = loss_norm(batch, max_len=14, gen_tokens_per_step=float(batch.mask_BT.sum()))
    padded, padded_stats = gradients(copy.deepcopy(base), batch, algo_for(loss_type, "padded", 60), norm)
    packed, packed_stats = gradients(copy.deepcopy(base), batch, algo_for(loss_type, layout, 60), norm)
    assert padded_stats["clipped_tokens"] > 0 and len(padded) > 10
    for k in padded_stats:
        torch.testing.assert_close(packed_stats[k], padded_stats[k], rtol=1e-5, atol=1e-6, msg=k)
    for n in padded:
        torch.testing.assert_close(packed[n], padded[n], rtol=0, atol=1e-5, msg=n)
    assert_ran(ran, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_policy_update_gives_the_same_metrics_and_weights(tiny_lm, monkeypatch, layout, ran):
    """Two passes of two optimizer steps (old logprobs scored packed), a reference: every metric, and
    the weights after SGD (AdamW's first steps would turn float noise in near-zero gradients into
    visible changes: tests/ddp_step.py)."""
    import grpo.parallel.single
    from tests.ddp_step import sgd

    monkeypatch.setattr(grpo.parallel.single, "build_optimizer", sgd)
    base, tok = tiny_lm
    batch = spread_batch(tok)
    runs = []
    for mode in ("padded", layout):
        model = copy.deepcopy(base)
        algo = OmegaConf.structured(AlgoConfig(group_size=2, batch_size=8, num_iterations=2, num_minibatches=2, beta=0.05,
                                               lr=1e-2, warmup_steps=0, packing=mode != "padded",
                                               shared_prompt=mode == "shared", micro_batch_tokens=60))
        stats = policy_update(SingleStrategy(None, model, algo, total_steps=4), batch, algo, 14, 1.0,
                              ref_model=copy.deepcopy(base).eval())
        runs.append((stats, model.state_dict()))
    (padded, w_padded), (packed, w_packed) = runs
    assert padded.keys() == packed.keys() and padded["kl"] > 0
    assert (padded.pop("layout"), packed.pop("layout")) == ("padded", layout)  # the layout that ran, named
    # the same work in every layout, the padding aside (grpo/flops.py): real tokens, the head's, causal
    # pairs; a shared tree holds each prompt once, so it computes fewer of each
    work_padded, work_packed = padded.pop("work"), packed.pop("work")
    for part in ("old", "reference", "train"):
        a, b = work_padded[part], work_packed[part]
        assert a.tokens > 0 and b.computed < a.computed and b.head == a.head, (part, a, b)
        if layout == "packed":
            assert (b.tokens, b.pairs) == (a.tokens, a.pairs) and b.tokens <= b.computed, (part, a, b)
        else:
            assert b.tokens < a.tokens and b.pairs < a.pairs, (part, a, b)
    for k in padded:
        assert packed[k] == pytest.approx(padded[k], rel=1e-4, abs=1e-6), k
    moved = max((w_padded[k] - base.state_dict()[k]).abs().max().item() for k in w_padded)
    assert moved > 1e-3 and max((w_packed[k] - w_padded[k]).abs().max().item() for k in w_padded) < 1e-5
    assert_ran(ran, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_packed_gradients_equal_the_padded_ones(tiny_lm, layout, ran):
    from grpo import lora

    model, tok = tiny_lm
    base = lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=8)))
    with torch.no_grad():
        for _, p in lora.adapter_parameters(base):
            p.normal_(0, 0.1)  # B starts at 0: nothing would reach A
    batch = spread_batch(tok)
    batch.ref_logprobs_BT = score_tokens(base, batch, 1.0, 10_000) - 0.2
    norm = loss_norm(batch, max_len=14, gen_tokens_per_step=1.0)
    padded, _ = gradients(copy.deepcopy(base), batch, algo_for("bnpo", "padded", 60), norm)
    packed, _ = gradients(copy.deepcopy(base), batch, algo_for("bnpo", layout, 60), norm)
    assert len(padded) == 2 * 7 * 2 and all(g.abs().sum() > 0 for g in padded.values())  # the adapter only
    for n in padded:
        torch.testing.assert_close(packed[n], padded[n], rtol=0, atol=1e-5, msg=n)
    assert_ran(ran, layout)


class NoPositions(torch.nn.Module):
    """A model that ignores the position ids it is given (as a class without packed-sequence support)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, position_ids=None, **kw):
        return self.inner(**kw)


def test_a_model_that_attends_across_sequences_is_refused(tiny_lm):
    model, tok = tiny_lm
    batch = spread_batch(tok)
    with pytest.raises(ConfigError, match="algo.packing=false"):
        score_tokens(NoPositions(model), batch, 1.0, 10_000, layout="packed")
    score_tokens(NoPositions(model), batch, 1.0, 10_000)  # padded: its own positions from the mask are fine


def test_shared_plan_by_value():
    # prompts a (3 tokens: sequences 0-2, completions 2, 1, 0) and b (2 tokens: 3-4, completions 4, 1)
    lengths, prompts, keys = [5, 4, 3, 6, 3], [3, 3, 3, 2, 2], ["a", "a", "a", "b", "b"]
    # width 6: a's three completions fit beside one prompt (3 + 2 + 1 + 0); b's 4 and 1 do not (2 + 4 + 1)
    assert shared_plan(lengths, prompts, keys, 6) == [[[0, 1, 2]], [[3]], [[4]]]
    # width 9: b's tree (2 + 4 + 1 = 7) comes first, a's (6) does not fit beside it
    assert shared_plan(lengths, prompts, keys, 9) == [[[3, 4]], [[0, 1, 2]]]
    assert shared_plan([], [], [], 4) == []


def test_pack_shared_lays_trees_by_value(tiny_lm):
    _, tok = tiny_lm
    b = tok.bos_token_id
    batch = collate([[b, 5, 6], [b, 5, 6], [b, 7]],
                    Rollouts([[10, 11], [12], [13, 14, 15]], [[0.0] * 2, [0.0], [0.0] * 3], ["stop"] * 3, 0),
                    torch.zeros(3), tok.pad_token_id, False)
    row = pack_shared(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [[2, 1]])
    assert row.input_ids_RW.tolist() == [[b, 5, 6, 10, 11, 12, b, 7, 13, 14, 15]]
    assert row.position_ids_RW.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]]  # 12 sits where 10 does
    # a completion's first token is predicted by its prompt's last position (2 for 10 and 12, 7 for 13)
    assert row.hidden_at[1].tolist() == [2, 3, 2, 7, 8, 9]
    assert [list(x) for x in zip(*(t.tolist() for t in row.token_at))] == [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]]
    attends = [torch.nonzero(m).flatten().tolist() for m in row.mask_R1WW[0, 0]]
    assert attends[4] == [0, 1, 2, 3, 4]  # 11: its prompt and 10
    assert attends[5] == [0, 1, 2, 5]  # 12: its prompt and itself, not the other completion
    assert attends[8] == [6, 7, 8]  # 13: the second tree's prompt only
    eager = pack_shared(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [[2, 1]], torch.float32)
    assert (eager.mask_R1WW == 0).equal(row.mask_R1WW) and eager.mask_R1WW.min() == torch.finfo(torch.float32).min
    padded = pack_shared(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [[2], [1]])
    assert padded.input_ids_RW.tolist() == [[b, 5, 6, 10, 11, 12], [b, 7, 13, 14, 15, tok.pad_token_id]]
    assert torch.nonzero(padded.mask_R1WW[1, 0, 5]).flatten().tolist() == [5]  # padding: itself, no empty softmax
    with pytest.raises(ValueError, match="another prompt"):
        pack_shared(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [[3]])


class NoMask(torch.nn.Module):
    """A model that drops the attention mask it is given (as one whose attention takes no 4D mask)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, attention_mask=None, **kw):
        return self.inner(**kw)


def test_a_model_that_ignores_the_mask_is_packed_without_sharing(tiny_lm):
    """Where shared prompts cannot hold (here: a 4D mask ignored), a warning, and the micro-batches
    packed without sharing: the padded update's logprobs still."""
    model, tok = tiny_lm
    batch = spread_batch(tok)
    real = completion_tokens(batch)
    with pytest.warns(UserWarning, match="ignores a 4D mask.*without sharing"):
        unshared = score_tokens(NoMask(model), batch, 1.0, 40, layout="shared")
    torch.testing.assert_close(unshared[real], score_tokens(model, batch, 1.0, 40)[real], rtol=0, atol=1e-5)


def test_layout_of_the_settings():
    """algo.shared_prompt=auto (the default): shared on the CPU, where it was measured; packed on CUDA
    until it is measured on a GPU (REVIEW G3). true and false hold on both."""
    from grpo.update.layouts import layout_of, shares_prompts

    assert [shares_prompts(s, cuda) for s in ("auto", True, False) for cuda in (False, True)] == [
        True, False, True, True, False, False]
    with pytest.raises(ValueError, match="one of true, false, auto"):
        shares_prompts("yes", False)
    layout = lambda cuda, **kw: layout_of(OmegaConf.structured(AlgoConfig(**kw)), cuda)  # noqa: E731
    assert AlgoConfig().shared_prompt == "auto"
    assert layout(False) == "shared" and layout(True) == "packed"
    assert layout(True, shared_prompt=True) == "shared" and layout(False, shared_prompt=False) == "packed"
    assert layout(False, packing=False) == layout(True, packing=False, shared_prompt=True) == "padded"
    # what a command line gives: Hydra's true/false are bools, auto a string
    from tests.conftest import compose_cfg

    assert [compose_cfg(f"algo.shared_prompt={v}").algo.shared_prompt for v in ("true", "false", "auto")] == [
        True, False, "auto"]
    assert layout_of(compose_cfg().algo, cuda=False) == "shared" and layout_of(compose_cfg().algo, cuda=True) == "packed"


def test_an_unknown_layout_is_refused_not_run_shared(tiny_lm):
    """`plan` and `runnable_layout` take the layout names of `layout_of`; another (a typo) is refused,
    where it used to fall through to the shared-prompt layout."""
    from grpo.update.support import runnable_layout

    model, tok = tiny_lm
    batch = spread_batch(tok)
    for layout in ("packd", "Shared", None):
        with pytest.raises(ValueError, match="unknown layout"):
            runnable_layout(model, layout)
        with pytest.raises(ValueError, match="unknown layout"):
            plan(model, batch, layout, 10_000)


def test_shared_width_weighs_positions_against_attention():
    from grpo.update.layouts import CPU_KEYS_PER_POSITION, shared_width

    # one 10-token prompt, 16 completions of 4: width 14 holds one per tree (16 rows of 14); 28: four
    # (4 rows); 56: eleven, then five (2 rows); 112: all sixteen (1 row, 74 used). Positions x
    # (K + width): 224 (K + 14), 112 (K + 28), 112 (K + 56), 112 (K + 112): 28 is the least
    width, rows = shared_width([14] * 16, [10] * 16, ["a"] * 16, 14, 8192)
    assert CPU_KEYS_PER_POSITION == 4096 and width == 28 and [[len(t) for t in row] for row in rows] == [[4]] * 4
    # a 100-token prompt, completions 300, 200, 200: 3 rows of 400 (1,200 x (K + 400)) against one of
    # 800 (800 x (K + 800)); a 10-token prompt, two of 390: 2 x 400 x (K + 400) against 800 x (K + 800)
    assert shared_width([400, 300, 300], [100] * 3, ["a"] * 3, 400, 8192) == (800, [[[0, 1, 2]]])
    assert shared_width([400, 400], [10] * 2, ["a"] * 2, 400, 8192) == (400, [[[0]], [[1]]])
    # a cap of exactly twice the longest still tries the doubled width: the first case's 800 is within it
    assert shared_width([400, 300, 300], [100] * 3, ["a"] * 3, 400, 800) == (800, [[[0, 1, 2]]])
    # a cap below it keeps the longest: 3 rows of 400
    assert shared_width([400, 300, 300], [100] * 3, ["a"] * 3, 400, 799) == (400, [[[0]], [[1]], [[2]]])


def windowed_qwen2(tok, window):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                        sliding_window=window, max_window_layers=0))


def test_a_sliding_window_shares_while_every_sequence_fits_it(tiny_lm, ran):
    """A window no sequence reaches never binds, so the tree mask is exact: shared, no warning."""
    _, tok = tiny_lm
    windowed = windowed_qwen2(tok, 64)
    batch = spread_batch(tok)
    real = completion_tokens(batch)
    assert int(batch.attention_mask_BL.sum(1).max()) < 64
    shared = score_tokens(windowed, batch, 1.0, 10_000, layout="shared")
    torch.testing.assert_close(shared[real], score_tokens(windowed, batch, 1.0, 10_000)[real], rtol=0, atol=1e-5)
    assert_ran(ran, "shared")


def test_a_sequence_as_long_as_the_window_still_shares(tiny_lm, ran):
    """A window of exactly the longest sequence's length: its last position still sees the whole
    sequence, so the window does not bind and the prompts are shared (no warning), with the padded
    logprobs (which the window would change if it bound)."""
    _, tok = tiny_lm
    batch = spread_batch(tok)
    longest = int(batch.attention_mask_BL.sum(1).max())
    windowed = windowed_qwen2(tok, longest)
    real = completion_tokens(batch)
    shared = score_tokens(windowed, batch, 1.0, 10_000, layout="shared")
    torch.testing.assert_close(shared[real], score_tokens(windowed, batch, 1.0, 10_000)[real], rtol=0, atol=1e-5)
    assert_ran(ran, "shared")


def test_a_sliding_window_a_sequence_passes_is_packed_without_sharing(tiny_lm, ran):
    _, tok = tiny_lm
    windowed = windowed_qwen2(tok, 8)
    batch = spread_batch(tok)
    real = completion_tokens(batch)
    with pytest.warns(UserWarning, match="sliding window of 8 tokens"):
        unshared = score_tokens(windowed, batch, 1.0, 10_000, layout="shared")
    torch.testing.assert_close(unshared[real], score_tokens(windowed, batch, 1.0, 10_000)[real], rtol=0, atol=1e-5)
    assert ran["shared"] == 0 and ran["packed"] > 0


def test_an_eager_model_runs_the_float_mask(tiny_lm, ran):
    """Eager attention adds the mask to its scores: the float mask (0 / the dtype's minimum), run
    through a real forward, gives the padded logprobs."""
    from transformers import Qwen2ForCausalLM

    from grpo.update.support import support_of

    base, tok = tiny_lm
    eager = Qwen2ForCausalLM._from_config(copy.deepcopy(base.config), attn_implementation="eager")
    eager.load_state_dict(base.state_dict())
    batch = spread_batch(tok)
    real = completion_tokens(batch)
    shared = score_tokens(eager, batch, 1.0, 40, layout="shared")
    torch.testing.assert_close(shared[real], score_tokens(base, batch, 1.0, 40)[real], rtol=0, atol=1e-5)
    assert support_of(eager).mask_dtype == torch.float32 and support_of(eager).shares
    assert_ran(ran, "shared")


def test_the_verdicts_live_on_the_model(tiny_lm):
    """The verdicts are attributes of the (unwrapped) model, gone with it: a model built later, even
    at a freed model's address, is asked anew (an id()-keyed cache handed such a model the earlier
    one's answers: an eager model given the bool mask adds it to its scores, masking nothing). A model
    whose attention implementation changed is asked anew too."""
    from grpo.update.support import ATTRIBUTE, support_of, unwrapped
    from grpo.parallel.single import Autocast

    base, tok = tiny_lm
    batch = spread_batch(tok)
    sdpa = copy.deepcopy(base)
    score_tokens(Autocast(sdpa, torch.bfloat16), batch, 1.0, 10_000, layout="shared")
    assert unwrapped(Autocast(sdpa, torch.bfloat16)) is sdpa and sdpa.__dict__[ATTRIBUTE].mask_dtype == torch.bool
    sdpa.config._attn_implementation = "eager"
    assert support_of(sdpa).mask_dtype == torch.float32 and support_of(sdpa).shares is None
    real = completion_tokens(batch)
    shared = score_tokens(sdpa, batch, 1.0, 10_000, layout="shared")
    torch.testing.assert_close(shared[real], score_tokens(base, batch, 1.0, 10_000)[real], rtol=0, atol=1e-5)


def test_a_fallback_stays_within_the_micro_batch_cap(tiny_lm, monkeypatch):
    """A model that cannot share is planned packed from the start: no forward holds more positions
    than algo.micro_batch_tokens (re-packing the shared plan's trees ran 4-5.5x the cap)."""
    import grpo.update.layouts

    model, tok = tiny_lm
    b = tok.bos_token_id
    prompt = [b] + list(range(4, 20)) * 2  # 33 tokens, one prompt for 8 completions of 2-4
    comps = [[5] * (2 + i % 3) for i in range(8)]
    batch = collate([prompt] * 8, Rollouts(comps, [[0.0] * len(c) for c in comps], ["stop"] * 8, 0), torch.zeros(8),
                    tok.pad_token_id, False)
    widths = []
    real_pack = grpo.update.layouts.pack
    monkeypatch.setattr(grpo.update.layouts, "pack", lambda *a, **k: (lambda p: (widths.append(p.input_ids_RW.numel()), p)[1])(
        real_pack(*a, **k)))
    no_mask = NoMask(model)
    with pytest.warns(UserWarning, match="without sharing"):
        score_tokens(no_mask, batch, 1.0, 80, layout="shared")
    assert widths and max(widths) <= 80, widths
    # the plan names what runs and why (policy_update's `layout`, the guard's message)
    planned = plan(no_mask, batch, "shared", 80)
    assert (planned.asked, planned.layout) == ("shared", "packed") and "ignores a 4D mask" in planned.reason
    assert {mb.layout for mb in planned.micro_batches} == {"packed"}
    assert plan(model, batch, "shared", 80).reason is None


def test_the_layout_probes_run_in_eval_mode(tiny_lm, ran):
    """LoRA dropout, an adapter no longer zero (as after a resume), the model in training mode: the
    probes compare two forwards, which dropout would make disagree (packing refused, sharing silently
    dropped)."""
    from grpo import lora

    model, tok = tiny_lm
    wrapped = lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=8, dropout=0.5)))
    with torch.no_grad():
        for _, p in lora.adapter_parameters(wrapped):
            p.normal_(0, 0.5)
    wrapped.train()
    batch = spread_batch(tok)
    batch.ref_logprobs_BT = torch.zeros_like(batch.sampler_logprobs_BT)
    algo = algo_for("bnpo", "shared", 60)
    norm = loss_norm(batch, max_len=14, gen_tokens_per_step=1.0)
    accumulate_gradients(SingleStrategy(None, wrapped, algo, total_steps=1), batch, algo, norm, temperature=1.0)
    assert wrapped.training
    assert_ran(ran, "shared")


def test_shared_prompts_in_bf16_round_as_the_padded_layout_does(tiny_lm, ran):
    """bf16 (fp32 masters, the forward under autocast, as model.dtype=bfloat16 trains): a tree row
    sums attention over other keys than a row of one sequence (a sibling's masked columns between the
    prompt and the completion), which can move a bf16-rounded value by one step; the head's logits
    are bf16 too (a step of 0.0625 for logits in [8, 16)). So the layouts are not bit-equal in bf16,
    but each is as close to the fp32 logprobs as the padded one (docs/algorithm.md has the numbers);
    a wrong mask is off by far more."""
    from grpo.parallel.single import Autocast

    model, tok = tiny_lm
    batch = spread_batch(tok, B=16, group=4)
    real = completion_tokens(batch)
    fp32 = score_tokens(model, batch, 1.0, 10_000)
    low = Autocast(model, torch.bfloat16)
    err = {layout: (score_tokens(low, batch, 1.0, 10_000, layout=layout) - fp32)[real].abs()
           for layout in ("padded", "shared")}
    assert_ran(ran, "shared")
    assert err["padded"].max() > 0  # bf16 really ran
    assert err["shared"].max() <= 2 * err["padded"].max() + 0.0625 and err["shared"].mean() <= 2 * err["padded"].mean() + 1e-3


def test_the_packing_probe_bound_follows_the_compute_dtype(tiny_lm):
    """REVIEW Part 5 (GPU-only notes): the probe accepted a packed row only within 1e-2 of each
    position's size, which bf16 kernels of different kinds (a mask against none) can exceed on deep
    models, refusing the CUDA default layout. The bound is now the compute dtype's (0.1 in bf16/fp16):
    still far below what attending across the sequences gives (about the state's own size), which the
    probe refuses in fp32 and bf16 alike."""
    from grpo.update.support import PROBE_TOLERANCE, close, compute_dtype, probe_packs
    from grpo.parallel.single import Autocast

    base, _ = tiny_lm
    as_bf16 = copy.deepcopy(base).to(torch.bfloat16)
    assert (compute_dtype(base), compute_dtype(Autocast(base, torch.bfloat16)), compute_dtype(as_bf16)) == \
        (torch.float32, torch.bfloat16, torch.bfloat16)
    a = torch.ones(2, 8)
    assert close(1.03 * a, a, PROBE_TOLERANCE[torch.bfloat16]) and not close(1.03 * a, a, PROBE_TOLERANCE[torch.float32])

    class Across(torch.nn.Module):
        """A model that attends across a packed row's sequences: the restart of positions is ignored."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids, **kw):
            return self.model(input_ids=input_ids, position_ids=torch.arange(input_ids.shape[1])[None], **kw)

    assert probe_packs(copy.deepcopy(base)) and probe_packs(Autocast(copy.deepcopy(base), torch.bfloat16))
    assert probe_packs(as_bf16)
    assert not probe_packs(Across(copy.deepcopy(base))) and not probe_packs(Across(as_bf16))


def test_a_completion_with_an_empty_prompt_is_refused_and_a_bos_prompt_scores(tiny_lm):
    """No position predicts the first token of a completion whose prompt is empty: the padded rows read
    it from a pad (or column -1), the packed ones from the previous sequence's last token. collate
    refuses it, naming the completion and what to change; an empty prompt with nothing sampled stays
    (nothing is read), and a prompt of the BOS token alone scores the first token from the BOS, in
    every layout."""
    model, tok = tiny_lm
    b = tok.bos_token_id
    comps = [[10, 11], [12, 13, 14]]
    rollouts = Rollouts(comps, [[-1.0] * 2, [-1.0] * 3], ["stop"] * 2, 0)
    with pytest.raises(ValueError, match="completion 1 has an empty prompt.*a system prompt or a BOS token"):
        collate([[b, 5, 6], []], rollouts, torch.zeros(2), tok.pad_token_id, False)
    collate([[b, 5, 6], []], Rollouts([[10], []], [[-1.0], []], ["stop"] * 2, 0), torch.zeros(2), tok.pad_token_id, False)
    batch = collate([[b, 5, 6], [b]], rollouts, torch.zeros(2), tok.pad_token_id, False)
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([[b]])).logits[0, -1].float(), -1)[12].item()
    for layout in ("padded", "packed"):
        assert plan(model, batch, layout, 10_000).layout == layout
        got_BT = score_tokens(model, batch, 1.0, 10_000, layout=layout)
        assert got_BT[1, 0].item() == pytest.approx(want, abs=1e-5), layout


def test_repeated_positions_are_read_with_a_backward_that_adds_in_index_order():
    """The shared layout reads a prompt's last position once per completion. Read as x[at], the
    backward (index_put, accumulating) adds those repeats with atomics on more than one CPU thread, in
    arrival order: 2-thread runs of the default run drifted apart (1e-9 at first, then whole rewards)
    while 1 thread repeated bit for bit. `positions` reads through index_select, whose backward adds
    in index order: the same values, and the gradient one thread's index_put gives, bit for bit."""
    from grpo.update.forward import positions

    x_RWH = torch.randn(40, 43, 128, dtype=torch.float64).float().requires_grad_()
    gen = torch.Generator().manual_seed(0)
    at = (torch.randint(0, 40, (1277,), generator=gen), torch.randint(0, 43, (1277,), generator=gen))
    at = (torch.cat([at[0], torch.full((16,), 3)]), torch.cat([at[1], torch.full((16,), 7)]))  # one position 16+ times
    weights = torch.randn(at[0].shape[0], 128, generator=gen)
    picked = positions(x_RWH, at)
    assert picked.grad_fn.name() == "IndexSelectBackward0"
    assert torch.equal(picked, x_RWH[at])
    (grad,) = torch.autograd.grad((picked * weights).sum(), x_RWH)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # index_put's serial branch: the order one thread adds in
        (serial,) = torch.autograd.grad((x_RWH[at] * weights).sum(), x_RWH)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grad, serial)
