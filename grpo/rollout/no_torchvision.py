"""Qwen2-VL in vLLM without torchvision (the CPU build here cannot load PyPI's, which is built for
CUDA torch): installed by the project's vLLM plugin (setup.cfg `vllm.general_plugins`) in every
vLLM process, the model-inspection subprocess included; does nothing where torchvision imports.

Three gaps, each filled with transformers' own pieces:
- vLLM's qwen2_vl.py imports `smart_resize` from transformers' torchvision image processor module:
  the PIL one (`image_processing_pil_qwen2_vl`, the same function) stands in for that module;
- `Qwen2VLProcessor` checks its video processor's class against transformers' top-level
  `VideoProcessorMixin`, which a torchvision-less transformers does not export there: it is set;
- `AutoVideoProcessor` gives a torchvision-only placeholder: a video processor with the image
  processor's patch sizes stands in, and refuses any video it is given.
Images only: `rollout.vllm` engines of a VLM take no video (limit_mm_per_prompt video 0)."""

from __future__ import annotations

import importlib
import sys


def install() -> None:
    try:
        # transformers: here, not at the top: its absence is checked
        from transformers.utils import is_torchvision_available
    except ImportError:
        return
    if is_torchvision_available():
        return
    from transformers import processing_utils  # transformers: heavy; vLLM's plugin and grpo.rollout import this module
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl
    from transformers.video_processing_utils import VideoProcessorMixin

    sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl", image_processing_pil_qwen2_vl)
    processing_utils.transformers_module.VideoProcessorMixin = VideoProcessorMixin

    class NoVideoProcessor(VideoProcessorMixin):
        patch_size, temporal_patch_size, merge_size = 14, 2, 2
        size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}

        def preprocess(self, videos, **kwargs):
            raise ValueError("video inputs need torchvision, which this machine's torch cannot load; send images")

    class AutoVideoProcessor:
        @classmethod
        def from_pretrained(cls, path, *args, **kwargs):
            # transformers: heavy; vLLM's plugin and grpo.rollout import this module
            from transformers import AutoImageProcessor

            image = AutoImageProcessor.from_pretrained(path)
            video = NoVideoProcessor()
            for key in ("patch_size", "temporal_patch_size", "merge_size"):
                setattr(video, key, getattr(image, key))
            return video

    # a plain `from transformers.models.auto import video_processing_auto` gives a lazy placeholder
    importlib.import_module("transformers.models.auto.video_processing_auto").AutoVideoProcessor = AutoVideoProcessor
