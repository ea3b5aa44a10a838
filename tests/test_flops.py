"""FLOPs per phase (grpo/flops.py): by hand, and against torch's own counter on real models."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from grpo import flops
from grpo.metrics import resolve
from grpo.batch import collate
from grpo.flops import Shape, Work
from grpo.rollout.base import Rollouts
from grpo.update import layouts


def test_forward_and_backward_by_hand():
    shape = Shape(body=10, body_trained=10, head=4, head_trained=True, attention=3)
    work = Work(tokens=5, computed=8, head=2, pairs=15)
    # 2 x (10 x 5 + 4 x 2) + 4 x 3 x 15
    assert flops.forward_flops(shape, work) == 116 + 180
    # inputs' gradients 116, weights' 116, attention 2 x 180
    assert flops.backward_flops(shape, work) == 116 + 116 + 360
    lora = Shape(body=10, body_trained=1, head=4, head_trained=False, attention=3)
    assert flops.backward_flops(lora, work) == 116 + 2 * 5 + 360  # frozen weights get no gradient
    assert work + Work(1, 2, 3, 4) == Work(6, 10, 5, 19)


def test_generation_work_by_hand():
    # one prompt of 3 tokens, two completions: [4, 5] (5 is sampled last, never forwarded) and [6]
    work = flops.generation_work([[1, 2, 3]], [[4, 5], [6]], sampled=[2, 1], G=2)
    # prefill 3 tokens with 1 + 2 + 3 keys; token 4 at position 3 attends to 4 keys
    assert work == Work(tokens=4, computed=4, head=3, pairs=10)


def qwen2(layers=2, hidden=64, heads=4, kv=2, inter=128, vocab=97, tied=True):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                                        tie_word_embeddings=tied))


def test_shape_counts_the_weights_a_token_multiplies_by():
    model = qwen2(tied=False)
    h, kv_dim, inter, v = 64, 2 * 16, 128, 97
    per_layer = h * h + 2 * h * kv_dim + h * h + 3 * h * inter  # q, k and v, o, gate, up and down
    shape = flops.shape_of(model)
    assert shape == Shape(body=2 * per_layer, body_trained=2 * per_layer, head=h * v, head_trained=True,
                          attention=2 * 4 * 16)
    assert flops.shape_of(qwen2(tied=True)).head == h * v  # the tied head still multiplies


def counted(model, ids, backward=False) -> int:
    with FlopCounterMode(display=False) as counter:
        out = model(input_ids=ids, use_cache=False)
        if backward:
            out.logits.float().pow(2).mean().backward()
    return counter.get_total_flops()


SMOLLM2 = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, tie_word_embeddings=True)


@pytest.mark.parametrize("name", ["qwen2", "smollm2", "moe"])
def test_forward_and_backward_match_torchs_counter(name):
    """torch's counter sees every matmul; eager attention multiplies the full T x T square (the causal
    mask is applied after), so the comparison asks for T x T pairs, and every position's logits."""
    torch.manual_seed(0)
    if name == "qwen2":
        model = qwen2()
    elif name == "smollm2":
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    else:  # the experts' own loop (eager), which the counter sees; 8 experts, top-2
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                                   moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                   tie_word_embeddings=True))
        model.set_experts_implementation("eager")
    model.set_attn_implementation("eager")  # matmuls the counter sees (it misses the CPU's fused SDPA)
    T = 24
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    shape = flops.shape_of(model)
    work = Work(tokens=T, computed=T, head=T, pairs=T * T)
    forward = flops.forward_flops(shape, work)
    assert counted(model, ids) == pytest.approx(forward, rel=2e-3)  # rotary's small matmul aside
    total = forward + flops.backward_flops(shape, work)
    assert counted(model, ids, backward=True) == pytest.approx(total, rel=5e-3)


def test_rows_work_counts_real_tokens_and_their_causal_keys():
    """Three sequences of 2 + 3, 1 + 1 and 1 + 2 tokens: padded, 3 rows of 5; packed, rows as wide as
    the longest, [5] and [2 + 3]; either way 10 real tokens with 1+..+5, 1+2 and 1+2+3 causal keys."""
    rollouts = Rollouts(completion_ids=[[5, 6, 7], [8], [9, 10]], logprobs=[[-1.0] * 3, [-1.0], [-1.0] * 2],
                        finish_reasons=["stop"] * 3, weight_version=0)
    batch = collate([[1, 2], [3], [4]], rollouts, torch.ones(3), pad_id=0, mask_truncated=False)
    model = qwen2()
    got = {}
    for layout in ("padded", "packed"):
        plan = layouts.plan(model, batch, layout, max_tokens=64)
        (mb,) = plan.micro_batches
        got[layout] = flops.rows_work(layouts.rows(model, mb), head_tokens=6).resolved()
    assert got["padded"] == Work(tokens=10, computed=3 * 5, head=6, pairs=15 + 3 + 6)
    assert got["packed"] == Work(tokens=10, computed=2 * 5, head=6, pairs=15 + 3 + 6)


