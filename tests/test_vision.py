"""Vision-language models (grpo/vision.py): image prompts through the hf sampler and the trainer on a
tiny Qwen2-VL built in code. M-RoPE by value and against the model's own; what the trainer's forward
is given (pixels, token ids) against what the sampler was given, for images of different sizes in
the packed layout; logprob parity in the padded and packed layouts, fp32 and bf16; a short run."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from grpo import vision
from grpo.batch import collate
from grpo.update.layouts import MicroBatch, micro_batches
from grpo.update.forward import batch_logprobs
from grpo.models import encode_prompts
from grpo.prompts import format_prompt
from grpo.rollout.base import Sampling
from grpo.rollout.hf import HFBackend
from grpo.tasks.shapes import build_shapes
from grpo.tiny import vlm
from tests.conftest import compose_cfg, measured


@pytest.fixture(scope="module")
def tiny_vlm():
    """A randomly initialised tiny Qwen2-VL, its char tokenizer carrying the image processor."""
    from grpo.config import TinyModelConfig
    from grpo.tiny.text import build_char_tokenizer

    tok = build_char_tokenizer()
    model = vlm.build_tiny_vlm(TinyModelConfig(), tok)
    tok.vision = vision.ImageReader(vlm.tiny_image_processor(), model.config)
    return model.float().eval(), tok


@pytest.fixture(scope="module")
def task():
    return build_shapes(SimpleNamespace(size=64, seed=3, eval_size=8, chat_template="auto", system_prompt=None))


@pytest.fixture(scope="module")
def samples(task):
    """Shapes samples, one of each image size (56x56, 84x56, 56x84: 4, 6, 6 image tokens)."""
    by_size = {}
    for s in task.train:
        by_size.setdefault(s.meta["images"][0].size, s)
    assert len(by_size) == 3
    return list(by_size.values())


def test_mrope_positions_by_value():
    """text, one 2x2 image (grid 1x4x4 before the 2x2 merge), text: positions worked out by hand."""
    image = 7
    ids = [1, image, image, image, image, 5, 6]
    got = vision.mrope_positions(ids, image, torch.tensor([[1, 4, 4]]), merge=2)
    assert got.tolist() == [[0, 1, 1, 1, 1, 3, 4],   # frame: the image's start, then text from max + 1
                            [0, 1, 1, 2, 2, 3, 4],   # row
                            [0, 1, 2, 1, 2, 3, 4]]   # column


def test_mrope_positions_match_the_models_own(tiny_vlm, samples):
    """Two images of different sizes in one prompt: the same positions as Qwen2-VL's get_rope_index."""
    model, tok = tiny_vlm
    two = SimpleNamespace(prompt="which?", answer="", meta={"images": [samples[1].meta["images"][0],
                                                                      samples[2].meta["images"][0]]})
    prompt = vision.encode_image_prompt(tok, tok.vision.image_processor, model.config, two)
    ids = torch.tensor([list(prompt)])
    image_id = vision.image_token_id(model.config)
    theirs, _ = vision.vision_module(model).get_rope_index(ids, mm_token_type_ids=(ids == image_id).int(),
                                                           image_grid_thw=prompt.vision.image_grid_thw)
    assert sorted(prompt.vision.image_grid_thw.tolist()) == [[1, 4, 6], [1, 6, 4]]  # 56x84 and 84x56
    assert torch.equal(prompt.vision.rope_3P, theirs[:, 0])


def sample_and_collate(model, tok, samples, n=2, seed=0):
    """The hf sampler's rollouts for `samples` (n each), what its `generate` was given, and the batch."""
    prompts = encode_prompts(tok, samples)
    given = {}
    generate = model.generate

    def spy(**kwargs):
        given.update(kwargs)
        return generate(**kwargs)

    model.generate = spy
    try:
        rollouts = HFBackend(None, model, tok).generate(prompts, n, Sampling(max_new_tokens=6, temperature=1.0, seed=seed))
    finally:
        del model.generate
    batch = collate([p for p in prompts for _ in range(n)], rollouts, torch.zeros(len(prompts) * n), tok.pad_token_id, False)
    return prompts, given, rollouts, batch


