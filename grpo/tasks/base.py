"""What every task provides: a train split, a held-out eval split, and a resumable sampler."""

from __future__ import annotations

import hashlib
import random
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

from grpo.errors import ConfigError, DatasetError


@dataclass
class Sample:
    prompt: str  # the text the model continues
    answer: str  # ground truth for the rewards
    meta: dict = field(default_factory=dict)  # anything else a reward needs


def check_digits(digits: int) -> None:
    """task.digits, the operand width of the generated tasks (addition, arithmetic)."""
    if not 1 <= digits <= 4:
        raise ConfigError(f"task.digits={digits} must be between 1 and 4.")


def hold_out(samples: list, eval_size: int, seed: int, error: type[Exception], where: str = "") -> tuple[list, list]:
    """(train, eval): a seeded shuffle, then the first `eval_size` held out; `error` (naming
    `where`) when nothing would be left to train on. The one split of every task."""
    if eval_size >= len(samples):
        raise error(f"{where}task.eval_size={eval_size} leaves no training rows out of {len(samples)}; lower it.")
    samples = list(samples)
    random.Random(seed).shuffle(samples)
    return samples[eval_size:], samples[:eval_size]


def without_held_out(train: list, held_out: list, where: str = "", sample: Callable = lambda s: s) -> list:
    """The training samples that are no held-out one (the same prompt and answer; `sample`: a row's
    Sample). A data file with repeated rows, or an eval file sharing rows with the train file, would
    otherwise train on what it evaluates; they are left out, with a warning that counts them. Rows that
    share a prompt and differ in answer (a game's secrets: env reads the answer) are different samples."""
    key = lambda row: (sample(row).prompt, sample(row).answer)  # noqa: E731
    held = {key(s) for s in held_out}
    repeats = [s for s in train if key(s) in held]
    if repeats:
        warnings.warn(f"{where}{len(repeats)} of {len(train)} training rows repeat a held-out row (the first: "
                      f"{sample(repeats[0]).prompt[:80]!r}); they are left out of training, so no eval sample is trained "
                      "on. Remove the repeated rows from the data to keep the count of training rows.", stacklevel=2)
    return [s for s in train if key(s) not in held]


def exact_answer(completion: str, sample: Sample) -> bool:
    return completion.strip() == sample.answer.strip()


@dataclass
class Task:
    name: str
    train: list[Sample]
    eval: list[Sample]
    is_correct: Callable[[str, Sample], bool] = exact_answer  # what eval accuracy counts
    # How prompts reach the model (grpo.models.encode_prompts): through the tokenizer's chat
    # template (auto: when it has one | always | never), after an optional system prompt.
    chat_template: str = "auto"
    system_prompt: Optional[str] = None
    # Multi-turn tasks: the tiny model's warm start trains on `demonstration(sample)`, (text, trained)
    # segments (each trained one followed by the end token); it is checked by playing episodes, which
    # needs the rollout engine, so that check lives above the tasks (grpo/tiny/folders.py PLAYS).
    demonstration: Optional[Callable] = None

    def __post_init__(self):
        if not self.train:
            raise ValueError(f"task {self.name!r} has no training samples; check its data source.")
        if not self.eval:
            raise ValueError(f"task {self.name!r} has no eval samples; lower task.eval_size or add data.")
        for split, samples in (("train", self.train), ("eval", self.eval)):  # a custom task's, before any step
            for i, s in enumerate(samples):
                if not isinstance(s.prompt, str) or not s.prompt.strip() or not isinstance(s.answer, str):
                    raise DatasetError(f"task {self.name!r}: {split} sample {i} has prompt={str(s.prompt)[:60]!r} "
                                       f"({type(s.prompt).__name__}) and answer={str(s.answer)[:40]!r} "
                                       f"({type(s.answer).__name__}): a Sample's prompt is non-empty text and its "
                                       f"answer text (str(...) of a number).")


class TrainSampler:
    """Shuffled passes over the train split. Its state is (epoch, position): a resumed run draws
    exactly the prompts an uninterrupted run would have, on the same train split (its digest is kept
    with them, so a data file or hub set changed under a resumed run is said)."""

    def __init__(self, samples: list[Sample], seed: int):
        self.samples, self.seed = samples, seed
        self.epoch, self.pos = 0, 0
        self._order = self._permutation()
        rows = hashlib.sha256()
        for s in samples:  # once: state_dict is taken every step
            rows.update(f"{s.prompt}\0{s.answer}\0".encode())
        self.digest = rows.hexdigest()[:16]

    def _permutation(self) -> list[int]:
        order = list(range(len(self.samples)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[Sample]:
        out = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(n - len(out), len(self._order) - self.pos)
            out += [self.samples[i] for i in self._order[self.pos : self.pos + take]]
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "samples": len(self.samples), "digest": self.digest}

    def load_state_dict(self, state: dict) -> None:
        # (epoch, pos) index a permutation of the split they were taken on: on another split (rows added,
        # removed or edited in the file, a new revision of the hub set) the rest of the pass repeats some
        # prompts and skips others, and a position past its end starts the next pass. An older
        # checkpoint has no digest: nothing to compare.
        if state.get("digest", self.digest) != self.digest:
            warnings.warn(f"resuming on another train split than the checkpoint's: {len(self.samples)} training "
                          f"prompts, where it drew from {state.get('samples', '?')} (digest {self.digest}, was "
                          f"{state['digest']}); the task's data changed since. The run goes on from its data position, "
                          "but does not draw the prompts the unbroken run would have; resume=false starts afresh.",
                          stacklevel=2)
        self.epoch, self.pos = state["epoch"], min(state["pos"], len(self.samples))
        self._order = self._permutation()
