"""GSM8K (grade-school math word problems): `question`, and `answer` = worked solution ending in
`#### 42`. The ground truth is the number after `####`; a completion is correct when math-verify
finds the same value as its final answer (see grpo.rewards.math_answer)."""

from __future__ import annotations

from grpo.rewards.math_answer import is_equivalent
from grpo.tasks.base import Sample, Task
from grpo.tasks.dataset_task import RowError, build_dataset_task
from grpo.tasks.math_problems import check_ground_truth

COLUMNS = ["question", "answer"]
ANSWER_FORMAT = 'Let\'s think step by step and output the final answer after "####".'  # verl's prompt


def final_answer(solution: str) -> str:
    """`... #### 1,234` -> `1234`."""
    if "####" not in solution:
        raise RowError("column 'answer' has no '#### <number>' final answer.")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "").rstrip(".")
    if not answer:
        raise RowError("column 'answer' has nothing after '####'.")
    return answer


def build_gsm8k(cfg) -> Task:
    instruction = ANSWER_FORMAT if cfg.answer_format is None else cfg.answer_format

    def to_sample(row: dict) -> Sample:
        question = row["question"]
        if not isinstance(question, str) or not question.strip():
            raise RowError("column 'question' is empty or not text.")
        if not isinstance(row["answer"], str):
            raise RowError("column 'answer' is not text.")
        prompt = f"{question.strip()} {instruction}".strip()
        return Sample(prompt=prompt, answer=final_answer(row["answer"]), meta={"solution": row["answer"]})

    return build_dataset_task(cfg, COLUMNS, to_sample, lambda completion, s: is_equivalent(completion, s.answer),
                              check_ground_truth)
