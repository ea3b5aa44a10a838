"""reward.rm.path=tiny_rm: a reward model for the addition task, built in code and cached.

InstructGPT's recipe at toy size: the reward model starts from the supervised policy, here the tiny
policy warm-started on the task (`model.tiny`, grpo/tiny/text.py): its embeddings and layers, 3 fresh
layers on top and a score head with one label (Qwen2ForSequenceClassification). It is trained on the
task's training prompts by the pairwise (Bradley-Terry) loss -log sigmoid(r(prompt + correct sum) -
r(prompt + wrong answer)), plus per-digit supervision of the fresh layers (`train_tiny_rm`). The wrong
answers are made in code (`wrong_answer`): near misses (the sum +- 1..9, tens, 100), one digit
changed, any number of the answer's width, and the right digits in a wrong form (cut, extended,
unpadded, empty) or other characters. It is measured on the task's held-out prompts (the policy's
eval split, never trained on): pairwise accuracy against 4 wrong answers each, and top-1 accuracy
(the correct sum above every other possible sum), both kept in the folder's grpo_tiny_rm.json.

Cached like the tiny policy: a folder under model.cache_dir keyed by a hash of its recipe
(reward.rm.tiny and the policy folder it starts from), written under a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import string
import time
from typing import Callable

import torch
from omegaconf import OmegaConf

from grpo.packaged import publish_model_folder
from grpo.tiny.warm_start import ensure_tiny_model, tiny_model_dir

TINY_RM_FORMAT = 1  # bump when the recipe changes, so old cache entries are not reused
NEAR = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)
CHARS = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))  # the char tokenizer's


def wrong_answer(answer: str, rng: random.Random) -> str:
    """An answer that exact match (stripped of whitespace) counts wrong for the digits `answer`."""
    width, value = len(answer), int(answer)
    while True:
        kind = rng.random()
        if kind < 0.4:  # a near miss
            d = rng.choice(NEAR) * rng.choice((-1, 1))
            text = f"{value + d if value + d >= 0 else value - d:0{width}d}"
        elif kind < 0.7:  # one digit changed
            i = rng.randrange(width)
            text = answer[:i] + rng.choice([c for c in string.digits if c != answer[i]]) + answer[i + 1 :]
        elif kind < 0.85:  # any number of the answer's width
            text = f"{rng.randrange(10**width):0{width}d}"
        else:  # the right digits in a wrong form, or no number at all
            text = rng.choice([answer[:-1], answer[1:], answer + rng.choice(string.digits), answer.lstrip("0"), "",
                               "".join(rng.choice(CHARS) for _ in range(rng.randint(1, width + 1)))])
        if text.strip() != answer:
            return text


def pairwise_accuracy(scores: Callable[[list[str]], list[float]], samples: list, per_prompt: int = 4, seed: int = 0) -> float:
    """How often `scores` (texts -> a reward model's scores) puts prompt + answer above prompt + a wrong
    answer (`per_prompt` of them each)."""
    rng = random.Random(seed)
    rows = [s for s in samples for _ in range(per_prompt)]
    good = scores([s.prompt + s.answer for s in rows])
    bad = scores([s.prompt + wrong_answer(s.answer, rng) for s in rows])
    return sum(g > b for g, b in zip(good, bad)) / len(rows)


def top1_accuracy(scores: Callable[[list[str]], list[float]], samples: list) -> float:
    """How often the correct answer outscores every other number a sum of two operands of the prompt's
    width can be (0 to 2 x (10^d - 1), written at the answer's width): what a policy that found the
    reward model's favourite answer would get right."""
    hits = 0
    for s in samples:
        width = len(s.answer)
        candidates = [f"{v:0{width}d}" for v in range(2 * (10 ** (width - 1) - 1) + 1)]
        values = scores([s.prompt + c for c in candidates])
        hits += candidates[max(range(len(values)), key=values.__getitem__)] == s.answer
    return hits / len(samples)


@torch.no_grad()
def plain_scores(model, tokenizer, texts: list[str], rows: int = 512) -> list[float]:
    """The model's score of each text, `rows` texts per forward (the training loop's view; the reward
    batches by tokens, grpo/rewards/reward_model.py)."""
    out = []
    for i in range(0, len(texts), rows):
        enc = tokenizer(texts[i : i + rows], return_tensors="pt", padding=True, padding_side="right")
        out += model(**enc).logits[:, 0].tolist()
    return out


def digit_labels(tokenizer, rows: list, answers: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position labels of a batch's answers (what a process reward model is trained on, per digit):
    (row, position) of each answer character with (the digit the correct answer has there, whether the
    answer's character is it). Positions past the correct answer's end have no digit and never match."""
    at, digit, match = [], [], []
    for i, (s, a) in enumerate(zip(rows, answers)):
        start = len(tokenizer(s.prompt).input_ids)  # the char tokenizer: one token per character, after <bos>
        for j, ch in enumerate(a):
            at.append((i, start + j))
            digit.append(int(s.answer[j]) if j < len(s.answer) else -100)  # -100: ignored by cross_entropy
            match.append(float(j < len(s.answer) and ch == s.answer[j]))
    return torch.tensor(at).view(-1, 2), torch.tensor(digit), torch.tensor(match)


def build_from_policy(policy_path: str, new_layers: int, seed: int):
    """(sequence-classification model, tokenizer): the policy's layers and embeddings, `new_layers` more
    layers and a score head, those at random (seeded)."""
    # local: transformers is heavy; validate reaches this module through grpo.rewards.rm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    config = AutoConfig.from_pretrained(policy_path, num_labels=1)
    config.num_hidden_layers += new_layers
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    missing, unexpected = model.base_model.load_state_dict(policy.base_model.state_dict(), strict=False)
    fresh = {f"layers.{policy.config.num_hidden_layers + k}." for k in range(new_layers)}
    assert not unexpected and all(any(m.startswith(f) for f in fresh) for m in missing), (missing, unexpected)
    return model.float(), tokenizer


def train_tiny_rm(policy_path: str, task, cfg, log=print):
    """(reward model, tokenizer, info): the policy's backbone, `cfg.new_layers` fresh layers and a score
    head (`cfg`: reward.rm.tiny), trained for `cfg.steps` steps on three losses summed: the pairwise loss
    on the score, and two per-position ones that teach the fresh layers a check per digit (linear
    heads dropped after training): the first fresh layer's output says which digit the correct answer
    has at each answer position, the second's whether the answer's digit is it. The last fresh layer
    gathers those checks at the final token, where the score is read. Without the two (the pairwise
    loss alone, 2 to 4 layers, 400 to 2000 steps), the model learned to check one digit and ignore
    another, and GRPO on its score drove held-out accuracy down (docs/results/reward_model.md)."""
    from transformers.utils import logging as hf_logging  # local: heavy (as above)

    hf_logging.disable_progress_bar()
    model, tokenizer = build_from_policy(policy_path, cfg.new_layers, cfg.seed)
    width = model.config.hidden_size
    digit_head, match_head = torch.nn.Linear(width, 10), torch.nn.Linear(width, 1)
    first = model.config.num_hidden_layers - cfg.new_layers + 1  # hidden_states index: the first fresh layer's output
    params = [*model.parameters(), *digit_head.parameters(), *match_head.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1)))
    rng = random.Random(cfg.seed)
    model.train()
    t0 = time.perf_counter()
    for _ in range(cfg.steps):
        rows = [rng.choice(task.train) for _ in range(cfg.batch)]
        answers = [s.answer for s in rows] + [wrong_answer(s.answer, rng) for s in rows]
        rows2 = rows + rows
        enc = tokenizer([s.prompt + a for s, a in zip(rows2, answers)], return_tensors="pt", padding=True, padding_side="right")
        out = model.base_model(**enc, output_hidden_states=True)
        last = enc.attention_mask.sum(1) - 1  # right padding: each row's last token, where the score is read
        r = model.score(out.last_hidden_state[torch.arange(len(rows2)), last])[:, 0]  # the correct answers', then the wrong ones'
        loss = -torch.nn.functional.logsigmoid(r[: len(rows)] - r[len(rows) :]).mean()
        at, digit, match = digit_labels(tokenizer, rows2, answers)
        loss = loss + torch.nn.functional.cross_entropy(digit_head(out.hidden_states[first][at[:, 0], at[:, 1]]), digit)
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(
            match_head(out.hidden_states[first + 1][at[:, 0], at[:, 1]])[:, 0], match)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    model.eval().requires_grad_(False)
    train_s = time.perf_counter() - t0

    def scores(texts):
        return plain_scores(model, tokenizer, texts)

    info = {"policy": policy_path, "steps": cfg.steps, "train_s": train_s, "heldout_prompts": len(task.eval),
            "heldout_pairwise_accuracy": pairwise_accuracy(scores, task.eval),
            "heldout_top1_accuracy": top1_accuracy(scores, task.eval[:64])}
    log(f"tiny reward model: {cfg.steps} steps in {train_s:.1f}s; held-out pairwise accuracy "
        f"{info['heldout_pairwise_accuracy']:.3f}, top-1 among every sum {info['heldout_top1_accuracy']:.3f}")
    return model, tokenizer, info


def tiny_rm_dir(cfg, policy_dir: str) -> str:
    """Cache folder of the tiny reward model: a hash of its recipe and the policy it starts from."""
    recipe = {"format": TINY_RM_FORMAT, "tiny": OmegaConf.to_container(cfg.reward.rm.tiny, resolve=True),
              "policy": os.path.basename(policy_dir)}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser(cfg.model.cache_dir), f"tiny_rm-{key}")


def tiny_rm_folder(cfg) -> str:
    """Where `reward.rm.path=tiny_rm` of the run config `cfg` is kept. Its policy is warm-started to
    decode the answer and its end token (task.digits + 2 new tokens), as the default run's is, so the
    two share a folder."""
    return tiny_rm_dir(cfg, tiny_model_dir(cfg.model, cfg.task, cfg.task.digits + 2))


def built_tiny_rm(cfg) -> str:
    """The tiny reward model's folder, which the run's setup built (grpo.tiny.folders.resolve_on_node)."""
    path = tiny_rm_folder(cfg)
    if not os.path.isfile(os.path.join(path, "grpo_tiny_rm.json")):
        raise FileNotFoundError(f"reward.rm.path=tiny_rm is not built in {path}: a run's setup builds it "
                                "(grpo.tiny.folders.resolve_on_node); elsewhere call grpo.tiny.rm.ensure_tiny_rm first")
    return path


def ensure_tiny_rm(cfg, task, log=print) -> str:
    """The tiny reward model's folder, built on `task` (the run's, handed in: a scorer knows no prompt
    source) with the tiny policy it starts from, unless cached."""
    new_tokens = cfg.task.digits + 2
    path = tiny_rm_folder(cfg)
    if os.path.isfile(os.path.join(path, "grpo_tiny_rm.json")):
        return path
    log(f"building the tiny reward model in {path}")
    policy = ensure_tiny_model(cfg.model, cfg.task, task, new_tokens, log)
    model, tokenizer, info = train_tiny_rm(policy, task, cfg.reward.rm.tiny, log)
    return publish_model_folder(model, tokenizer, path, "grpo_tiny_rm.json", info)
