"""Image prompts for vision-language models (the Qwen2-VL / Qwen2.5-VL family): one home for how an
image reaches the sampler and the trainer alike.

A prompt with images is its token ids with each image's placeholder already expanded (one
`<|image_pad|>` per merged patch, as the model's processor writes them) and the pixels the model's
image processor made of the images (`VisionInputs`). `ImagePrompt` is such a list of ids carrying its
`VisionInputs`, so every place that passes prompt ids (the rollout backends, `collate`) passes the
images with them; the Batch keeps them per row (`Batch.vision`).

The trainer's forward builds the language model's input embeddings itself: the token embeddings,
with the vision tower's output written over the prompt's image placeholders (never over a sampled
token, even one that happens to be the placeholder's id), and the M-RoPE position ids of each
sequence (`mrope_positions`: text positions for text, temporal/height/width for an image's tokens,
the completion running on from the prompt's largest position), prepended by the plain text
positions transformers builds the attention mask from. The padded and packed layouts take them
(packed: each sequence's positions restart in its row, grpo/update/layouts.py `pack(carry_KBL=...)`); the
shared-prompt layout is not built for images, so a VLM runs packed where it is asked for shared
(grpo/update/support.py).
"""

from __future__ import annotations

import base64
import io
import warnings
from dataclasses import dataclass

import PIL.Image
import torch

from grpo.errors import ConfigError
from grpo.prompts import format_prompt

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"  # the tiny VLM takes no video, but vLLM's Qwen2-VL processor looks the token up


@dataclass
class VisionInputs:
    """One prompt's images as the model takes them."""

    pixel_values: torch.Tensor  # (patches, channels x temporal x patch x patch), the image processor's
    image_grid_thw: torch.Tensor  # (images, 3): each image's grid of patches (before merging)
    images: list  # the images in RGB (checked_images), for engines that run their own processor
    rope_3P: torch.Tensor  # the prompt's M-RoPE positions (3, P)
    image_token_id: int  # the placeholder's id


class ImagePrompt(list):
    """A prompt's token ids (image placeholders expanded) that carries its images (`vision`)."""

    def __init__(self, ids, vision: VisionInputs):
        super().__init__(ids)
        self.vision = vision


def vision_of(prompt) -> VisionInputs | None:
    return getattr(prompt, "vision", None)


def is_vision_model(model_or_config) -> bool:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "vision_config", None) is not None


def image_token_id(config) -> int:
    return int(config.image_token_id)


def merge_size(config) -> int:
    return int(config.vision_config.spatial_merge_size)


