"""MATH (Hendrycks et al., competition problems): `problem` and `solution`, whose last `\boxed{...}`
is the ground truth; a data set with an `answer` column (MATH-500) uses that instead. A completion
is correct when math-verify judges its final answer equivalent (`1/2` = `\frac{1}{2}` = `0.5`)."""

from __future__ import annotations

from grpo.rewards.math_answer import is_equivalent, parse_gold
from grpo.tasks.base import Sample, Task
from grpo.tasks.dataset_task import RowError, build_dataset_task

COLUMNS = ["problem"]  # and a ground truth: `answer`, else `solution`'s last \boxed{} (Big-Math-style sets have no solution)
ANSWER_FORMAT = "Let's think step by step and output the final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched: `\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1].strip() if depth == 0 else None


def check_ground_truth(sample: Sample) -> None:
    """RowError when math-verify cannot read the sample's ground truth: every comparison with it would
    raise (gsm8k's too)."""
    try:
        parse_gold(sample.answer)
    except ValueError as e:
        raise RowError(f"{e}: no completion could be compared with it. Fix or drop the row.") from e


def build_math(cfg) -> Task:
    instruction = ANSWER_FORMAT if cfg.answer_format is None else cfg.answer_format

    def to_sample(row: dict) -> Sample:
        problem, solution = row["problem"], row.get("solution")
        if not isinstance(problem, str) or not problem.strip():
            raise RowError("column 'problem' is empty or not text.")
        answer = row.get("answer")
        if answer is None or not str(answer).strip():
            answer = last_boxed(solution) if isinstance(solution, str) else None
        if answer is None or not str(answer).strip():  # not `not answer`: a numeric answer column's 0 is one
            raise RowError("no ground truth: no 'answer' column, and no 'solution' column with a complete \\boxed{...}.")
        meta = {k: row[k] for k in ("level", "type", "subject") if k in row}
        return Sample(prompt=f"{problem.strip()} {instruction}".strip(), answer=str(answer).strip(), meta=meta)

    return build_dataset_task(cfg, COLUMNS, to_sample, lambda completion, s: is_equivalent(completion, s.answer),
                              check_ground_truth)