def test_the_trainer_gets_the_samplers_pixels_and_token_ids_in_the_packed_layout(tiny_vlm, samples):
    """Images of three sizes, two completions each, packed into rows: the pixels the trainer's vision
    tower is given, sequence by sequence, are the ones the sampler's generate was given for that
    sequence's row, and so are the token ids (prompt as sampled, then the completion); the logprobs
    agree with the sampler's."""
    model, tok = tiny_vlm
    torch.manual_seed(0)
    _, given, rollouts, batch = sample_and_collate(model, tok, samples)
    mb = packed(batch, per_row=3)
    b_mb = mb.batch
    order = list(range(batch.size))  # `packed` keeps the batch's order: sequence k is the sampler's row k

    seen = {}
    inner = vision.vision_module(model)
    features, embed = inner.get_image_features, inner.get_input_embeddings()

    def features_spy(pixel_values, grid, **kw):
        seen["pixels"], seen["grid"] = pixel_values, grid
        return features(pixel_values, grid, **kw)

    def ids_spy(module, args):
        seen["ids"] = args[0]

    inner.get_image_features = features_spy
    hook = embed.register_forward_pre_hook(ids_spy)
    try:
        with torch.no_grad():
            logp_BT, _ = batch_logprobs(model, mb, temperature=1.0)
    finally:
        del inner.get_image_features
        hook.remove()

    # the sampler's rows, one per completion: its pixels split by image (one each), its ids unpadded
    sampler_pixels = torch.split(given["pixel_values"], [int(g.prod()) for g in given["image_grid_thw"]])
    sampler_ids = [row[m.bool()].tolist() for row, m in zip(given["input_ids"], given["attention_mask"])]
    trainer_pixels = torch.split(seen["pixels"], [int(g.prod()) for g in seen["grid"]])
    # the tower runs once per prompt's images (its n completions share them): the first sequence of each
    firsts = [b for k, b in enumerate(order) if all(b_mb.vision[j] is not b_mb.vision[k] for j in range(k))]
    assert len(trainer_pixels) == len(firsts) == len(samples)
    for k, b in enumerate(firsts):  # the batch's b-th sequence is the sampler's row b
        assert torch.equal(trainer_pixels[k], sampler_pixels[b])
        assert torch.equal(seen["grid"][k], given["image_grid_thw"][b])
    assert len({tuple(g) for g in seen["grid"].tolist()}) == 3  # three image sizes
    ids_RW = seen["ids"]
    row_of = [r for r, count in enumerate(mb.groups) for _ in range(count)]
    cols = {r: 0 for r in range(len(mb.groups))}
    for k, b in enumerate(order):
        expect = sampler_ids[b] + rollouts.completion_ids[b]
        r = row_of[k]
        assert ids_RW[r, cols[r] : cols[r] + len(expect)].tolist() == expect
        cols[r] += len(expect)
    assert (logp_BT - b_mb.sampler_logprobs_BT).mul(b_mb.mask_BT).abs().max() < 1e-5


