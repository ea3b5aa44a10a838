"""The reward group's typed schema (`reward.*`): the weighted reward functions and the settings of the
model rewards `rm` (a sequence-classification reward model) and `judge` (an LLM judge). Part of the
config (grpo/config.py registers it with the other groups and validates across groups); its own file
so the config module stays one idea per screen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class RewardFuncConfig:
    name: str = MISSING  # a key of grpo.rewards.REWARDS or MODEL_REWARDS (rm), or a dotted path `package.module.function`
    weight: float = 1.0


@dataclass
class TinyRewardModelConfig:
    """reward.rm.path=tiny_rm: the tiny policy's backbone, fresh layers and a score head, trained to rank the
    addition task's correct sums above wrong ones (grpo/tiny/rm.py)."""

    new_layers: int = 3  # on top of the policy's: a digit's value, its check, the checks gathered at the last token
    steps: int = 400
    lr: float = 1e-3
    warmup_steps: int = 50
    batch: int = 128  # (prompt, correct, wrong) triples per step
    seed: int = 0


@dataclass
class RewardModelConfig:
    """reward `rm`: a sequence-classification model's score of prompt + completion (grpo/rewards/reward_model.py)."""

    path: Optional[str] = None  # a local HF folder, a hub id, or tiny_rm (built in code for task=addition)
    max_tokens: int = 8192  # padded tokens per forward (rows x the longest); a longer text goes alone
    dtype: Optional[str] = None  # float32 | bfloat16; null: the trainer's (model.dtype)
    # in process: a batch's bound, per 1000 of its tokens, checked between forwards (the texts left score
    # None); null: none (a forward that hangs on the device is not recoverable anyway). Not reward.timeout_s
    timeout_s_per_1k_tokens: Optional[float] = None
    normalise: str = "none"  # none | running (mean and std of every score so far) | fixed: (score - offset) / scale
    offset: float = 0.0
    scale: float = 1.0
    # served (grpo/rewards/served_rm.py): `python -m grpo.serve --model DIR --reward-model` servers, the batch
    # split across them; the trainer then loads only path's tokenizer. Empty: the model in the trainer process.
    urls: list[str] = field(default_factory=list)  # e.g. [http://node7:8001]
    token_file: Optional[str] = None  # the servers' token (chmod 600); null: $GRPO_RM_TOKEN (never $GRPO_SERVE_TOKEN)
    allow_plain_http: bool = False  # send the token over plain http:// to a host other than loopback
    health_timeout_s: float = 300.0  # at build: wait this long for every server's /health
    request_timeout_s: float = 20.0  # one server's share of a batch; past it, that share scores None
    tiny: TinyRewardModelConfig = field(default_factory=TinyRewardModelConfig)


DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt}\nReference answer: {answer}\nProposed answer: {completion}\n"
    "Is the proposed answer the same as the reference answer? Answer yes or no."
)


DEFAULT_CHOICES = {"yes": 1.0, "no": 0.0}  # reward.judge.choices when it is empty (grpo/rewards/judge.py answer_choices)


@dataclass
class JudgeConfig:
    """reward `judge`: an LLM judge on OpenAI-compatible servers (grpo/rewards/judge.py)."""

    urls: list[str] = field(default_factory=list)  # http://host:port of `grpo.serve`, `vllm serve` or any endpoint
    model: Optional[str] = None  # the served model's name; null: the first server's (/v1/models)
    token_file: Optional[str] = None  # chmod 600; null: $GRPO_JUDGE_TOKEN (none: no Authorization header)
    allow_plain_http: bool = False  # send the token over plain http:// to a host other than loopback
    api: str = "chat"  # chat (/v1/chat/completions: the judge's chat template) | completions (the text as is)
    template: str = DEFAULT_JUDGE_TEMPLATE  # {prompt}, {completion}, {answer} (the task's reference)
    score: str = "logprobs"  # logprobs: expected value over `choices` at the first token | pattern: a match in the text
    choices: dict[str, float] = field(default_factory=dict)  # answer token -> score; empty: {yes: 1, no: 0}
    rating: Optional[list[int]] = None  # [low, high]: the numbers low..high as the choices, each its own value (not `choices`)
    # score=pattern: its first group that took part, a choice's name or a number; every match must agree
    pattern: str = r"(-?(?:\d+(?:\.\d+)?|\.\d+))"
    max_tokens: Optional[int] = None  # the judge's answer length; null: 1 under logprobs, 16 under pattern
    top_logprobs: int = 20  # score=logprobs: tokens read at the first position (vLLM's default cap is 20)
    min_choice_mass: float = 0.5  # score=logprobs: less probability than this on the choices is a garbage answer
    max_concurrency: int = 16  # requests in flight, over every server
    request_timeout_s: float = 60.0
    retries: int = 2  # a failed request is sent again, to another server when there is one
    min_scored: float = 0.5  # fewer of a batch scored than this fraction stops the run
    batch_timeout_s: float = 600.0  # one batch's bound (instead of reward.timeout_s): then no new request
    health_timeout_s: float = 300.0  # at start: every server answers /health by then


@dataclass
class RewardConfig:
    funcs: list[RewardFuncConfig] = field(default_factory=list)
    timeout_s: float = 30.0  # a rule function that raises or hangs past this is retried per completion (not rm, judge)
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)  # the settings of reward `rm`
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the settings of reward `judge`
