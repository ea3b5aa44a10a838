"""The tiny mixture-of-experts policy (`model.path=tiny_moe`): a Qwen3-MoE of the tiny text model's
width (grpo/tiny/text.py: hidden size, heads, head dim 32, the character tokenizer, tied embeddings)
whose every layer routes each token to `top_k` of `experts` feed-forward experts (`model.tiny.moe`).

Sizes, and why: 4 layers, not the dense model's 2, so a routing flip between sampler and trainer has
layers to reach the completion's logprobs through (routing replay's subject, grpo/moe/); 8 experts, top-2, each expert's intermediate size 256, so a token's active feed-forward
(2 x 256) is the dense model's 512. Warm-started like the dense one (grpo/tiny/warm_start.py), built
deterministically from `model.tiny.seed`. Imports nothing of grpo but the tiny context and its errors.

The dense model's model.tiny.num_layers and intermediate_size shape nothing here (`DENSE_ONLY`): they
are left out of the MoE's cache key (grpo/tiny/warm_start.py) and refused beside it (`check_unread`).
"""

from __future__ import annotations

import torch

from grpo.errors import ConfigError
from grpo.tiny.text import TINY_CONTEXT

TINY_MOE_FORMAT = 1  # bump when the tiny MoE's recipe changes, so old cache entries are not reused
# model.tiny.* fields of the dense tiny model that the MoE does not read -> what it reads instead
DENSE_ONLY = {"num_layers": "model.tiny.moe.layers", "intermediate_size": "model.tiny.moe.moe_intermediate_size"}


def check_unread(tiny, defaults) -> None:
    """Refuse a dense-only model.tiny.* field (`DENSE_ONLY`) set away from its default (`defaults`:
    TinyModelConfig()) for model.path=tiny_moe: it would change neither the model nor its cache folder."""
    given = {k: tiny[k] for k in DENSE_ONLY if tiny[k] != getattr(defaults, k)}
    if given:
        settings = ", ".join(f"model.tiny.{k}={v!r}" for k, v in given.items())
        raise ConfigError(f"{settings} with model.path=tiny_moe: the tiny MoE does not read this (every layer routes, "
                          f"none is dense); drop it, or set {' / '.join(DENSE_ONLY[k] for k in given)}.")


def build_tiny_moe(tiny, vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    """A Qwen3MoeForCausalLM of `tiny`'s width and `tiny.moe`'s layers and experts, seeded by `tiny.seed`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # local: heavy; grpo.config imports grpo.tiny

    moe = tiny.moe
    torch.manual_seed(tiny.seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        num_hidden_layers=moe.layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        head_dim=tiny.head_dim,  # vLLM's CPU attention needs 32 or more
        # a dense layer's (mlp_only_layers): none here, so not model.tiny.intermediate_size (`DENSE_ONLY`);
        # config.json reports a token's active feed-forward, 2 x 256 = the dense model's 512
        intermediate_size=moe.top_k * moe.moe_intermediate_size,
        moe_intermediate_size=moe.moe_intermediate_size,
        num_experts=moe.experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=True,  # the top-k weights sum to 1, as Qwen3-30B-A3B's
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    return Qwen3MoeForCausalLM(config)