def packed(batch, per_row: int):
    """The whole batch as one packed micro-batch of `per_row` sequences a row (the planner packs rows
    only as wide as the longest sequence, which these short ones seldom share)."""
    rows = [per_row] * (batch.size // per_row) + ([batch.size % per_row] if batch.size % per_row else [])
    return MicroBatch(batch, "packed", rows)


def forced_avx2_on_avx512() -> bool:
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU: torch 2.13's bf16 SDPA with a mask then raises
    "pack_vnni2 is only supported when avx512 is supported" (any model, 64 keys or more)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and "avx512f" in flags


@pytest.mark.parametrize("layout, dtype, tol", [
    ("padded", "float32", 1e-5), ("packed", "float32", 1e-5),
    pytest.param("packed", "bfloat16", 0.1, marks=pytest.mark.skipif(
        forced_avx2_on_avx512(), reason="torch's bf16 SDPA refuses ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU"))])
def test_trainer_logprobs_match_the_samplers(tiny_vlm, task, layout, dtype, tol):
    """The sampled tokens' logprobs under the trainer's forward equal the sampler's, in each layout;
    bf16 as `parallel=single` runs it (fp32 weights, both sides under autocast) within the bf16
    tolerance. Broken on purpose in the same test: with text positions instead of M-RoPE, or the
    images of two rows swapped, they do not."""
    import contextlib
    from dataclasses import replace

    model, tok = tiny_vlm
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext())
    torch.manual_seed(1)
    prompts = encode_prompts(tok, task.train[:8])  # 8 images of 3 sizes: two of one size at least
    rollouts = HFBackend(None, model, tok, dtype=dtype).generate(prompts, 2, Sampling(max_new_tokens=6, seed=1))
    batch = collate([p for p in prompts for _ in range(2)], rollouts, torch.zeros(len(prompts) * 2), tok.pad_token_id, False)
    mb = packed(batch, per_row=4) if layout == "packed" else micro_batches(batch, 10_000, "padded")[0]

    def diff(mb_):
        with torch.no_grad(), autocast:
            return (batch_logprobs(model, mb_, 1.0)[0] - mb.batch.sampler_logprobs_BT).mul(mb.batch.mask_BT).abs().max()

    assert diff(mb) < tol, diff(mb)
    if dtype == "float32":
        text_only = lambda batch: batch.position_ids_BL[None].repeat(3, 1, 1)  # noqa: E731
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(vision, "mrope_BL", text_only)
            assert diff(mb) > 1e-3
        swapped = list(mb.batch.vision)
        first, other = next((i, j) for i, a in enumerate(swapped) for j, b in enumerate(swapped)
                            if a.image_grid_thw.tolist() == b.image_grid_thw.tolist()
                            and not torch.equal(a.pixel_values, b.pixel_values))
        swapped[first], swapped[other] = swapped[other], swapped[first]
        assert diff(replace(mb, batch=replace(mb.batch, vision=swapped))) > 1e-4


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_micro_batch_without_images_still_reaches_the_trained_tower(tiny_vlm, layout):
    """The padding micro-batch a rank adds for ZeRO's lockstep (no image): with the tower training, its
    backward gives every trainable parameter a gradient (0 for the tower's) as an image micro-batch's
    does, so every rank reduces the same buckets (ZeRO-2 crashed on 2 ranks without it: gloo "Received
    data size doesn't match expected size"); its logprobs are the text model's exactly. Frozen, or
    under no_grad, the tower does not run."""
    import copy

    from grpo.update.layouts import padding

    model = copy.deepcopy(tiny_vlm[0]).train()
    mb = padding(layout)
    logp_BT, _ = batch_logprobs(model, mb, 1.0)
    logp_BT.sum().backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n, p in trainable if p.grad is None] == []
    tower = [p for n, p in trainable if vision.is_vision_parameter(n)]
    assert tower and all(float(p.grad.abs().max()) == 0.0 for p in tower)
    calls, inner = [], vision.vision_module(model)
    real = inner.get_image_features
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inner, "get_image_features", lambda *a, **k: calls.append(1) or real(*a, **k))
        with torch.no_grad():
            assert torch.equal(batch_logprobs(model, mb, 1.0)[0], logp_BT.detach())
        vision.freeze_vision(model)
        assert torch.equal(batch_logprobs(model, mb, 1.0)[0].detach(), logp_BT.detach())
    assert calls == []


def test_a_text_model_on_an_image_task_is_refused(tiny_lm, samples):
    from grpo.errors import ConfigError

    _, tok = tiny_lm
    with pytest.raises(ConfigError, match="vision-language model"):
        encode_prompts(tok, samples)


