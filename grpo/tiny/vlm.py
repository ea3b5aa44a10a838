"""The tiny vision-language model (`model.path=tiny_vlm`): a Qwen2-VL of the tiny text model's sizes
with a one-block vision tower, and the batches and greedy check its warm start (grpo/tiny/warm_start.py)
trains and measures it with on image prompts (task=shapes). How an image reaches a model is
grpo/vision.py's; this is only the embedded model."""

from __future__ import annotations

import torch

from grpo import vision

TINY_VLM_FORMAT = 2  # bump when the tiny VLM's recipe changes (2: <|video_pad|> in its vocabulary)

TINY_IMAGE_PIXELS = (28 * 28 * 4, 28 * 28 * 16)  # the embedded VLM's image budget: 4 to 16 merged patches


def build_tiny_vlm(tiny, tokenizer):
    """A Qwen2-VL of `tiny`'s language model sizes (M-RoPE sections for its head dim) with a one-block
    vision tower (patch 14, merge 2); the tokenizer gains the three vision tokens first."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration  # local: heavy; grpo.config imports this module

    tokens = [vision.VISION_START, vision.IMAGE_PAD, vision.VISION_END, vision.VIDEO_PAD]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    start, pad, end, video = tokenizer.convert_tokens_to_ids(tokens)
    half = tiny.head_dim // 2
    sections = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]  # 32 -> [4, 6, 6], as Qwen2-VL's 128 -> [16, 24, 24]
    torch.manual_seed(tiny.seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                         num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                         num_key_value_heads=tiny.num_heads, head_dim=tiny.head_dim, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True),
        vision_config=dict(depth=1, embed_dim=64, hidden_size=tiny.hidden_size, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return Qwen2VLForConditionalGeneration(config)


def tiny_image_processor():
    from transformers import Qwen2VLImageProcessorPil  # local: heavy (as above)

    low, high = TINY_IMAGE_PIXELS
    return Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high, patch_size=14, merge_size=2, temporal_patch_size=2)


def supervised_batch(tokenizer, samples) -> dict:
    """input_ids, attention_mask, labels (on answer + <eos>), pixels and M-RoPE inputs for prompt
    (with its images) + answer + <eos>, right padded: the model's own forward takes them."""
    reader = tokenizer.vision
    prompts = [vision.encode_image_prompt(tokenizer, reader.image_processor, reader.config, s) for s in samples]
    rows, labels = [], []
    for p, s in zip(prompts, samples):
        answer = list(tokenizer(s.answer, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
        rows.append(list(p) + answer)
        labels.append([-100] * len(p) + answer)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    return {"input_ids": ids,
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
            "mm_token_type_ids": (ids == vision.image_token_id(reader.config)).int(),
            **vision.generate_inputs(prompts)}


@torch.no_grad()
def greedy_accuracy(model, tokenizer, samples, max_new_tokens: int, batch_size: int = 128) -> float:
    """Exact-match accuracy of greedy completions of image prompts (the warm start's check)."""
    reader = tokenizer.vision
    model.eval()
    correct = 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        prompts = [vision.encode_image_prompt(tokenizer, reader.image_processor, reader.config, s) for s in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == vision.image_token_id(reader.config)).int(),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             **vision.generate_inputs(prompts))
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        correct += sum(t.strip() == s.answer for t, s in zip(texts, chunk))
    model.train()
    return correct / len(samples)
