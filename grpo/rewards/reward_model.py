"""reward `rm`: a reward model's score of prompt + completion, in the trainer process or, with
`reward.rm.urls`, on `grpo.serve --reward-model` servers (grpo/rewards/served_rm.py: the same token
ids scored, the same normalisation after).

The model is a Hugging Face sequence-classification model with one label
(`AutoModelForSequenceClassification`, `num_labels=1`; its one logit at the text's last token is the
score) from `reward.rm.path`: a local folder, a hub id, or `tiny_rm` (the addition task's, built in
code: grpo/tiny/rm.py). It is loaded once when the run is built, on the trainer's device, in
eval mode without gradients, in `reward.rm.dtype` (null: the trainer's `model.dtype`). It reads
`sample.prompt + completion` as plain text (no chat template), tokenized by its own tokenizer.

Texts are scored in batches of at most `reward.rm.max_tokens` padded tokens (rows x the longest row,
right padding, sorted by length so rows of a batch are alike); a text longer than the cap is scored
alone. A score does not depend on the batch it lands in (to float rounding).

The model runs in the caller's thread (the trainer's), one batch once: a forward cannot be stopped
from Python, so none is left running behind the loop, and no text is scored twice. A text longer
than the model's context (`max_position_embeddings`) scores None with a warning (counted as
`rm/too_long`), as on servers: past it, learned positions index out of range (a device-side assert
on CUDA) and rotary ones extrapolate. `reward.rm.timeout_s_per_1k_tokens` (null: no bound) bounds a
batch by its tokens, checked between forwards: past it, the texts left score None with a warning
(`rm/over_budget`).

Normalisation (`reward.rm.normalise`): `none`; `fixed`, (score - offset) / scale; `running`, (score -
mean) / std over every training score this process has seen, the current batch included (Welford's
update, population std; while the std is 0 the score is only centred). Evaluation scores with the
statistics as they are (`score_only`): held-out greedy completions are not the training batches.
With one reward function and `algo.adv_scale=group`, an affine map of a batch's scores leaves the
advantages as they were; it matters when the score is summed with other rewards by weight, or with
`adv_scale=none`. Under several processes each keeps its own running statistics (of its share of the
batches), saved in its own checkpoint state and restored on resume (grpo/checkpoint.py).
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from grpo.errors import ConfigError
from grpo.models import DTYPES

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

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]

    def __call__(self, values: list[float | None], update: bool = True) -> list[float | None]:
        """None (a text a model could not score) and a score that is not finite (a forward that
        overflowed) stay as they are and count in no statistic (one NaN would make the running mean NaN
        for the rest of the run, and its checkpoints); `update=False` maps by the running statistics
        without adding `values` to them."""
        counted = [x is not None and math.isfinite(x) for x in values]
        scored = [x for x, c in zip(values, counted) if c]
        if self.mode == "fixed":
            scored = [(x - self.offset) / self.scale for x in scored]
        elif self.mode == "running":
            if update:
                self.update(scored)
            std = self.std or 1.0
            scored = [(x - self.mean) / std for x in scored]
        it = iter(scored)
        return [next(it) if c else x for x, c in zip(values, counted)]


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


def within_context(lengths: list[int], limit: int | None, where: str) -> tuple[list[int], str | None]:
    """The indices of the texts (their token counts `lengths`) that fit `limit` tokens (None: any), and
    the warning for the others (None: all fit), which score None: in process and on servers alike."""
    fits = [i for i, n in enumerate(lengths) if limit is None or n <= limit]
    if len(fits) == len(lengths):
        return fits, None
    return fits, f"{len(lengths) - len(fits)} texts are longer than {where} ({limit} tokens); they score None"


class RewardModel:
    """A sequence-classification model with one label, scoring texts without gradients. After each
    call `stats` counts the texts left unscored: too long for the context, past the token budget."""

    def __init__(self, model, tokenizer, max_tokens: int, normaliser: ScoreNormaliser | None = None,
                 timeout_s_per_1k_tokens: float | None = None):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.normaliser = normaliser or ScoreNormaliser()
        self.timeout_s_per_1k_tokens = timeout_s_per_1k_tokens
        self.stats: dict[str, float] = {}

    def scores(self, texts: list[str]) -> list[float | None]:
        """The model's raw score of each text, in the order given; None past its context or its budget."""
        ids = self.tokenizer(texts).input_ids
        out: list[float | None] = [None] * len(texts)
        fits, problem = within_context([len(x) for x in ids], getattr(self.model.config, "max_position_embeddings", None),
                                       "the reward model's context")
        self.stats = {"too_long": len(texts) - len(fits), "over_budget": 0}
        if problem:
            warnings.warn(f"reward 'rm': {problem}", stacklevel=2)
        batches = [[fits[j] for j in b] for b in token_batches([len(ids[i]) for i in fits], self.max_tokens)]
        tokens = sum(len(ids[i]) for i in fits)
        budget = math.inf if self.timeout_s_per_1k_tokens is None else self.timeout_s_per_1k_tokens * tokens / 1000
        device, t0 = next(self.model.parameters()).device, time.monotonic()
        with torch.no_grad():  # thread-local: entered here, in the caller's thread, where the forwards run
            for k, batch in enumerate(batches):
                if k and time.monotonic() - t0 > budget:  # between forwards: none is left running
                    self.over_budget(sum(len(b) for b in batches[k:]), len(texts), budget, tokens)
                    break
                enc = self.tokenizer.pad({"input_ids": [ids[i] for i in batch]}, padding_side="right", return_tensors="pt")
                logits = self.model(**enc.to(device)).logits  # B x 1: the score at each row's last token
                for i, value in zip(batch, logits[:, 0].float().tolist()):
                    out[i] = value
        return out

    def over_budget(self, left: int, total: int, budget: float, tokens: int) -> None:
        self.stats["over_budget"] = left
        warnings.warn(f"reward 'rm': {left} of {total} texts were not scored within reward.rm.timeout_s_per_1k_tokens="
                      f"{self.timeout_s_per_1k_tokens:g} ({budget:.3g} s for the batch's {tokens} tokens); they score "
                      f"None. Raise it, or set it to null for no bound.", stacklevel=3)

    def __call__(self, completions: list[str], samples: list, **_) -> list[float | None]:
        return self.normaliser(self.scores([s.prompt + c for c, s in zip(completions, samples)]))

    def score_only(self, completions: list[str], samples: list, **_) -> list[float | None]:
        """As a call, the running statistics left as they are (evaluation's held-out completions)."""
        return self.normaliser(self.scores([s.prompt + c for c, s in zip(completions, samples)]), update=False)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the running statistics of the scores (this process's)."""
        return self.normaliser.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.normaliser.load_state_dict(state)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # local: transformers is heavy; grpo.config reaches this module

    return AutoTokenizer.from_pretrained(path)


def load_reward_model(path: str, dtype: str, device="cpu"):
    """(model in eval mode without gradients on `device`, tokenizer) from a folder or hub id."""
    from transformers import AutoModelForSequenceClassification  # local: transformers is heavy (as above)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(path)
    model, loading = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype],
                                                                         output_loading_info=True)
    if loading["missing_keys"]:  # e.g. a policy's (causal LM) folder: transformers starts the head at random
        raise ConfigError(f"reward.rm.path={path!r} has no trained score head: {sorted(loading['missing_keys'])[:4]} "
                          f"are not in the folder and would start at random (scores of noise). Give a reward "
                          f"model's folder: a sequence-classification model trained with num_labels=1.")
    if model.config.num_labels != 1:
        raise ConfigError(f"reward.rm.path={path!r} has num_labels={model.config.num_labels}: a classifier of "
                          f"{model.config.num_labels} classes, where a reward model gives one score per text. Give a "
                          f"reward model's folder, or, if one of its outputs is the score, save it with num_labels=1 "
                          f"(that output's row of the head alone).")
    if tokenizer.pad_token is None:  # rows are padded; the model finds each row's last token by the pad id
        tokenizer.pad_token = tokenizer.eos_token
    # the pad id the tokenizer pads with, wherever the config had another (or none): the model takes each
    # row's score at its last token that is not its config's pad id, so a config naming another id than the
    # tokenizer's pad scores a short row at a pad token, a score that depends on the batch it lands in
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval().requires_grad_(False), tokenizer