def test_an_image_task_on_a_known_text_model_is_refused_before_any_build(tmp_path):
    """task=shapes with the default model=tiny warm-started a text model on image prompts for over 14
    minutes without an error. The run's check of task against model refuses it; a VLM, or a hub id whose
    config is not known yet (the load refuses it: encode_prompts), passes."""
    from grpo.config import known_model_config
    from grpo.errors import ConfigError
    from grpo.tiny.folders import check_task_model

    def check(*overrides):
        cfg = compose_cfg("task=shapes", *overrides)
        check_task_model(cfg, known_model_config(cfg.model))

    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 4}))
    for model in (["model=tiny"], ["model=tiny_moe"], ["model=smollm2-135m"], ["model=hub", f"model.path={text}"]):
        with pytest.raises(ConfigError, match=r"^task=shapes draws image prompts: use a vision-language model "
                                              r"\(model=tiny_vlm, or a hub VLM"):
            check(*model)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"vision_config": {"depth": 1}, "text_config": {}}))
    for model in (["model=tiny_vlm"], ["model=hub", f"model.path={vlm}"], ["model=hub", "model.path=some-org/not-cached"]):
        check(*model)


@pytest.mark.parametrize("override, match", [("parallel=zero2 parallel.sequence_parallel=2", "split rows"),
                                             ("env=retry", "multi-turn")])
def test_what_a_vlm_does_not_run_is_refused(make_cfg, override, match):
    from grpo.config import validate
    from grpo.errors import ConfigError

    cfg = make_cfg("model=tiny_vlm", "task=shapes", *override.split())
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=2 if "sequence_parallel" in override else 1)


def short_run_cfg(make_cfg, *overrides):
    """A few steps of the tiny VLM on 256 shapes: a short warm start, so some completions earn a reward,
    and temperature 0.5, so the half-trained policy's samples are not all wrong."""
    return make_cfg(*SHORT_RUN, *overrides)


SHORT_RUN = ["model=tiny_vlm", "task=shapes", "task.size=256", "task.eval_size=16", "model.tiny.warm_start_accuracy=0.02",
             "model.tiny.warm_start_check_every=10", "rollout.max_new_tokens=16", "rollout.temperature=0.5"]


