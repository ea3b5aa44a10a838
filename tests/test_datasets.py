"""Data-set tasks (gsm8k, math, countdown) from small local files the tests write, their ground-truth
extraction, row-level errors naming file and line, the hub path's failure message, and prompts
through a chat template."""

import json
import math

import pytest
from omegaconf import OmegaConf

from grpo.config import TaskConfig
from grpo.models import encode_prompts, format_prompt
from grpo.tiny.text import build_char_tokenizer
from grpo.tasks import build_task
from grpo.tasks.gsm8k import final_answer
from grpo.tasks.math_problems import last_boxed
from grpo.tasks.rows import DatasetError


def task_cfg(**kw):
    return OmegaConf.structured(TaskConfig(**kw))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


GSM8K = [{"question": f"Tom has {i} apples and buys 1,000 more. How many?", "answer": f"{i} + 1000 = {i + 1000}\n#### {i + 1000:,}"}
         for i in range(6)]


def test_gsm8k_from_local_files_extracts_the_number_after_hashes(tmp_path):
    train = write_parquet(tmp_path / "train.parquet", GSM8K[:4])
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K[4:])
    task = build_task(task_cfg(name="gsm8k", path=train, eval_path=test, eval_size=10))
    assert len(task.train) == 4 and len(task.eval) == 2  # eval_size caps the eval split; 2 is all there is
    answers = sorted(s.answer for s in task.eval)
    assert answers == ["1004", "1005"]  # "#### 1,004": the comma goes
    s = task.eval[0]
    assert s.prompt.startswith("Tom has") and s.prompt.endswith('output the final answer after "####".')
    assert task.is_correct(f"So {s.answer[0]},{s.answer[1:]} apples. #### {s.answer}", s)
    assert not task.is_correct("#### 7", s)
    capped = build_task(task_cfg(name="gsm8k", path=train, eval_path=test, eval_size=1))
    assert len(capped.eval) == 1 and capped.eval[0].answer in ("1004", "1005")  # the eval file cut to eval_size