def tokens_per_image(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """How many placeholder tokens each image of `grid_thw` (images, 3) takes: its patches / merge^2."""
    return [int(t * h * w) // (merge * merge) for t, h, w in grid_thw.tolist()]


def mrope_positions(ids: list[int], image_id: int, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(3, len(ids)) M-RoPE position ids of one unpadded sequence, as Qwen2-VL's `get_rope_index`
    gives them: a text token at the next position on all three axes; an image's tokens at the
    position where the image starts plus (frame, row, column) of its merged patch grid; the text
    after an image from the largest position so far + 1 (tests compare with the model's own)."""
    out = torch.empty((3, len(ids)), dtype=torch.long)
    grids = [tuple(g) for g in grid_thw.tolist()]
    nxt, image, i = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_id:
            out[:, i] = nxt
            nxt, i = nxt + 1, i + 1
            continue
        if image >= len(grids):
            raise ValueError(f"a prompt has more image placeholder runs than its {len(grids)} image(s)")
        t, h, w = grids[image]
        h, w = h // merge, w // merge
        n = t * h * w
        frames = torch.arange(t).repeat_interleave(h * w)
        rows = torch.arange(h).repeat_interleave(w).repeat(t)
        cols = torch.arange(w).repeat(t * h)
        out[:, i : i + n] = torch.stack([frames, rows, cols]) + nxt
        nxt = int(out[:, i : i + n].max()) + 1
        i, image = i + n, image + 1
    if image != len(grids):
        raise ValueError(f"a prompt has {image} image placeholder run(s) for {len(grids)} image(s)")
    return out


def checked_images(sample) -> list:
    """A sample's images, each a PIL image of at least one pixel, in RGB. Another mode is converted here,
    once, so the trainer's processor and the engine (vLLM's own conversion, or a PNG sent to a server)
    see the same pixels; an empty image stopped deep in the image processor (ZeroDivisionError)."""
    out = []
    for i, image in enumerate(sample.meta["images"]):
        if not isinstance(image, PIL.Image.Image):
            raise ValueError(f"image {i} of the prompt {sample.prompt!r} is a {type(image).__name__}: a sample's "
                             f"meta['images'] holds PIL images (PIL.Image.open(path))")
        if image.width == 0 or image.height == 0:
            raise ValueError(f"image {i} of the prompt {sample.prompt!r} is {image.width}x{image.height} pixels: "
                             f"an empty image has nothing to encode; drop it (or the sample) from the data")
        out.append(image if image.mode == "RGB" else image.convert("RGB"))
    return out


def encode_image_prompt(tokenizer, image_processor, config, sample, chat_template: str = "auto",
                        system_prompt: str | None = None) -> ImagePrompt:
    """The token ids of a sample with images (`sample.meta["images"]`), every placeholder expanded to
    its image's token count, with the image processor's pixels and the prompt's M-RoPE positions."""
    images = checked_images(sample)
    text, templated = format_prompt(tokenizer, sample.prompt, chat_template, system_prompt, len(images),
                                    VISION_START + IMAGE_PAD + VISION_END)
    ids = tokenizer(text, add_special_tokens=not templated).input_ids
    image_id = image_token_id(config)
    if sum(t == image_id for t in ids) != len(images):  # checked before expanding, which would stop short
        raise ValueError(f"the prompt text of {sample.prompt!r} holds {sum(t == image_id for t in ids)} image "
                         f"placeholder(s) for {len(images)} image(s); check the chat template")
    pixels = image_processor(images=images, return_tensors="pt")
    grid = pixels["image_grid_thw"]
    counts = iter(tokens_per_image(grid, merge_size(config)))
    expanded = []
    for token in ids:
        expanded += [token] * next(counts) if token == image_id else [token]
    rope = mrope_positions(expanded, image_id, grid, merge_size(config))
    return ImagePrompt(expanded, VisionInputs(pixels["pixel_values"], grid, images, rope, image_id))


def is_vlm_setting(path: str, model_config: dict) -> bool:
    """Whether model.path names a vision-language model as validate knows it, before any load: the tiny
    VLM, or a config.json with a vision_config (`model_config`: grpo.config.known_model_config)."""
    return path == "tiny_vlm" or bool(model_config.get("vision_config"))


def check_config(cfg, model_config: dict) -> None:
    """What a vision-language model (model=tiny_vlm, or a folder/hub id whose config.json has a
    vision_config) runs with: one-turn tasks, no sequence split (docs/vlm.md); called by grpo.config.validate."""
    images = cfg.rollout.get("vllm", {}).get("images_per_prompt", 1)
    if not is_vlm_setting(cfg.model.path, model_config):
        if images != 1:  # read for a vision-language model only (vLLM's limit_mm_per_prompt)
            raise ConfigError(f"rollout.vllm.images_per_prompt={images} is read for a vision-language model only; "
                              f"model.path={cfg.model.path} has no vision_config. Drop the setting.")
        return
    if images < 1:
        raise ConfigError(f"rollout.vllm.images_per_prompt={images} must be >= 1 (the images a prompt may carry).")
    why = None
    if cfg.env.name != "none":
        why = f"env={cfg.env.name}: multi-turn episodes do not carry images"
    elif cfg.parallel.sequence_parallel > 1:
        why = "parallel.sequence_parallel > 1: split rows do not carry images"
    if why:
        raise ConfigError(f"model.path={cfg.model.path} is a vision-language model; {why}. Use env=none and "
                          "parallel.sequence_parallel=1.")


# --------------------------------------------------------------------------------------------------
# The trainer's side: position ids and input embeddings of a micro-batch


def mrope_BL(batch) -> torch.Tensor:
    """(3, B, L) M-RoPE positions of a padded batch (prompt left-padded to `prompt_width`, completion
    after it): each row's prompt positions, then its completion's running on from the prompt's
    largest + 1; padding keeps the batch's text positions."""
    pos = batch.position_ids_BL.to("cpu")
    out = pos[None].repeat(3, 1, 1)
    P = batch.prompt_width
    lengths = batch.attention_mask_BL.to("cpu").sum(dim=1).tolist()
    for b, v in enumerate(batch.vision or []):
        if v is None:
            continue
        p = v.rope_3P.shape[1]
        c = lengths[b] - p
        out[:, b, P - p : P] = v.rope_3P
        out[:, b, P : P + c] = int(v.rope_3P.max()) + 1 + torch.arange(c)
    return out


def image_slots_BL(batch, config) -> torch.Tensor:
    """(B, L) bool: the prompt's image placeholders, where the vision tower's output goes (a sampled
    token with the placeholder's id stays a token)."""
    ids = batch.input_ids_BL.to("cpu")
    slots = ids == image_token_id(config)
    slots[:, batch.prompt_width :] = False
    return slots


def vision_module(model):
    """The module that holds `get_image_features` and the embeddings (Qwen2VLModel), under any wrapper."""
    for module in model.modules():
        if hasattr(module, "get_image_features") and hasattr(module, "language_model"):
            return module
    raise ValueError(f"{type(model).__name__} has no vision tower (get_image_features)")


def input_embeddings(model, ids: torch.Tensor, slots: torch.Tensor, vision: list) -> torch.Tensor:
    """Token embeddings of `ids`, the vision tower's output for the images of `vision` (in order)
    written over `slots` (the same order: row-major through the rows)."""
    inner = vision_module(model)
    embeds = inner.get_input_embeddings()(ids)
    present = [v for v in vision or [] if v is not None]
    if not present:
        return embeds + 0.0 * blank_image_features(inner) if tower_must_run(inner) else embeds
    # the G completions of a prompt share its VisionInputs: the tower runs once per prompt's images
    unique = list({id(v): v for v in present}.values())
    device = ids.device
    pixels = torch.cat([v.pixel_values for v in unique]).to(device)
    grid = torch.cat([v.image_grid_thw for v in unique]).to(device)
    out = inner.get_image_features(pixels.to(inner.visual.dtype if hasattr(inner, "visual") else embeds.dtype), grid,
                                   return_dict=True)
    per_image = list(out.pooler_output)  # one (tokens, hidden) per image, in `unique`'s order
    first, at = {}, 0
    for v in unique:
        first[id(v)] = at
        at += v.image_grid_thw.shape[0]
    features = torch.cat([per_image[first[id(v)] + k] for v in present for k in range(v.image_grid_thw.shape[0])],
                         dim=0).to(embeds.dtype)
    if int(slots.sum()) != features.shape[0]:
        raise ValueError(f"{int(slots.sum())} image placeholder tokens for {features.shape[0]} image features: the "
                         "prompt's token ids and its images disagree")
    return embeds.masked_scatter(slots.to(device)[..., None].expand_as(embeds), features)


def tower_must_run(inner) -> bool:
    """Whether a micro-batch without images must still run the vision tower, so that every rank makes
    the same collectives whatever its micro-batch (a padding one, or text prompts only) holds: under
    ZeRO-3 (every forward of the tower gathers its parameters from all ranks), and while the tower
    trains (ZeRO-2 reduces gradients in buckets as their hooks fire: a rank whose micro-batch skipped
    the tower sent other buckets than its peers, gloo "Received data size doesn't match expected size")."""
    params = list(inner.visual.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 partitioned
        return True
    return torch.is_grad_enabled() and any(p.requires_grad for p in params)


def blank_image_features(inner) -> torch.Tensor:
    """The vision tower's output summed over one black image of the smallest grid (one merged token),
    a scalar: added at weight 0 it leaves the embeddings as they were and gives every tower parameter
    a gradient of 0."""
    cfg = inner.config.vision_config
    merge = int(cfg.spatial_merge_size)
    width = int(getattr(cfg, "in_channels", getattr(cfg, "in_chans", 3))) * int(cfg.temporal_patch_size) * int(cfg.patch_size) ** 2
    param = next(inner.visual.parameters())
    pixels = torch.zeros((merge * merge, width), dtype=param.dtype, device=param.device)
    grid = torch.tensor([[1, merge, merge]], device=param.device)
    out = inner.get_image_features(pixels, grid, return_dict=True)
    return sum(f.float().sum() for f in out.pooler_output)


def freeze_vision(model) -> int:
    """Stop gradients to the vision tower (model.freeze_vision); returns how many parameters it holds."""
    inner = vision_module(model)
    frozen = 0
    for p in inner.visual.parameters():
        p.requires_grad_(False)
        frozen += p.numel()
    return frozen


from grpo.weights import is_vision_parameter  # noqa: E402,F401  (a parameter of the vision tower, by name)


# --------------------------------------------------------------------------------------------------
# The sampler's side (transformers `generate`)


def generate_inputs(rows: list) -> dict:
    """What transformers' `generate` needs besides ids and mask for left-padded `rows` (prompts,
    ImagePrompts among them): the pixels and grids of every row's images in row order, and the
    token types (1 on an image placeholder) it builds M-RoPE from."""
    present = [vision_of(r) for r in rows if vision_of(r) is not None]
    if not present:
        return {}
    return {"pixel_values": torch.cat([v.pixel_values for v in present]),
            "image_grid_thw": torch.cat([v.image_grid_thw for v in present])}


def packing_carry(batch, config) -> torch.Tensor:
    """(4, B, L): the M-RoPE positions and the image slots of a padded micro-batch, laid out in rows as
    its tokens are (grpo/update/layouts.py `rows`); the forward builds the input embeddings from them
    (`input_embeddings`) and prepends the text positions (grpo/update/forward.py)."""
    return torch.cat([mrope_BL(batch), image_slots_BL(batch, config).long()[None]])


# --------------------------------------------------------------------------------------------------
# Loading (the embedded tiny VLM and its warm start: grpo/tiny/vlm.py)


@dataclass
class ImageReader:
    """What a VLM's tokenizer carries (`tokenizer.vision`) to turn images into model inputs."""

    image_processor: object
    config: object  # the model's config: image token id, merge size


def processor_backend(torchvision: bool) -> dict:
    """The image processor's `from_pretrained` arguments: the one vLLM loads. vLLM passes no backend,
    so transformers picks the torchvision processor wherever torchvision imports (a GPU install); its
    resize differs from the PIL one (20% of a resized image's uint8 pixels, up to 22 apart), so the
    trainer must take the same. PIL only where torchvision is missing (the CPU here), as vLLM does then."""
    return {} if torchvision else {"backend": "pil"}


def attach(tokenizer, path: str, config) -> None:
    """Give a VLM's tokenizer its folder's image processor, the one vLLM's engines load (`processor_backend`)."""
    # transformers: heavy; grpo.config imports this module
    from transformers import AutoImageProcessor
    from transformers.utils import is_torchvision_available

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            processor = AutoImageProcessor.from_pretrained(path, **processor_backend(is_torchvision_available()))
        except (TypeError, ValueError):  # a transformers without the backend argument
            processor = AutoImageProcessor.from_pretrained(path)
    tokenizer.vision = ImageReader(processor, config)


# --------------------------------------------------------------------------------------------------
# The sampler's side (vLLM engines)


def engine_prompt(prompt: ImagePrompt) -> dict:
    """A vLLM prompt of an ImagePrompt: its ids with each image's placeholder run cut back to one token
    (vLLM expands it itself, and expands an already expanded run again), and its images."""
    image_id = prompt.vision.image_token_id
    ids = [t for i, t in enumerate(prompt) if not (t == image_id and i and prompt[i - 1] == image_id)]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(prompt.vision.images)}}


def image_data_url(image) -> str:
    """A PIL image as a PNG data URL (lossless: the server's processor gets the task's very pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def server_prompt(prompt: ImagePrompt) -> dict:
    """The prompt fields of a vLLM server's token-in-token-out request (`/inference/v1/generate`, behind
    `--enable-scale-out`): the ids with each placeholder run cut back to one token (`engine_prompt`) and
    the images as content parts, which the server's own processor turns into pixels and expands."""
    engine = engine_prompt(prompt)
    return {"token_ids": engine["prompt_token_ids"],
            "content_parts": [{"type": "image_url", "url": image_data_url(im)} for im in engine["multi_modal_data"]["image"]]}


def check_expanded(prompts: list, engine_ids: list) -> None:
    """The prompt ids an engine ran (its placeholders expanded by its own processor) must be the ones
    the trainer scores; a difference (another image budget in the engine's processor, say) is an error."""
    for prompt, ran in zip(prompts, engine_ids):
        if vision_of(prompt) is not None and list(ran) != list(prompt):
            raise RuntimeError(
                f"the engine expanded an image prompt to {len(ran)} tokens, the trainer to {len(prompt)}: the engine's "
                f"image processor and the trainer's disagree (the model folder's preprocessor_config.json is both's)")