def sampler_diffs(run_dir) -> list[float]:
    return [r["sampler_diff"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "sampler_diff" in r]


def worst(diffs: list[float]) -> float:
    """The largest measured difference (a step of flat groups measured none: NaN); one step must have."""
    return max(measured([{"sampler_diff": d} for d in diffs]))


@pytest.mark.starts_process
@pytest.mark.parametrize("lora", [0, 4])
def test_a_short_run_trains_the_language_model_only(make_cfg, tmp_path, lora):
    """A few GRPO steps through hf: the sampler and the trainer agree every step; the vision tower is
    frozen (model.freeze_vision) and stays as the folder had it; the exported folder loads back as a
    VLM with its image processor."""
    from grpo.models import load_model
    from grpo.tiny.warm_start import tiny_model_dir
    from grpo.train import train

    cfg = short_run_cfg(make_cfg, f"model.lora.rank={lora}")
    train(cfg)
    diffs = sampler_diffs(tmp_path / "run")
    assert len(diffs) == cfg.steps and worst(diffs) < 1e-3, diffs
    exported, tok = load_model(str(tmp_path / "run" / "model"))
    assert vision.is_vision_model(exported) and tok.vision is not None
    base, _ = load_model(tiny_model_dir(cfg.model, cfg.task, cfg.rollout.max_new_tokens))
    before, after = base.state_dict(), exported.state_dict()
    visual = [k for k in before if vision.is_vision_parameter(k)]
    assert visual and all(torch.equal(after[k], before[k]) for k in visual)
    if lora == 0:
        assert any(not torch.equal(after[k], before[k]) for k in before if not vision.is_vision_parameter(k)), \
            "the language model did not train"


@pytest.mark.starts_process
# slow: zero2 with a trained tower (a micro-batch without images still reaching it: test_a_micro_batch_without_images_still_reaches_the_trained_tower)
@pytest.mark.parametrize("parallel, freeze", [pytest.param("zero2", "false", marks=pytest.mark.slow), ("zero3", "true")])
def test_two_ranks_under_zero_with_images(tmp_path, cache_dir, parallel, freeze):
    """ZeRO-2 with the tower training, ZeRO-3 with it frozen, on 2 processes: the ranks' micro-batches
    differ (one runs a padding micro-batch without an image), yet every rank makes the same collectives
    (ZeRO-2's gradient buckets, ZeRO-3's gathers of the tower, hf's synced generate); the sampler and
    trainer agree, and the tower's weights move only when it trains."""
    from safetensors.torch import load_file

    from grpo.tiny.warm_start import tiny_model_dir
    from tests.conftest import FAST
    from tests.test_parallel import TORCHRUN, run

    # a collective that never matches fails in 90 s (gloo's timeout), not in the default 30 min
    overrides = [*FAST, *SHORT_RUN, f"model.freeze_vision={freeze}", f"parallel={parallel}", "parallel.collective_timeout_s=90"]
    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *overrides,
         f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    diffs = sampler_diffs(tmp_path)
    assert len(diffs) == 3 and worst(diffs) < 1e-3, diffs
    cfg = compose_cfg(*overrides, cache=cache_dir)
    before = load_file(os.path.join(tiny_model_dir(cfg.model, cfg.task, cfg.rollout.max_new_tokens), "model.safetensors"))
    after = load_file(tmp_path / "model" / "model.safetensors")
    tower = [k for k in before if vision.is_vision_parameter(k)]
    moved = [k for k in tower if not torch.equal(after[k], before[k])]
    assert tower and (moved == [] if freeze == "true" else moved), moved


def _images_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as tdist

    from grpo.rollout.hf import check_images_on_every_rank

    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    check_images_on_every_rank(True)  # both ranks have images: nothing to say
    try:
        check_images_on_every_rank(rank == 0)
        said = ""
    except RuntimeError as e:
        said = str(e)
    open(f"{out_dir}/said{rank}", "w").write(said)
    tdist.destroy_process_group()


@pytest.mark.starts_process
def test_zero3_generate_with_images_on_some_ranks_only_stops_every_rank(tmp_path):
    """rollout=hf under ZeRO-3 generates on the training model, a collective: where one rank has image
    prompts and another none, both raise the same error (instead of hanging in the tower's gathers)."""
    import torch.multiprocessing as mp

    mp.spawn(_images_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    said = [(tmp_path / f"said{r}").read_text() for r in (0, 1)]
    assert said[0] == said[1] and "some ranks had image prompts" in said[0]


@pytest.mark.parametrize("freeze", [True, False])
def test_a_sync_sends_the_vision_tower_only_when_it_trains(freeze):
    """model.freeze_vision: the engines get the language model's weights alone (they keep the vision
    tower they loaded); unfrozen, every weight. The export always holds every weight."""
    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig, TinyModelConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.tiny.text import build_char_tokenizer

    model = vlm.build_tiny_vlm(TinyModelConfig(), build_char_tokenizer())
    if freeze:
        assert vision.freeze_vision(model) > 0
    strategy = SingleStrategy(None, model, OmegaConf.structured(AlgoConfig()), total_steps=1)
    synced = [name for bucket in strategy.weight_buckets(1 << 20) for name, _ in bucket]
    exported = [name for bucket in strategy.export_buckets(1 << 20) for name, _ in bucket]
    visual = [n for n in exported if vision.is_vision_parameter(n)]
    assert visual and any("language_model" in n for n in synced)
    assert (not set(visual) & set(synced)) if freeze else set(visual) <= set(synced)
    assert len(exported) == len(list(model.named_parameters(remove_duplicate=False)))


@pytest.mark.starts_process
def test_a_short_run_through_colocated_vllm(make_cfg, tmp_path):
    """Image prompts through a colocated vLLM engine (one placeholder per image, expanded by vLLM's own
    Qwen2-VL processor to the trainer's ids, checked every batch): sampler and trainer agree after
    every sync of the language model's weights, and evaluation after the syncs runs (the encoder
    cache reset with them)."""
    from grpo.train import train

    cfg = short_run_cfg(make_cfg, "rollout=colocated")
    train(cfg)
    diffs = sampler_diffs(tmp_path / "run")
    assert len(diffs) == cfg.steps and worst(diffs) < 1e-3, diffs
    assert sum("eval/accuracy" in r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))) == 2