def test_a_vlms_shape_is_its_language_models_and_loras_trains_the_adapters():
    """A Qwen2-VL counts its language model only (the vision tower is left out, said in grpo/flops.py);
    LoRA keeps every weight's forward and input gradients, and trains only the adapters' weights."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from omegaconf import OmegaConf

    from grpo import lora
    from grpo.config import LoraConfig

    text = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vlm = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64,
                                                                                            num_heads=2)))
    assert flops.shape_of(vlm) == flops.shape_of(qwen2(tied=True))  # the same text sizes, no vision

    model = qwen2()
    dense = flops.shape_of(model)
    adapted = flops.shape_of(lora.wrap(model, OmegaConf.structured(LoraConfig(rank=8))))
    adapters = adapted.body - dense.body
    assert adapters > 0 and adapted.body_trained == adapters and not adapted.head_trained


def test_a_steps_mfu_by_hand():
    """Each phase's FLOPs over its own seconds over the peak (generation's: the engines' seconds on the
    batch, not the trainer's wait for it); generation's MFU only where the engines run on the trainer's
    device; gradient checkpointing's recompute apart from the MFU, the decoder layers' alone (2 x 50:
    the LM head is outside the checkpointed layers)."""
    from grpo.mfu import Meter

    shape = Shape(body=10, body_trained=10, head=4, head_trained=True, attention=0)
    train = Work(tokens=5, computed=8, head=2, pairs=0)  # forward 2 x (50 + 8) = 116, backward 232
    update = {"old": Work(tokens=5, computed=8, head=2), "reference": Work(), "train": train}
    generation = Work(tokens=20, computed=20, head=5)  # 2 x (200 + 20) = 440
    times = {"time/update_s": 2.0, "time/generate_s": 0.5, "time/batch_generate_s": 4.0, "step_s": 8.0}
    local = Meter(shape, peak=400.0, dtype=torch.float32, nominal=None, local_generation=True, recompute=True)
    m = resolve(local.metrics(generation, update, times))  # as one process logs them (grpo/metrics.py)
    assert m["flops/update"] == 116 + 116 + 232 and m["flops/generate"] == 440
    assert m["mfu/update"] == pytest.approx(464 / 2 / 400) and m["mfu/generate"] == pytest.approx(440 / 4 / 400)
    assert m["mfu/step"] == pytest.approx((464 + 440) / 8 / 400) and m["flops/update_recompute"] == 100
    assert m["update/real_token_frac"] == 5 / 8 and m["update_tokens_per_s"] == 5 / 2
    served = resolve(Meter(shape, 400.0, torch.float32, None, local_generation=False, recompute=False).metrics(generation, update, times))
    assert "mfu/generate" not in served and "flops/update_recompute" not in served
    assert served["mfu/step"] == pytest.approx(464 / 8 / 400)  # the engines' FLOPs ran elsewhere
    # algo.max_staleness: a step that handed the engines two batches (or none) generated other than the one
    # counted; the update's FLOPs alone (served) are still the step's own
    assert math.isnan(resolve(local.metrics(generation, update, times, handed=2))["mfu/step"])
    assert resolve(Meter(shape, 400.0, torch.float32, None, False, False).metrics(generation, update, times, handed=0))[
        "mfu/step"] == pytest.approx(464 / 8 / 400)


def test_a_phase_faster_than_the_measured_peak_raises_it_and_no_mfu_exceeds_1():
    """The peak measured at the start under load (2.1x below the end's on a shared 2-core machine) gave
    mfu/update 1.37: the update at 232 FLOP/s against a measured 100 is read as the peak, with a
    warning; a later step at 116 FLOP/s is 0.5 of it, and the summary keeps both figures."""
    from grpo.mfu import Meter

    shape = Shape(body=10, body_trained=10, head=4, head_trained=True, attention=0)
    train = Work(tokens=5, computed=8, head=2, pairs=0)
    update = {"old": Work(tokens=5, computed=8, head=2), "reference": Work(), "train": train}  # 464 FLOPs
    meter = Meter(shape, peak=100.0, dtype=torch.float32, nominal=None, local_generation=False, recompute=False)
    with pytest.warns(UserWarning, match="above the matmul peak measured at the start"):
        fast = resolve(meter.metrics(Work(), update, {"time/update_s": 2.0, "time/batch_generate_s": 0.0, "step_s": 4.0}))
    assert fast["mfu/update"] == pytest.approx(1.0) and fast["mfu/step"] == pytest.approx(464 / 4 / 232)
    slow = resolve(meter.metrics(Work(), update, {"time/update_s": 4.0, "time/batch_generate_s": 0.0, "step_s": 8.0}))
    assert slow["mfu/update"] == pytest.approx(0.5)
    assert (meter.measured, meter.achieved, meter.peak) == (100.0, 232.0, 232.0)


def test_the_datasheet_peak_by_device_name_and_tf32(monkeypatch):
    """The nominal dense peak a GPU's measured one is shown against: by the device's name, TF32 where
    torch runs fp32 matmuls as TF32; none for a CPU or an unknown GPU."""
    from grpo import peak

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak.nominal_peak(cuda, torch.bfloat16) == 989e12
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak.nominal_peak(cuda, torch.float32) == 67e12
        torch.set_float32_matmul_precision("high")  # TF32
        assert peak.nominal_peak(cuda, torch.float32) == 494.5e12
        assert peak.nominal_peak(torch.device("cpu"), torch.float32) is None  # a CPU: measured only
    finally:
        torch.set_float32_matmul_precision(before)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    assert peak.nominal_peak(cuda, torch.bfloat16) is None


def test_the_datasheet_peak_of_a_pcie_or_nvl_variant_is_its_own(monkeypatch):
    """An H100 PCIe (756 TFLOP/s dense bf16) or an H100/H200 NVL (835) is not the SXM part (989): a name
    that contains "H100" or "H200" is matched by its variant first."""
    from grpo import peak

    cuda = torch.device("cuda", 0)
    for name, bf16 in (("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200 NVL", 835e12),
                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak.nominal_peak(cuda, torch.bfloat16) == bf16, name


def test_the_measured_peak_is_kept_per_dtype_and_measured_again_when_asked():
    from grpo import peak

    fp32 = peak.measured_peak("cpu", torch.float32, repeats=2)
    assert fp32 > 1e9 and peak.measured_peak("cpu", torch.float32, repeats=2) == fp32  # once per process
    assert peak.measured_peak("cpu", torch.bfloat16, repeats=2) != fp32  # a key of its own
    assert peak.measured_peak("cpu", torch.float32, repeats=2, fresh=True) > 1e9


def test_the_mfu_bench_takes_every_ranks_device_and_generation_its_own_seconds(tmp_path):
    """A 2-rank run's folder: its flops/* are summed over the ranks (grpo.metrics.reduce_metrics), so the
    bench's MFU is against both devices' peak (rank 0's alone gave twice the run's own mfu/update), and
    generation's against the batch's own seconds (time/batch_generate_s; with algo.max_staleness the
    trainer's wait, time/generate_s, is next to none). By value: 2 ranks x 2 TFLOP/s; 1 TFLOP each of
    update in 0.5 s and of generation in 0.5 s of the engines: MFU 0.5 each, the step's 2 TFLOP in 1 s too."""
    import json

    from grpo.bench.mfu import phase_rows

    row = {"step_s": 1.0, "time/generate_s": 0.01, "time/batch_generate_s": 0.5, "time/score_s": 0.1, "time/update_s": 0.5,
           "time/sync_s": 0.1, "flops/generate": 1e12, "flops/update": 1e12, "mfu/generate": 0.0, "gen_tokens_per_s": 1.0,
           "update_tokens_per_s": 1.0, "update/real_token_frac": 1.0}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **row}) + "\n" for s in (1, 2, 3)))
    (tmp_path / "summary.json").write_text(json.dumps({"peak_tflops_measured": 2.0, "peak_tflops_at_end": 1.5, "world_size": 2}))
    phases, step = phase_rows(str(tmp_path))
    by = {p["phase"]: p for p in phases}
    assert by["update"]["mfu"] == pytest.approx(0.5) and by["generate"]["mfu"] == pytest.approx(0.5)
    assert by["generate"]["seconds"] == pytest.approx(0.01)  # the phase's share of the step stays the trainer's
    assert step["mfu_step"] == pytest.approx(0.5) and step["bound_s"] == pytest.approx(0.5) and step["ranks"] == 2
