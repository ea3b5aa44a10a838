"""transformers `generate` on the trainer's own module: the CPU default. Weights need no transfer."""

from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig

from grpo import dist
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling
from grpo.weights import WeightBuckets


def base_model(model):
    """The transformers model under a peft wrapper (whose `generate` runs the base model's)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def stop_token_ids(eos_id: int, folder_config) -> list[int]:
    """The tokenizer's EOS, then any further ones the model folder's generation_config.json lists
    (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), as vLLM stops on both."""
    extra = getattr(folder_config, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return [eos_id] + [t for t in extra if t != eos_id]


def generation_config(sampling: Sampling, pad_id: int, stop_ids: list[int]) -> GenerationConfig:
    """Exactly the processing the trainer's logprobs assume: temperature, top-p and top-k (0 = off),
    or greedy; every other logits processor stays off (see `folder_defaults_off`)."""
    greedy = sampling.temperature == 0
    return GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else sampling.temperature,
        top_p=None if greedy else sampling.top_p,
        top_k=None if greedy else sampling.top_k,  # 0 = off (GenerationConfig's default is 50)
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=stop_ids,
        output_scores=True,  # the processed logits the sampler drew from
        return_dict_in_generate=True,
    )


@contextlib.contextmanager
def folder_defaults_off(model):
    """transformers (5.19, `_prepare_generation_config`) fills every field a GenerationConfig leaves
    unset from the model folder's generation_config.json: a hub model's repetition_penalty, min_p,
    no_repeat_ngram_size... would reshape the sampler's distribution away from the one the trainer
    scores. For the call, the model's own defaults are transformers' neutral ones."""
    target = base_model(model)
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        yield
    finally:
        target.generation_config = saved


class HFBackend(RolloutBackend):
    def __init__(self, cfg, model: torch.nn.Module, tokenizer, model_path: str | None = None, lockstep: bool = False, **_):
        self.model, self.tokenizer = model, tokenizer
        self.lockstep = lockstep
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(tokenizer.eos_token_id, base_model(model).generation_config)
        self.weight_version = 0

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        width = max(len(p) for p in prompt_ids)
        rows = [p for p in prompt_ids for _ in range(n)]
        ids_BL = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in rows])
        mask_BL = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        was_training = self.model.training
        self.model.eval()
        gen_cfg = generation_config(sampling, self.pad_id, self.stop_ids)
        device = next(self.model.parameters()).device
        # ZeRO-3 parameters are gathered during each forward, a collective: every rank keeps
        # stepping until all ranks are done (transformers' synced_gpus)
        synced = self.lockstep and dist.world_size() > 1
        with folder_defaults_off(self.model):
            out = self.model.generate(input_ids=ids_BL.to(device), attention_mask=mask_BL.to(device),
                                      generation_config=gen_cfg, synced_gpus=synced)
        self.model.train(was_training)
        new_BT = out.sequences[:, width:].cpu()
        scores_BTV = torch.stack(out.scores, dim=1).float().cpu()
        logprobs_BT = torch.log_softmax(scores_BTV, dim=-1).gather(-1, new_BT.unsqueeze(-1)).squeeze(-1)
        completions, logprobs, reasons = [], [], []
        for tokens, lps in zip(new_BT.tolist(), logprobs_BT.tolist()):
            end = next((t + 1 for t, token in enumerate(tokens) if token in self.stop_ids), None)
            if end is not None:
                completions.append(tokens[:end])
                logprobs.append(lps[:end])
                reasons.append("stop")
            else:
                completions.append(tokens)
                logprobs.append(lps)
                reasons.append("length")
        return Rollouts(completions, logprobs, reasons, self.weight_version)

    def update_weights(self, buckets: WeightBuckets, version: int) -> None:
        self.weight_version = version  # the module is the trainer's own: nothing to copy