@pytest.mark.starts_process
def test_a_short_run_through_a_dedicated_vllm_server(make_cfg, tmp_path, monkeypatch):
    """Image prompts through a vLLM server (rollout=dedicated; remote sends the same requests): one
    token-in-token-out request per prompt, its images as PNG content parts, the ids the server expanded
    checked against the trainer's on every request; sampler and trainer agree after every push, and
    evaluation after the pushes runs. Every push resets the server's encoder cache (`ServerPool.reset_caches`,
    seen on the real requests: the encoder's outputs under the old weights are stale), as the colocated
    plan does (`update_plan`): decided from the model, before any image request too."""
    from grpo.endpoints import Server
    from grpo.train import train

    sent, request = [], Server.request
    monkeypatch.setattr(Server, "request", lambda self, path, *a, **kw: sent.append(path) or request(self, path, *a, **kw))
    cfg = short_run_cfg(make_cfg, "rollout=dedicated", "rollout.vllm.memory_fraction=0.1", "steps=3")
    train(cfg)
    pushes = [i for i, path in enumerate(sent) if path == "/finish_weight_update"]
    assert any("/inference/v1/generate" in sent[:i] for i in pushes), sent  # pushes after image requests
    assert pushes and all("/reset_encoder_cache" in sent[i:i + 3] for i in pushes), sent
    diffs = sampler_diffs(tmp_path / "run")
    records = list(map(json.loads, open(tmp_path / "run" / "metrics.jsonl")))
    assert len(diffs) == cfg.steps and worst(diffs) < 1e-3, diffs
    assert sum("eval/accuracy" in r for r in records) == 2


def test_an_image_prompt_goes_to_a_server_with_one_placeholder_per_image_and_its_pixels(tiny_vlm, samples):
    import base64
    import io

    from PIL import Image

    model, tok = tiny_vlm
    prompt = encode_prompts(tok, samples[:1])[0]
    body = vision.server_prompt(prompt)
    image_id = prompt.vision.image_token_id
    assert body["token_ids"].count(image_id) == len(prompt.vision.images) == len(body["content_parts"])
    assert [t for t in body["token_ids"] if t != image_id] == [t for t in prompt if t != image_id]
    for part, image in zip(body["content_parts"], prompt.vision.images):
        head, data = part["url"].split(",", 1)
        assert part["type"] == "image_url" and head == "data:image/png;base64"
        back = Image.open(io.BytesIO(base64.b64decode(data)))
        assert back.size == image.size and back.tobytes() == image.convert(back.mode).tobytes()


def test_a_vlm_engine_drops_its_encoder_cache_with_new_weights():
    from grpo.rollout.colocated import SleepState, update_plan

    assert update_plan(SleepState(), lora=False, images=True)[-2:] == [("reset_prefix_cache", None),
                                                                      ("reset_encoder_cache", None)]
    assert ("reset_encoder_cache", None) not in update_plan(SleepState(), lora=False)


