"""transformers `generate` on the trainer's own module: the CPU default. Weights need no transfer."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from grpo import dist
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling
from grpo.weights import WeightBuckets


class HFBackend(RolloutBackend):
    def __init__(self, cfg, model: torch.nn.Module, tokenizer, model_path: str | None = None, lockstep: bool = False, **_):
        self.model, self.tokenizer = model, tokenizer
        self.lockstep = lockstep
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.weight_version = 0

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        width = max(len(p) for p in prompt_ids)
        rows = [p for p in prompt_ids for _ in range(n)]
        ids_BL = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in rows])
        mask_BL = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        greedy = sampling.temperature == 0
        was_training = self.model.training
        self.model.eval()
        # An explicit GenerationConfig: a hub model's own defaults (repetition penalty, ...) would
        # make the sampler's distribution differ from the one the trainer scores.
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else sampling.top_k,  # 0 = off (GenerationConfig's default is 50)
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            output_scores=True,  # the processed logits the sampler drew from
            return_dict_in_generate=True,
        )
        device = next(self.model.parameters()).device
        # ZeRO-3 parameters are gathered during each forward, a collective: every rank keeps
        # stepping until all ranks are done (transformers' synced_gpus)
        synced = self.lockstep and dist.world_size() > 1
        out = self.model.generate(input_ids=ids_BL.to(device), attention_mask=mask_BL.to(device),
                                  generation_config=gen_cfg, synced_gpus=synced)
        self.model.train(was_training)
        new_BT = out.sequences[:, width:].cpu()
        scores_BTV = torch.stack(out.scores, dim=1).float().cpu()
        logprobs_BT = torch.log_softmax(scores_BTV, dim=-1).gather(-1, new_BT.unsqueeze(-1)).squeeze(-1)
        completions, logprobs, reasons = [], [], []
        for tokens, lps in zip(new_BT.tolist(), logprobs_BT.tolist()):
            if self.eos_id in tokens:
                end = tokens.index(self.eos_id) + 1
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
