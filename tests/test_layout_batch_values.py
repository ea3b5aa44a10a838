"""Numbers no other test pinned in grpo/update/layouts.py, grpo/batch.py, grpo/flops.py, grpo/mfu.py and
grpo/metrics.py: each test here was written against a mutation of the code (a plausible bug) that every
existing fast test let through. The expected values are worked out by hand in the docstrings and
comments. Tiny tensors and hand-made batches (one test reads the session's tiny model, tests/conftest.py
`tiny_lm`, for its config; none runs a forward); nothing starts a process. grpo/metrics.py's mutants were
all caught by tests/test_pinned_values.py and tests/test_algorithm.py: no test here."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from grpo import flops
from grpo.batch import Batch, batch_advantages, collate, turn_token_advantages
from grpo.flops import Shape, Work
from grpo.metrics import resolve
from grpo.mfu import Meter
from grpo.rollout.base import Rollouts
from grpo.rollout.episodes import Episode
from grpo.update.layouts import MicroBatch, pack, packed_mask, rows, shared_width


# --- grpo/update/layouts.py ----------------------------------------------------------------------------


def test_a_one_token_sequence_is_a_run_of_its_own_in_the_whole_rows_mask():
    """Sequence parallelism's packed mask reads a run wherever the positions do not rise by one. A
    sequence of a lone prompt token (an empty completion) at position 0, then [6, 7, 8] at 0, 1, 2: the
    positions 0, 0, 1, 2 hold two runs, so 6 (column 1) attends to itself only, not to 5. Starting a run
    only where the positions fall (0 -> 0 does not) let the second sequence attend to the first."""
    rollouts = Rollouts([[], [8]], [[], [0.0]], ["stop"] * 2, 0)
    batch = collate([[5], [6, 7]], rollouts, torch.zeros(2), pad_id=0, mask_truncated=False)
    packed = pack(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, [2])
    assert packed.input_ids_RW.tolist() == [[5, 6, 7, 8]] and packed.position_ids_RW.tolist() == [[0, 0, 1, 2]]
    assert packed_mask(packed.position_ids_RW).int().tolist() == [[[[1, 0, 0, 0],
                                                                    [0, 1, 0, 0],
                                                                    [0, 1, 1, 0],
                                                                    [0, 1, 1, 1]]]]


def test_whole_packed_rows_get_their_mask_when_any_row_holds_several_sequences(tiny_lm):
    """Sequence parallelism (split_size 2) over packed rows [2, 1]: row 0 holds [b, 5, 10] and
    [b, 6, 11, 12], row 1 [b, 7, 13] alone. Width: the longest row, 7, rounded up to 2: 8. Row 0 needs
    the block mask: the second sequence's first token (its b, column 3) attends to itself only, 12
    (column 6) to columns 3-6; row 1 is one causal run (its padding's positions run on: 0..7). A
    mask built only when every row holds several sequences left row 0 plain causal (None): the second
    sequence attended to the first."""
    model, tok = tiny_lm
    b = tok.bos_token_id
    rollouts = Rollouts([[10], [11, 12], [13]], [[0.0], [0.0] * 2, [0.0]], ["stop"] * 3, 0)
    batch = collate([[b, 5], [b, 6], [b, 7]], rollouts, torch.zeros(3), tok.pad_token_id, mask_truncated=False)
    whole = rows(model, MicroBatch(batch, "packed", [2, 1]), split_size=2)
    assert whole.position_ids_RW.tolist() == [[0, 1, 2, 0, 1, 2, 3, 7], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert whole.mask is not None and whole.mask.shape == (2, 1, 8, 8)
    attends = lambda r, q: torch.nonzero(whole.mask[r, 0, q]).flatten().tolist()  # noqa: E731
    assert attends(0, 2) == [0, 1, 2] and attends(0, 3) == [3] and attends(0, 6) == [3, 4, 5, 6]
    assert whole.mask[1, 0].equal(torch.ones(8, 8, dtype=torch.bool).tril())


def test_shared_width_keeps_narrow_rows_when_wider_ones_attend_more_than_they_save():
    """Prompt a (100 tokens) with four completions of 1,400 (sequences of 1,500) and prompt b (50 + 50).
    Width 1,500: one completion a tree, b in a fifth row: 5 x 1,500 = 7,500 positions. Width 3,000: two
    completions a tree (2,900), b beside the first: 2 rows, 6,000 positions. Width 6,000: one tree of
    5,700 and b: 1 row, 6,000. Cost positions x (4,096 + width): 7,500 x 5,596 = 41.97M, 6,000 x 7,096 =
    42.58M, 6,000 x 10,096 = 60.58M: 1,500 is kept. Counting positions alone (dropping the width's
    attention term) took 3,000, the fewest positions."""
    width, planned = shared_width([1500] * 4 + [100], [100] * 4 + [50], ["a"] * 4 + ["b"], 1500, 8192)
    assert width == 1500 and planned == [[[0]], [[1]], [[2]], [[3]], [[4]]]


# --- grpo/batch.py -------------------------------------------------------------------------------------


def three_rows_with_images() -> Batch:
    """Three one-token prompts with one-token completions; row i's images stand in as the string "img i"."""
    ids = torch.tensor([[1, 4], [2, 5], [3, 6]])
    zeros = torch.zeros(3, 1)
    return Batch(ids, torch.ones_like(ids), torch.tensor([[0, 1]] * 3), ids[:, 1:], torch.ones(3, 1), zeros,
                 torch.tensor([0.5, -0.5, 1.0]), prompt_width=1, vision=["img 0", "img 1", "img 2"])


def test_selecting_rows_by_a_bool_mask_keeps_each_rows_own_images():
    """`Batch.select` with a bool mask [False, True, True] takes rows 1 and 2: their tokens [2, 5] and
    [3, 6] and their images "img 1" and "img 2". Reading the mask's values as indices (False = 0,
    True = 1) gave the images of rows 0, 1, 1: row 1's tokens beside row 0's picture."""
    picked = three_rows_with_images().select(torch.tensor([False, True, True]))
    assert picked.input_ids_BL.tolist() == [[2, 5], [3, 6]] and picked.advantages_B.tolist() == [-0.5, 1.0]
    assert picked.vision == ["img 1", "img 2"]
    assert three_rows_with_images().select(torch.tensor([2, 0])).vision == ["img 2", "img 0"]
    assert three_rows_with_images().select(slice(1, 3)).vision == ["img 1", "img 2"]


def test_a_batch_scale_divides_by_the_std_of_the_rewards_themselves():
    """algo.adv_scale=batch: rewards [[0, 1], [2, 3]] centre on their groups' means 0.5 and 2.5 to
    -0.5, 0.5, -0.5, 0.5, divided by the std of all four rewards: mean 1.5, squared deviations
    2.25 + 0.25 + 0.25 + 2.25 = 5 over n - 1 = 3, std sqrt(5/3) = 1.291 (+ eps 1e-4): +-0.3873. The std
    of the centred rewards (REINFORCE++'s, sqrt(1/3) = 0.577) gave +-0.866."""
    adv = batch_advantages(torch.tensor([[0.0, 1.0], [2.0, 3.0]]), "batch")
    want = 0.5 / (math.sqrt(5 / 3) + 1e-4)
    torch.testing.assert_close(adv.double(), torch.tensor([[-want, want], [-want, want]], dtype=torch.float64))


def test_collate_hands_the_loss_float32_advantages():
    """`collate` stores the advantages as float32, the dtype of the logprobs and masks they multiply,
    whatever it is given (the estimators return float32 today; a caller's float64 advantages must not
    turn the loss float64). -0.1 comes back as float32's nearest, -0.10000000149, not float64's -0.1."""
    rollouts = Rollouts([[3], [4]], [[-1.0], [-1.0]], ["stop"] * 2, 0)
    batch = collate([[1], [2]], rollouts, torch.tensor([-0.1, 0.5], dtype=torch.float64), pad_id=0, mask_truncated=False)
    assert batch.advantages_B.dtype == torch.float32 and batch.advantages_B.tolist() == [-0.10000000149011612, 0.5]


def test_per_turn_advantages_of_empty_spans_are_as_wide_as_collates_tokens():
    """algo.turn_rewards=per_turn over a group of two episodes that sampled nothing (0 turns, empty
    spans): `collate` pads the completions to T = max(1, longest) = 1 token, so the per-token
    advantages are B x 1 zeros too. T = the longest span alone gave B x 0, a shape the batch's B x 1
    mask does not match."""
    episodes = [Episode(turns=0), Episode(turns=0)]
    rollouts = SimpleNamespace(episodes=episodes, completion_ids=[[], []], token_turns=[[], []])
    adv_BT = turn_token_advantages(torch.full((1, 2), math.nan), rollouts, 1.0, torch.zeros(2), "per_turn", 1.0, "group")
    assert adv_BT.tolist() == [[0.0], [0.0]]
    batch = collate([[1], [2]], Rollouts([[], []], [[], []], ["stop"] * 2, 0), torch.zeros(2), pad_id=0, mask_truncated=False)
    assert batch.mask_BT.shape == adv_BT.shape == (2, 1)


# --- grpo/flops.py --------------------------------------------------------------------------------------


def test_generation_work_takes_each_prompts_own_g_completions():
    """Two prompts, G = 2: prompt 0 = [1, 2] with spans [3, 4] and [5]; prompt 1 = [6] with [7, 8, 9]
    and [10, 11]. A span's last token is never forwarded. Prompt 0: prefill 2 tokens, 1 + 2 = 3 pairs;
    [3, 4] forwards 1 token at position 2 (3 keys): 1 x 2 + 1 = 3 pairs; [5] forwards none. Prompt 1:
    prefill 1 token, 1 pair; [7, 8, 9] forwards 2 tokens with 2 and 3 keys: 2 x 1 + 3 = 5 pairs;
    [10, 11] forwards 1 with 2 keys: 1 x 1 + 1 = 2 pairs. tokens 2 + 1 + 1 + 2 + 1 = 7, pairs
    3 + 3 + 1 + 5 + 2 = 14, head 2 + 1 + 3 + 2 = 8 sampled. Slicing the spans [i : i + G] instead of
    [i x G : (i + 1) x G] gave prompt 1 the spans [5] and [7, 8, 9] (6 tokens)."""
    work = flops.generation_work([[1, 2], [6]], [[3, 4], [5], [7, 8, 9], [10, 11]], sampled=[2, 1, 3, 2], G=2)
    assert work == Work(tokens=7, computed=7, head=8, pairs=14)


def test_a_ranks_share_of_a_split_micro_batch_is_rounded_not_truncated():
    """Under sequence parallelism a rank counts 1/S of a micro-batch (grpo/update/step.py). 8 real
    tokens over S = 3 ranks: 8/3 = 2.67 tokens here, read as 3 (the nearest count), not 2 (int()
    truncating, which loses up to a token per field and micro-batch)."""
    share = Work(tokens=torch.tensor(8), computed=torch.tensor(9), head=torch.tensor(5), pairs=torch.tensor(26)).scaled(1 / 3)
    # 8/3 = 2.67 -> 3; 9/3 = 3; 5/3 = 1.67 -> 2; 26/3 = 8.67 -> 9
    assert share.resolved() == Work(tokens=3, computed=3, head=2, pairs=9)


# --- grpo/mfu.py ----------------------------------------------------------------------------------------

SHAPE = Shape(body=10, body_trained=10, head=4, head_trained=True, attention=0)
WORK = Work(tokens=5, computed=8, head=2)  # one forward: 2 x (10 x 5 + 4 x 2) = 116 FLOPs; a backward 232
TIMES = {"time/update_s": 2.0, "time/batch_generate_s": 4.0, "step_s": 8.0}


def meter(peak=1e6, local=True, recompute=False) -> Meter:
    return Meter(SHAPE, peak=peak, dtype=torch.float32, nominal=None, local_generation=local, recompute=recompute)


def test_the_reference_models_forward_is_update_work():
    """beta > 0: the update runs the old-logprob forward, the reference model's forward and the training
    forward and backward, each over the same 5 tokens: 116 + 116 + 116 + 232 = 580 FLOPs. Leaving the
    reference out gave 464 (tests/test_flops.py's step has an empty reference)."""
    update = {"old": WORK, "reference": WORK, "train": WORK}
    m = resolve(meter().metrics(Work(), update, TIMES))
    assert m["flops/update"] == 580
    assert m["mfu/update"] == pytest.approx(580 / 2.0 / 1e6)


def test_a_phase_exactly_at_the_measured_peak_does_not_warn():
    """The training step's 116 + 116 + 232 = 464 FLOPs in 2 s is 232 FLOP/s; against a measured peak of
    exactly 232 that is an MFU of 1, not "above the peak": no warning, the peak stays. Raising at >=
    warned that a phase ran above the peak it equalled."""
    update = {"old": WORK, "reference": Work(), "train": WORK}
    m232 = meter(peak=232.0, local=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = resolve(m232.metrics(Work(), update, TIMES))
    assert m["mfu/update"] == pytest.approx(1.0) and (m232.peak, m232.achieved) == (232.0, 232.0)


def test_the_raised_peak_warns_once_and_is_raised_again_silently():
    """Measured 100 FLOP/s: a step at 464 / 2 = 232 FLOP/s raises the peak with a warning; a later step
    at 464 / 1 = 464 FLOP/s raises it again to 464 (mfu/update 1) without a second warning: the warning
    is for the measurement at the start, said once. Warning at every raise repeated it each time."""
    update = {"old": WORK, "reference": Work(), "train": WORK}
    m100 = meter(peak=100.0, local=False)
    with pytest.warns(UserWarning, match="above the matmul peak measured at the start"):
        m100.metrics(Work(), update, TIMES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        faster = resolve(m100.metrics(Work(), update, {**TIMES, "time/update_s": 1.0}))
    assert faster["mfu/update"] == pytest.approx(1.0)
    assert (m100.measured, m100.peak, m100.achieved) == (100.0, 464.0, 464.0)


def test_a_served_engines_rate_does_not_raise_the_trainers_peak():
    """Generation on a dedicated or remote engine runs on another device: its 440 FLOPs (2 x (10 x 20 +
    4 x 5)) in 0.1 s, 4,400 FLOP/s, say nothing of the trainer's peak of 1,000. The update's 464 FLOPs
    in 2 s stay 232 / 1,000 = 0.232 of it; taking the engines' rate as a phase of this device raised the
    peak to 4,400 and read the update as 0.053."""
    update = {"old": WORK, "reference": Work(), "train": WORK}
    served = meter(peak=1000.0, local=False)
    m = resolve(served.metrics(Work(tokens=20, computed=20, head=5), update, {**TIMES, "time/batch_generate_s": 0.1}))
    assert m["flops/generate"] == 440 and m["mfu/update"] == pytest.approx(0.232)
    assert (served.peak, served.achieved) == (1000.0, 232.0)


@pytest.mark.parametrize("backend, local", [("hf", True), ("colocated", True), ("dedicated", False), ("remote", False)])
def test_the_engines_on_the_trainers_device_are_hf_and_colocated(backend, local, monkeypatch):
    """`meter` marks generation local (mfu/generate, generation in mfu/step) for the backends whose
    engines run on the trainer's own device: hf and colocated (vLLM in the trainer's process), not a
    dedicated or remote engine. The peak is stubbed (no matmul is timed)."""
    from grpo import mfu

    monkeypatch.setattr(mfu.flops, "shape_of", lambda model: SHAPE)
    monkeypatch.setattr(mfu.peak, "measured_peak", lambda device, dtype, **kw: 1000.0)
    got = mfu.meter(torch.nn.Linear(2, 2), torch.float32, backend, gradient_checkpointing=False)
    assert got.local_generation is local and got.peak == 1000.0


def test_local_generation_is_read_against_the_raised_peak_too():
    """Measured 100 FLOP/s; the update's 464 FLOPs in 2 s (232 FLOP/s) raise the peak to 232. Local
    generation's 440 FLOPs in 4 s (110 FLOP/s) are then 110 / 232 = 0.474 of it, as mfu/update is read
    against the raised peak; against the measured 100 it read 1.1, an MFU above 1."""
    update = {"old": WORK, "reference": Work(), "train": WORK}
    m100 = meter(peak=100.0, local=True)
    with pytest.warns(UserWarning, match="above the matmul peak"):
        m = resolve(m100.metrics(Work(tokens=20, computed=20, head=5), update, TIMES))
    assert m["mfu/update"] == pytest.approx(1.0) and m["mfu/generate"] == pytest.approx(110 / 232)