def test_a_chat_template_gets_one_image_part_per_image(tiny_vlm, samples):
    """With a chat template, the prompt is a user message of image parts then the text part, rendered
    by the template (here a minimal one in Qwen2-VL's form), and each placeholder is still expanded."""
    import copy

    model, tok = tiny_vlm
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{% for part in m.content %}"
                         "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                         "{% else %}{{ part.text }}{% endif %}{% endfor %}\n{% endfor %}<|assistant|>")
    assert format_prompt(tiny_vlm[1], "q", system_prompt="s", images=2, plain_image="<i>") == ("s\n\n<i><i>q", False)
    text, templated = format_prompt(tok, "what is it?", images=2, plain_image="<image>")
    assert templated and text == ("<|user|><|vision_start|><|image_pad|><|vision_end|>"
                                  "<|vision_start|><|image_pad|><|vision_end|>what is it?<|assistant|>")  # trim_blocks
    prompt = encode_prompts(tok, samples[:1])[0]
    image_id = vision.image_token_id(model.config)
    assert sum(t == image_id for t in prompt) == vision.tokens_per_image(prompt.vision.image_grid_thw, 2)[0] == 4


def test_an_empty_or_non_rgb_image_is_refused_or_converted_once(tiny_vlm, samples):
    """Issue 46 item 5: an empty image stopped deep in the image processor (ZeroDivisionError); a
    grayscale, palette or 16-bit image is converted to RGB once, so the trainer and the engines see the
    same pixels; anything but a PIL image is refused with what a sample must hold."""
    from PIL import Image

    model, tok = tiny_vlm
    encode = lambda images: vision.encode_image_prompt(tok, tok.vision.image_processor, model.config,  # noqa: E731
                                                       SimpleNamespace(prompt="which?", answer="", meta={"images": images}))
    for size in [(0, 0), (56, 0)]:
        with pytest.raises(ValueError, match=rf"image 0 of the prompt 'which\?' is {size[0]}x{size[1]} pixels"):
            encode([Image.new("RGB", size)])
    with pytest.raises(ValueError, match="is a str: a sample's meta\\['images'\\] holds PIL images"):
        encode(["shape.png"])
    rgb = samples[0].meta["images"][0]
    for mode in ("L", "P", "RGBA", "I;16"):
        other = rgb.convert(mode)
        prompt = encode([other])
        assert [im.mode for im in prompt.vision.images] == ["RGB"]
        torch.testing.assert_close(prompt.vision.pixel_values, encode([other.convert("RGB")]).vision.pixel_values)


def test_a_frozen_tower_is_never_sent_so_a_sleeping_engine_keeps_it(tiny_vlm):
    """model.freeze_vision (the default) leaves the tower out of every sync: the engine keeps what it
    loaded. Sleep at level 2 discarded it (vLLM wakes weights as uninitialised memory and its reload
    keeps a layer no weight reached, with a log line), so every image after the first sync was encoded
    by garbage. The colocated engine sleeps at level 1 where `unsent_parameters` names any."""
    import copy

    from grpo.rollout.colocated import SleepState, sleep_plan
    from grpo.weights import engine_parameters, unsent_parameters

    model = copy.deepcopy(tiny_vlm[0])
    for p in model.parameters():
        p.requires_grad_(True)
    assert unsent_parameters(model.named_parameters()) == []  # the tower trains: every weight is sent
    vision.freeze_vision(model)
    unsent = unsent_parameters(model.named_parameters())
    assert unsent and all(vision.is_vision_parameter(n) for n in unsent)
    sent = [n for n, _ in engine_parameters(model.named_parameters())]
    assert sorted(sent + unsent) == sorted(n for n, _ in model.named_parameters())
    assert sleep_plan(SleepState(), enabled=True, unsent=bool(unsent)) == [("sleep", 1)]


def test_the_trainer_loads_the_image_processor_vllm_loads():
    """vLLM loads a VLM's processor with no backend: transformers' torchvision one wherever torchvision
    imports (a GPU install), whose resize differs from PIL's. The trainer took PIL always, so on a GPU
    the two would see different pixels for any image that needs resizing; PIL only without torchvision."""
    from grpo.vision import processor_backend

    assert processor_backend(torchvision=True) == {} and processor_backend(torchvision=False) == {"backend": "pil"}