@pytest.mark.parametrize("name, rows, eval_file", [("gsm8k", GSM8K * 3, False), ("gsm8k", GSM8K, True),
                                                   ("jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)] * 3, False)])
def test_a_prompt_held_out_is_never_trained_on_when_the_data_repeats_it(tmp_path, name, rows, eval_file):
    """Rows repeated in the file (or shared by the train and eval files): before, hold_out shuffled rows,
    so 20 of 20 held-out prompts of a file with each row 3 times were trained on too. Now training leaves
    them out, with a warning that counts them."""
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    evals = write_jsonl(tmp_path / "eval.jsonl", rows[:2]) if eval_file else None
    with pytest.warns(UserWarning, match=r"training rows repeat a held-out row .*they are left out of training"):
        task = build_task(task_cfg(name=name, path=train, eval_path=evals, eval_size=2))
    held = {s.prompt for s in task.eval}
    assert len(held) == 2 and not held & {s.prompt for s in task.train}
    assert len(task.train) == len(rows) - (2 if eval_file else 6)  # each held-out prompt's 3 rows (1 in the files' case)


def test_rows_that_share_a_prompt_and_differ_in_answer_all_train():
    """One prompt, many answers (a game's secrets, which its environment reads): different samples, not
    repeats. Matched on the prompt alone, every training row was left out and the task had none."""
    from grpo.tasks.base import Sample, without_held_out

    rows = [Sample("Play wordle.", word) for word in ("crane", "slate", "pious", "crane")]
    with pytest.warns(UserWarning, match=r"^1 of 3 training rows repeat a held-out row \(the first: 'Play wordle.'\)"):
        assert without_held_out(rows[1:], rows[:1]) == rows[1:3]


def test_answer_format_and_system_prompt_are_configurable(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", GSM8K)
    task = build_task(task_cfg(name="gsm8k", path=path, eval_size=2, answer_format="Answer in one line.",
                               system_prompt="Be brief.", chat_template="never"))
    assert len(task.train) == 4 and len(task.eval) == 2  # no eval file: 2 of the 6 rows held out
    assert all(s.prompt.endswith("How many? Answer in one line.") for s in task.train)
    assert (task.system_prompt, task.chat_template) == ("Be brief.", "never")


@pytest.mark.parametrize(
    "rows, message",
    [
        ([GSM8K[0], {"question": "q", "answer": "no final answer"}], "d.jsonl:2: column 'answer' has no '#### <number>'"),
        ([{"question": "q"}], "d.jsonl:1: missing column(s) ['answer']; the row has ['question']"),
        ([GSM8K[0], '{"question": "q",'], "d.jsonl:2: not valid JSON"),
        ([{"question": " ", "answer": "#### 3"}], "d.jsonl:1: column 'question' is empty"),
        # "." alone after ####: the trailing full stop goes, and nothing is left
        ([GSM8K[0], {"question": "q", "answer": "#### ."}], "d.jsonl:2: column 'answer' has nothing after '####'"),
        # a null (a parquet row without the column reads as one) is a missing column, not a wrong type
        ([GSM8K[0], {"question": "q", "answer": None}], "d.jsonl:2: missing column(s) ['answer']; the row has ['answer', 'question']"),
        ([""], "d.jsonl: the file has no rows"),
    ],
)
def test_malformed_gsm8k_row_names_file_and_line(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError) as e:
        build_task(task_cfg(name="gsm8k", path=path, eval_size=1))
    assert message in str(e.value)


def test_malformed_parquet_row_names_file_and_row(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [GSM8K[0], GSM8K[1], {"question": "q", "answer": "7"}])
    with pytest.raises(DatasetError, match=r"d\.parquet: row 3: column 'answer' has no '####"):
        build_task(task_cfg(name="gsm8k", path=path, eval_size=1))


def test_local_file_types_and_missing_file(tmp_path):
    task = build_task(task_cfg(name="gsm8k", path=write_jsonl(tmp_path / "d.json", GSM8K), eval_size=2))
    assert len(task.train) == 4 and len(task.eval) == 2  # a .json file is read as JSON lines, like a .jsonl
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(DatasetError, match="unknown file type"):
        build_task(task_cfg(name="gsm8k", path=str(tmp_path / "d.csv"), eval_size=1))
    with pytest.raises(DatasetError, match="does not exist"):
        build_task(task_cfg(name="gsm8k", path=str(tmp_path / "nope.parquet"), eval_size=1))


@pytest.mark.parametrize("indent", [2, None])
def test_a_json_array_file_is_refused_as_an_array(tmp_path, indent):
    """A .json file of one array of rows (json.dump(rows, f), datasets' to_json(lines=False)) is read as JSON
    lines: it was refused with "d.json:1: not valid JSON (Expecting value); fix or remove that line" (line 1 is
    its "["), a valid file reported as a broken line."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps(GSM8K, indent=indent))
    with pytest.raises(DatasetError, match=r"d\.json:1: the file is one JSON array of rows; task.path \(and "
                                           r"task.eval_path\) read JSON lines, one object per line: convert it"):
        build_task(task_cfg(name="gsm8k", path=str(path), eval_size=1))
    rows = tmp_path / "r.json"
    rows.write_text(json.dumps([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)], indent=indent))
    with pytest.raises(DatasetError, match=r"r\.json:1: the file is one JSON array of rows"):
        build_task(task_cfg(name="jsonl", path=str(rows), eval_size=1))


def test_a_jsonl_file_with_a_byte_order_mark_is_read(tmp_path):
    """A UTF-8 file saved with a BOM (Windows Notepad, PowerShell's Out-File): its first row is valid JSON, not
    "not valid JSON (Unexpected UTF-8 BOM); fix or remove that line"."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in GSM8K).encode())
    task = build_task(task_cfg(name="gsm8k", path=str(path), eval_size=2))
    assert len(task.train) + len(task.eval) == len(GSM8K)
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", "answer": 6}\n')
    task = build_task(task_cfg(name="jsonl", path=str(rows), eval_size=1))
    assert sorted(s.answer for s in task.train + task.eval) == ["4", "6"]


def test_hub_failure_says_how_to_use_local_files(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network retries
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError) as e:
        build_task(task_cfg(name="gsm8k", hub_id="openai/gsm8k", hub_config="main", eval_size=1))
    msg = str(e.value)
    assert "could not load 'openai/gsm8k' (config 'main', split 'train') through datasets" in msg
    assert "set task.path (and task.eval_path) to local .jsonl or .parquet files with the columns ['question', 'answer']" in msg


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} first, then \\boxed{ 2 }", "2"),  # the last one, stripped
        ("\\fbox{7}", "7"),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced: no answer rather than a wrong one
        ("no box", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "solution, answer",
    [
        ("2 + 3 = 5\n#### 5", "5"),
        ("Say '#### 4' at the end: 3 + 4 = 7\n#### 7", "7"),  # the last ####
        ("1000 + 234 = 1234\n#### 1,234.", "1234"),  # comma and trailing full stop go
    ],
)
def test_gsm8k_final_answer(solution, answer):
    assert final_answer(solution) == answer


def test_math_task_answer_from_boxed_or_answer_column(tmp_path):
    rows = [{"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Algebra"},
            {"problem": "2+2?", "solution": "four", "answer": "4"},  # MATH-500 has an answer column
            {"problem": "1+2?", "solution": "\\boxed{3}", "answer": ""}, {"problem": "1+4?", "solution": "\\boxed{5}", "answer": " "}]
    task = build_task(task_cfg(name="math", path=write_jsonl(tmp_path / "m.jsonl", rows), eval_size=1))
    by_problem = {s.prompt.split(" Let's")[0]: s for s in task.train + task.eval}
    assert by_problem["Half of 1?"].answer == "\\frac{1}{2}" and by_problem["Half of 1?"].meta == {"level": "Level 1", "type": "Algebra"}
    assert by_problem["2+2?"].answer == "4"
    assert by_problem["1+2?"].answer == "3" and by_problem["1+4?"].answer == "5"  # a blank answer column: the boxed one
    assert task.is_correct("... so the answer is \\boxed{0.5}", by_problem["Half of 1?"])  # equal by value
    assert not task.is_correct("\\boxed{2}", by_problem["Half of 1?"])


def test_math_task_reads_a_set_with_answers_and_no_solutions(tmp_path):
    """A Big-Math-style set (problem, answer; no solution column) was refused: "missing column(s) ['solution']"."""
    rows = [{"problem": f"{i} + 1?", "answer": str(i + 1)} for i in range(4)]
    task = build_task(task_cfg(name="math", path=write_jsonl(tmp_path / "pa.jsonl", rows), eval_size=1))
    assert sorted(s.answer for s in task.train + task.eval) == ["1", "2", "3", "4"]
    with pytest.raises(DatasetError, match=r"pa\.jsonl:1: missing column\(s\) \['problem'\]"):
        build_task(task_cfg(name="math", path=write_jsonl(tmp_path / "pa.jsonl", [{"question": "q", "answer": "1"}]),
                            eval_size=1))


def test_math_numeric_answer_zero_is_a_ground_truth(tmp_path):
    """A numeric answer column (a .jsonl or .parquet set with int answers) whose value is 0: it was taken for no
    answer, and the row refused with "no 'answer' column", which it has."""
    rows = [{"problem": "3 - 3?", "answer": 0}, {"problem": "1 + 1?", "answer": 2}, {"problem": "0.5 - 0.5?", "answer": 0.0}]
    for path in (write_jsonl(tmp_path / "z.jsonl", rows[:2]), write_parquet(tmp_path / "z.parquet", rows[:2])):
        task = build_task(task_cfg(name="math", path=path, eval_size=1))
        assert sorted(s.answer for s in task.train + task.eval) == ["0", "2"]
    task = build_task(task_cfg(name="math", path=write_jsonl(tmp_path / "f.jsonl", rows[1:]), eval_size=1))
    assert sorted(s.answer for s in task.train + task.eval) == ["0.0", "2"]


def test_math_row_without_ground_truth_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": "\\boxed{1}"}, {"problem": "p", "solution": "none"}])
    with pytest.raises(DatasetError, match=r"m\.jsonl:2: no ground truth"):
        build_task(task_cfg(name="math", path=path, eval_size=1))


def test_math_ground_truth_with_an_escaped_dollar_is_compared(tmp_path):
    """MATH's `\\boxed{\\$18.90}`: the `\\$` was taken for a LaTeX delimiter, the ground truth read as
    nothing, and the evaluation before step 1 raised."""
    rows = [{"problem": f"{i}+{i}?", "solution": f"$\\boxed{{{2 * i}}}$"} for i in range(3)]
    rows.append({"problem": "Three shirts at $\\$6.30$ each cost?", "solution": "$3\\cdot 6.30=\\boxed{\\$18.90}$."})
    task = build_task(task_cfg(name="math", path=write_jsonl(tmp_path / "m.jsonl", rows[:2]),
                               eval_path=write_jsonl(tmp_path / "e.jsonl", rows[2:]), eval_size=2))
    shirts = next(s for s in task.eval if s.prompt.startswith("Three shirts"))
    assert shirts.answer == "\\$18.90"
    assert task.is_correct("The total is \\boxed{18.90}", shirts) and task.is_correct("\\boxed{\\$18.90}", shirts)
    assert not task.is_correct("\\boxed{7}", shirts)


def test_a_held_out_ground_truth_math_verify_cannot_read_names_its_row(tmp_path):
    """Checked when the task is built, not at the first evaluation (which stopped the run)."""
    train = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": "\\boxed{1}"}])
    held = write_jsonl(tmp_path / "e.jsonl", [{"problem": "p", "solution": "\\boxed{2}"},
                                              {"problem": "q", "solution": "\\boxed{\\text{}}"}])
    with pytest.raises(DatasetError, match=r"e\.jsonl:2: math-verify could not parse the ground truth '\\\\text\{\}'"):
        build_task(task_cfg(name="math", path=train, eval_path=held, eval_size=2))
    held = write_jsonl(tmp_path / "g.jsonl", [GSM8K[0], {"question": "q", "answer": "#### \\text{}"}])
    with pytest.raises(DatasetError, match=r"g\.jsonl:2: math-verify could not parse the ground truth"):
        build_task(task_cfg(name="gsm8k", path=write_jsonl(tmp_path / "d.jsonl", GSM8K), eval_path=held, eval_size=2))


def test_a_jsonl_held_out_answer_math_verify_cannot_read_is_refused_at_build(tmp_path):
    """task=jsonl task.correct=math_verify: a held-out answer math-verify reads nothing of stopped the run at
    the first evaluation (ValueError, no file named), where gsm8k and math refuse it when the task is built."""
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    held = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "7+1=", "answer": "8"}, {"prompt": "q", "answer": "\\text{}"}])
    with pytest.raises(DatasetError, match=r"e\.jsonl: the held-out row with prompt 'q': math-verify could not parse"):
        build_task(task_cfg(name="jsonl", path=train, eval_path=held, eval_size=2, correct="math_verify"))
    assert len(build_task(task_cfg(name="jsonl", path=train, eval_path=held, eval_size=2)).eval) == 2  # exact: as written


def test_countdown_task_holds_out_rows_and_checks_equations(tmp_path):
    rows = [{"nums": [3, 5, 2], "target": 13}, {"nums": [4, 6], "target": 24}, {"nums": [10, 2, 1], "target": 4}]
    task = build_task(task_cfg(name="countdown", path=write_jsonl(tmp_path / "c.jsonl", rows), eval_size=1))
    assert len(task.train) == 2 and len(task.eval) == 1
    s = next(x for x in task.train + task.eval if x.meta["target"] == 13)
    assert s.prompt.startswith("Using the numbers [3, 5, 2], create an equation that equals 13.")
    assert task.is_correct("<think>3*5=15</think> <answer>3 * 5 - 2</answer>", s)  # 15 - 2 = 13
    assert not task.is_correct("<answer>3 * 5 + 2</answer>", s)  # 17
    assert not task.is_correct("<answer>13</answer>", s)  # does not use the numbers


@pytest.mark.parametrize("nums", ["1 2", [True, 2], []])
def test_countdown_bad_row(tmp_path, nums):
    path = write_jsonl(tmp_path / "c.jsonl", [{"nums": [1, 2], "target": 3}, {"nums": nums, "target": 3}])
    with pytest.raises(DatasetError, match=r"c\.jsonl:2: column 'nums' must be a non-empty list of integers"):
        build_task(task_cfg(name="countdown", path=path, eval_size=1))


def test_arithmetic_task():
    task = build_task(task_cfg(name="arithmetic", digits=1, eval_size=40))
    assert len(task.train) == 60 and len(task.eval) == 40  # 10 x 10 questions
    s = next(x for x in task.train + task.eval if x.prompt.startswith("What is 7 + 5?"))
    assert s.prompt == "What is 7 + 5? Answer with just the number." and s.answer == "12"
    assert task.is_correct("The answer is 12.", s) and not task.is_correct("7 + 5 = 13", s)
    # restating the question's sum is not answering it: a policy copying "a + b" scored every eval prompt
    for echo in ("7 + 5", "\\boxed{7+5}", "To find 7 + 5, we", "The sum of 7 + 5", "7 + 5 ="):
        assert not task.is_correct(echo, s), echo
    assert task.is_correct("7 + 5 = 12", s) and task.is_correct("\\boxed{12}", s)
    assert not any(task.is_correct(e.prompt.split("What is ")[1].split("?")[0], e) for e in task.eval)
    two = build_task(task_cfg(name="arithmetic", digits=2, eval_size=100))
    assert len(two.train) + len(two.eval) == 90 * 90  # operands 10..99, no leading zeros


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_prompts_without_a_chat_template_are_plain_text():
    tok = build_char_tokenizer()  # the tiny model's: no chat template
    assert format_prompt(tok, "07+45=") == ("07+45=", False)
    assert format_prompt(tok, "q", system_prompt="sys") == ("sys\n\nq", False)
    # BOS (id 1) then one id per character, as before chat templates existed
    assert encode_prompts(tok, [type("S", (), {"prompt": "1+2="})()]) == [[1] + tok("1+2=", add_special_tokens=False).input_ids]
    with pytest.raises(ValueError, match="task.chat_template=always but the tokenizer has no chat template"):
        format_prompt(tok, "q", chat_template="always")


def test_prompts_through_the_tokenizers_chat_template():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT
    assert format_prompt(tok, "q", system_prompt="sys") == ("<system>sys</system><user>q</user><assistant>", True)
    assert format_prompt(tok, "q") == ("<user>q</user><assistant>", True)
    assert format_prompt(tok, "q", chat_template="never") == ("q", False)
    ids = encode_prompts(tok, [type("S", (), {"prompt": "q"})()])[0]
    assert tok.decode(ids) == "<user>q</user><assistant>"  # the template's text only: no extra BOS
    assert ids[0] != tok.bos_token_id


@pytest.mark.starts_process
@pytest.mark.parametrize("task, reward", [("gsm8k", "math_verify"), ("countdown", "countdown")])
def test_a_short_run_on_a_local_data_set(make_cfg, tmp_path, task, reward):
    """The whole loop on a data-set task read from local files (tiny model, no warm start: the
    plumbing, not learning)."""
    from grpo.train import train

    rows = GSM8K if task == "gsm8k" else [{"nums": [i, i + 1, 2], "target": 2 * i + 3} for i in range(6)]
    path = write_parquet(tmp_path / "train.parquet", rows)
    summary = train(make_cfg(f"task={task}", f"task.path={path}", "task.eval_size=2", f"reward={reward}",
                             "model.tiny.warm_start_accuracy=0", "steps=1", "algo.batch_size=8", "algo.group_size=4"))
    assert summary["steps"] == 1 and summary["eval_after"] in (0.0, 0.5, 1.0)  # 2 held-out rows
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    step = next(r for r in rows if r["step"] == 1 and "reward/mean" in r)
    value = step[f"reward/{reward}"]
    assert isinstance(value, float) and math.isfinite(value)  # scored: a number, not null (no completion excluded)
