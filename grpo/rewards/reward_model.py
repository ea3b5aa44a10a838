"""reward `rm`: a reward model's score of prompt + completion, in the trainer process or, with
`reward.rm.urls`, on `grpo.serve --reward-model` servers (grpo/rewards/served_rm.py: the same token
ids scored, the same normalisation after).

The model is a Hugging Face sequence-classification model with one label
(`AutoModelForSequenceClassification`, `num_labels=1`; its one logit at the text's last token is the
score) from `reward.rm.path`: a local folder, a hub id, or `tiny_rm` (the addition task's, built in
code: grpo/rewards/tiny_rm.py). It is loaded once when the run is built, on the trainer's device, in
eval mode without gradients, in `reward.rm.dtype` (null: the trainer's `model.dtype`). It reads
`sample.prompt + completion` as plain text (no chat template), tokenized by its own tokenizer.

Texts are scored in batches of at most `reward.rm.max_tokens` padded tokens (rows x the longest row,
right padding, sorted by length so rows of a batch are alike); a text longer than the cap is scored
alone. A score does not depend on the batch it lands in (to float rounding).

Normalisation (`reward.rm.normalise`): `none`; `fixed`, (score - offset) / scale; `running`, (score -
mean) / std over every score this process has seen, the current batch included (Welford's update,
population std; while the std is 0 the score is only centred). With one reward function and
`algo.adv_scale=group`, an affine map of a batch's scores leaves the advantages as they were; it
matters when the score is summed with other rewards by weight, or with `adv_scale=none`. Under
several processes each keeps its own running statistics (of its share of the batches).
"""

from __future__ import annotations

import math

import torch

TINY_RM = "tiny_rm"
NORMALISATIONS = ("none", "running", "fixed")


class ScoreNormaliser:
    """Maps raw scores to rewards: none, fixed (score - offset) / scale, or running (Welford)."""

    def __init__(self, mode: str = "none", offset: float = 0.0, scale: float = 1.0):
        self.mode, self.offset, self.scale = mode, offset, scale
        self.count, self.mean, self.m2 = 0, 0.0, 0.0  # running: scores seen, their mean, sum of squared deviations

    def update(self, values: list[float]) -> None:
        for x in values:  # Welford: one pass, no catastrophic cancellation
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def __call__(self, values: list[float | None]) -> list[float | None]:
        """None (a text a served model could not score) stays None and counts in no statistic."""
        scored = [x for x in values if x is not None]
        if self.mode == "fixed":
            scored = [(x - self.offset) / self.scale for x in scored]
        elif self.mode == "running":
            self.update(scored)
            std = self.std or 1.0
            scored = [(x - self.mean) / std for x in scored]
        it = iter(scored)
        return [None if x is None else next(it) for x in values]


def token_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of texts grouped so that each batch's rows x its longest row <= max_tokens (a text longer
    than that alone), longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:  # descending: a batch's first text is its longest
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class RewardModel:
    """A sequence-classification model with one label, scoring texts without gradients."""

    def __init__(self, model, tokenizer, max_tokens: int, normaliser: ScoreNormaliser | None = None):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.normaliser = normaliser or ScoreNormaliser()

    def scores(self, texts: list[str]) -> list[float]:
        """The model's raw score of each text, in the order given."""
        ids = self.tokenizer(texts).input_ids
        out = [0.0] * len(texts)
        device = next(self.model.parameters()).device
        with torch.no_grad():  # thread-local: entered here, in the reward's worker thread
            for batch in token_batches([len(x) for x in ids], self.max_tokens):
                enc = self.tokenizer.pad({"input_ids": [ids[i] for i in batch]}, padding_side="right", return_tensors="pt")
                logits = self.model(**enc.to(device)).logits  # B x 1: the score at each row's last token
                for i, value in zip(batch, logits[:, 0].float().tolist()):
                    out[i] = value
        return out

    def __call__(self, completions: list[str], samples: list, **_) -> list[float]:
        return self.normaliser(self.scores([s.prompt + c for c, s in zip(completions, samples)]))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_reward_model(path: str, dtype: str, device="cpu"):
    """(model in eval mode without gradients on `device`, tokenizer) from a folder or hub id."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from grpo.errors import ConfigError
    from grpo.models import DTYPES

    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype])
    if model.config.num_labels != 1:
        raise ConfigError(f"reward.rm.path={path!r} has num_labels={model.config.num_labels}; a reward model gives "
                          f"one score (num_labels=1).")
    if tokenizer.pad_token is None:  # rows are padded; the model finds each row's last token by the pad id
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval().requires_grad_(False), tokenizer
