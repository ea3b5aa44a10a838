"""Tasks: the synthetic split, local jsonl files with row-level errors, and a resumable sampler."""

import json
import pickle
import re
import warnings

import pytest
from omegaconf import OmegaConf

from grpo.config import TaskConfig, validate
from grpo.errors import ConfigError
from grpo.tasks import TrainSampler, build_task, check_task
from grpo.tasks.base import Sample, Task
from grpo.tasks.jsonl import DatasetError
from tests.conftest import CONF, compose_cfg


def task_cfg(**kw):
    return OmegaConf.structured(TaskConfig(**kw))


def test_addition_split_is_disjoint_and_correct():
    task = build_task(task_cfg(name="addition", digits=2, eval_size=100))
    assert len(task.train) == 9900 and len(task.eval) == 100
    assert not {s.prompt for s in task.eval} & {s.prompt for s in task.train}
    s = task.train[0]
    a, b = s.prompt.rstrip("=").split("+")
    assert s.answer == f"{int(a) + int(b):03d}" and len(a) == len(b) == 2


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_task_loads_rows(tmp_path):
    rows = [json.dumps({"prompt": f"q{i}", "answer": str(i), "level": i % 3}) for i in range(10)]
    task = build_task(task_cfg(name="jsonl", path=write(tmp_path / "d.jsonl", rows), eval_size=3))
    assert len(task.train) == 7 and len(task.eval) == 3
    assert {"level"} == set(task.train[0].meta)


def test_jsonl_task_holds_out_its_eval_file(tmp_path):
    """task.eval_path was never read by task=jsonl: evaluation ran on rows of the train file. Now the
    train file trains whole, and eval_size rows of the eval file (seeded) are held out."""
    train = write(tmp_path / "train.jsonl", [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(10)])
    held = write(tmp_path / "test.jsonl", [json.dumps({"prompt": f"t{i}", "answer": str(i)}) for i in range(5)])
    task = build_task(task_cfg(name="jsonl", path=train, eval_path=held, eval_size=3))
    assert len(task.train) == 10 and len(task.eval) == 3 and {s.prompt[0] for s in task.eval} == {"t"}
    again = build_task(task_cfg(name="jsonl", path=train, eval_path=held, eval_size=3))
    assert [s.prompt for s in again.eval] == [s.prompt for s in task.eval]
    with pytest.raises(DatasetError, match="task.eval_path=.*nope.jsonl' does not exist"):
        build_task(task_cfg(name="jsonl", path=train, eval_path=str(tmp_path / "nope.jsonl"), eval_size=3))


def test_jsonl_answers_may_be_numbers_and_eval_may_compare_by_value(tmp_path):
    """{"answer": 4} was refused as "not a non-empty string"; it is the number as written. And eval
    counted exact matches only, whatever the reward: with reward=math_verify, '0.5' for '1/2' scored 1
    in training and counted as wrong in eval/accuracy. task.correct=math_verify compares by value, and
    validate warns about the mismatch."""
    import warnings

    rows = [json.dumps({"prompt": f"q{i}", "answer": a}) for i, a in enumerate([4, 0.5, "1/2", 7, 8, 9])]
    path = write(tmp_path / "d.jsonl", rows)
    exact = build_task(task_cfg(name="jsonl", path=path, eval_size=1))
    answers = {s.prompt: s.answer for s in exact.train + exact.eval}
    assert answers["q0"] == "4" and answers["q1"] == "0.5"
    # as written in the file, not as Python prints the float: exact match judged "1.50" wrong for 1.50
    raw = ['{"prompt": "a", "answer": 1.50}', '{"prompt": "b", "answer": 1e2}', '{"prompt": "c", "answer": -0.10}',
           '{"prompt": "d", "answer": 12345678901234567890, "w": 2.50}']
    written = build_task(task_cfg(name="jsonl", path=write(tmp_path / "w.jsonl", raw), eval_size=1))
    samples = {s.prompt: s for s in written.train + written.eval}
    assert {p: s.answer for p, s in samples.items()} == {"a": "1.50", "b": "1e2", "c": "-0.10", "d": "12345678901234567890"}
    assert written.is_correct("1.50", samples["a"]) and samples["d"].meta["w"] == 2.5  # other numbers stay numbers
    assert json.dumps(samples["d"].meta) == '{"w": 2.5}' and pickle.loads(pickle.dumps(samples["d"].meta))["w"] == 2.5
    half = next(s for s in exact.train + exact.eval if s.prompt == "q2")
    assert not exact.is_correct("0.5", half) and exact.is_correct(" 1/2 ", half)
    by_value = build_task(task_cfg(name="jsonl", path=path, eval_size=1, correct="math_verify"))
    assert by_value.is_correct("The answer is 0.5.", half) and not by_value.is_correct("0.25", half)
    with pytest.warns(UserWarning, match="task=jsonl counts eval/accuracy by exact match .* Set task.correct=math_verify"):
        validate(compose_cfg("task=jsonl", f"task.path={path}", "task.eval_size=1", "reward=math_verify"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        validate(compose_cfg("task=jsonl", f"task.path={path}", "task.eval_size=1", "reward=math_verify",
                             "task.correct=math_verify"))
    with pytest.raises(ConfigError, match="task.correct"):
        validate(compose_cfg("task=jsonl", f"task.path={path}", "task.correct=value"))
    with pytest.raises(ConfigError, match="task.correct='math_verify' is not read by task=addition"):
        check_task(compose_cfg("task.correct=math_verify").task)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a", "answer": "1"}', "{not json"], "d.jsonl:2: not valid JSON"),
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'], "d.jsonl:2: field 'answer' is missing"),
        (['{"prompt": "", "answer": "1"}'], "d.jsonl:1: field 'prompt' is missing or not a non-empty string"),
        # an answer of spaces: exact_match strips both sides, so an empty completion scored 1
        (['{"prompt": "a", "answer": "  "}'], "d.jsonl:1: field 'answer' is missing or not a non-empty string"),
        (['{"prompt": " \\n", "answer": "1"}'], "d.jsonl:1: field 'prompt' is missing or not a non-empty string"),
        (['["a", "1"]'], "d.jsonl:1: expected a JSON object"),
        (['{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}'],
         "d.jsonl:1: field 'prompt' is a list (chat messages); give the user's text as a string"),
        (['{"prompt": "a", "answer": true}'], "d.jsonl:1: field 'answer' is missing or not a non-empty string or a number"),
        ([""], "the file has no rows"),
        (['{"prompt": "a", "answer": NaN}'], "d.jsonl:1: field 'answer' is nan, which no completion can match"),
        (['{"prompt": "a", "answer": -Infinity}'], "d.jsonl:1: field 'answer' is -inf"),
    ],
)
def test_malformed_or_empty_dataset_names_file_and_line(tmp_path, lines, message):
    path = write(tmp_path / "d.jsonl", lines)
    with pytest.raises(DatasetError) as e:
        build_task(task_cfg(name="jsonl", path=path, eval_size=1))
    assert message in str(e.value)


def test_a_file_that_is_not_json_lines_is_named_as_such(tmp_path):
    """A CSV given to task=jsonl was refused as "d.csv:1: not valid JSON ... fix or remove that line"."""
    path = write(tmp_path / "d.csv", ["prompt,answer", "2+2,4"])
    with pytest.raises(DatasetError, match=r"task.path='.*d.csv': task=jsonl reads JSON lines .* convert the file"):
        build_task(task_cfg(name="jsonl", path=path, eval_size=1))
    for name in ("d.ndjson", "d.JSONL", "d"):  # JSON lines by another name: read
        rows = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(3)]
        assert len(build_task(task_cfg(name="jsonl", path=write(tmp_path / name, rows), eval_size=1)).train) == 2


def test_missing_dataset_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        build_task(task_cfg(name="jsonl", path=str(tmp_path / "nope.jsonl"), eval_size=1))


def test_eval_size_leaving_no_training_rows(tmp_path):
    path = write(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "1"}'] * 3)
    with pytest.raises(DatasetError, match="leaves no training rows"):
        build_task(task_cfg(name="jsonl", path=path, eval_size=3))


def test_sampler_resumes_exactly_across_epochs():
    task = build_task(task_cfg(name="addition", digits=1, eval_size=10))  # 90 training samples
    full = TrainSampler(task.train, seed=3)
    expected = [s.prompt for _ in range(7) for s in full.next(32)]  # crosses two epoch boundaries
    first = TrainSampler(task.train, seed=3)
    got = [s.prompt for _ in range(3) for s in first.next(32)]
    resumed = TrainSampler(task.train, seed=3)
    resumed.load_state_dict(first.state_dict())
    got += [s.prompt for _ in range(4) for s in resumed.next(32)]
    assert got == expected
    # every epoch is a permutation: each sample once
    one_epoch = TrainSampler(task.train, seed=3).next(90)
    assert sorted(s.prompt for s in one_epoch) == sorted(s.prompt for s in task.train)


def test_a_sampler_resumed_on_a_changed_train_split_says_so():
    """The checkpoint kept (epoch, pos) only: resumed on a data file with rows added or removed (the config the
    same, so no changed key was warned of), the rest of the pass repeated some prompts and skipped others, and
    a position past the new end started the next pass, with nothing said."""
    task = build_task(task_cfg(name="addition", digits=1, eval_size=10))  # 90 training samples
    first = TrainSampler(task.train, seed=3)
    first.next(64)
    same = TrainSampler(list(task.train), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(first.state_dict())  # the same rows: resumed without a word
        TrainSampler(task.train, seed=3).load_state_dict({"epoch": 0, "pos": 64})  # an older checkpoint's
    for changed in (task.train[:60], task.train[:89] + [Sample("9+9=", "17")]):
        resumed = TrainSampler(changed, seed=3)
        with pytest.warns(UserWarning, match=rf"resuming on another train split than the checkpoint's: {len(changed)} "
                                             r"training prompts, where it drew from 90 .* resume=false starts afresh"):
            resumed.load_state_dict(first.state_dict())
    assert (resumed.epoch, resumed.pos) == (0, 64)


def test_a_file_given_as_both_train_and_eval_is_refused(tmp_path):
    """task.eval_path naming task.path (here through another spelling of the same file) evaluated on
    prompts it also trained on: eval accuracy measured memory."""
    path = write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(10)])
    (tmp_path / "sub").mkdir()
    for name in ("jsonl", "gsm8k"):
        with pytest.raises(ConfigError, match=r"task.eval_path=.*sub/\.\./d.jsonl' is task.path .*every held-out prompt "
                                              r"would also be trained on. Drop task.eval_path"):
            check_task(task_cfg(name=name, path=path, eval_path=str(tmp_path / "sub" / ".." / "d.jsonl")))
    check_task(task_cfg(name="jsonl", path=path))  # eval_size rows of the file held out instead


def test_a_hub_eval_split_that_is_the_train_split_is_refused():
    """MATH-500 as docs/data.md gave it, without task.eval_split=null (default 'test'): the test split
    was loaded twice, and every eval prompt trained on."""
    math500 = ["task=math", "task.hub_id=HuggingFaceH4/MATH-500", "task.hub_config=null", "task.train_split=test"]
    with pytest.raises(ConfigError, match="task.eval_split='test' is task.train_split: every held-out prompt of "
                                          "HuggingFaceH4/MATH-500 would also be trained on. Set task.eval_split=null"):
        check_task(compose_cfg(*math500).task)
    check_task(compose_cfg(*math500, "task.eval_split=null").task)
    check_task(compose_cfg("task=gsm8k").task)  # train / test


@pytest.mark.parametrize("fields, message", [
    ({"name": "guess", "seed": 7}, "task.seed=7 is not read by task=guess"),
    ({"name": "jsonl", "path": "d.jsonl", "answer_format": "Be short."}, "task.answer_format='Be short.' is not read by task=jsonl"),
    ({"name": "addition", "answer_format": "Be short."}, "task.answer_format='Be short.' is not read by task=addition: it is "
                                                         "read by task=arithmetic, task=countdown, task=gsm8k, task=math"),
    ({"name": "shapes", "answer_format": "Be short."}, "task.answer_format='Be short.' is not read by task=shapes"),
    ({"name": "jsonl", "path": "d.jsonl", "size": 10}, "task.size=10 is not read by task=jsonl: it is read by task=shapes"),
    ({"name": "addition", "size": 10}, "task.size=10 is not read by task=addition"),
    ({"name": "jsonl", "path": "d.jsonl", "digits": 3}, "task.digits=3 is not read by task=jsonl: it is read by "
                                                        "task=addition, task=arithmetic. Drop it"),
    ({"name": "math", "digits": 3}, "task.digits=3 is not read by task=math"),
    ({"name": "addition", "train_split": "validation"}, "task.train_split='validation' is not read by task=addition"),
    ({"name": "guess", "eval_size": 4}, "task.eval_size=4: task=guess evaluates each of its 15 secrets once, so it takes "
                                        "task.eval_size=15 only"),
])
def test_a_task_setting_the_task_never_reads_is_refused(fields, message):
    """Each was accepted and changed nothing (guess's eval played 15 secrets when 4 were asked for)."""
    with pytest.raises(ConfigError) as e:
        check_task(task_cfg(**{"eval_size": 15, **fields}))
    assert message in str(e.value)


def test_every_task_file_passes_with_its_own_settings():
    """conf/task/*.yaml set only what their task reads (guess: eval_size 15)."""
    names = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
    assert len(names) == 8
    for name in names:
        check_task(compose_cfg(f"task={name}").task)
    check_task(compose_cfg("task=shapes", "task.size=256", "task.eval_size=16").task)
    check_task(compose_cfg("task=arithmetic", "task.digits=1", "task.eval_size=20", "task.answer_format=Reply.").task)


def test_chat_template_always_without_one_is_refused_at_validate_where_the_tokenizer_is_known(tiny_lm, tmp_path):
    """task.chat_template=always on a tokenizer without a template stopped in format_prompt with a ValueError
    traceback at the first prompt. It is a ConfigError there, and the tiny models' character tokenizer or
    a folder's saved tokenizer is known at validate, so it is refused before anything is built."""
    from grpo.config import known_model_config
    from grpo.prompts import format_prompt
    from grpo.tiny.folders import check_task_model

    _, tok = tiny_lm
    with pytest.raises(ConfigError, match=r"^task.chat_template=always but the tokenizer has no chat template; use "
                                          r"task.chat_template=auto or never."):
        format_prompt(tok, "1+1=", "always")

    def check(*overrides):
        cfg = compose_cfg(*overrides, "task.chat_template=always")
        check_task_model(cfg, known_model_config(cfg.model))

    folder = tmp_path / "model"
    tok.save_pretrained(folder)  # the character tokenizer: no chat template
    for model in (["model=tiny"], ["model=tiny_moe"], ["model=hub", f"model.path={folder}"]):
        with pytest.raises(ConfigError, match=rf"^task.chat_template=always but the tokenizer of model.path="
                                              rf"{model[-1].split('=')[1]} has no chat template; use task.chat_template=auto"):
            check(*model)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    tok.save_pretrained(folder)  # transformers writes chat_template.jinja
    check("model=hub", f"model.path={folder}")
    check("model=hub", "model.path=some-org/not-cached")  # unknown until the load: format_prompt says so then
    tok.chat_template = None


@pytest.mark.parametrize("prompt, answer, named", [("", "5", "prompt=''"), ("   ", "5", "prompt='   '"),
                                                  ("2+3=", 5, "answer='5' (int)"), ("2+3=", None, "answer='None' (NoneType)")])
def test_a_custom_tasks_sample_without_text_is_refused_when_the_task_is_built(prompt, answer, named):
    """A custom task's int or None answer failed deep in the first evaluation (`'int' object has no
    attribute 'strip'`), after setup; an empty prompt trained on nothing but the template."""
    with pytest.raises(DatasetError, match=rf"task 'mine': eval sample 1 has .*{re.escape(named)}.*a Sample's prompt is "
                                           r"non-empty text and its answer text"):
        Task("mine", train=[Sample("1+1=", "2")], eval=[Sample("1+2=", "3"), Sample(prompt, answer)])


def test_a_task_registered_in_tasks_alone_is_told_to_add_its_fields_to_reads(monkeypatch):
    """CONTRIBUTING's recipe (TASKS, conf/task/<name>.yaml) once missed READS: the new task's own yaml was
    refused with "task.eval_size=64 is not read by task=reverse ... Drop it", the wrong advice."""
    import grpo.tasks

    monkeypatch.setitem(grpo.tasks.TASKS, "reverse", lambda cfg: None)
    with pytest.raises(ConfigError, match=r"task=reverse is in TASKS but not in READS \(grpo/tasks/__init__.py\): add"):
        check_task(OmegaConf.structured(TaskConfig(name="reverse", eval_size=64)))


@pytest.mark.parametrize("name", ["gsm8k", "math", "countdown"])
def test_a_hub_tasks_own_file_beside_task_path_is_no_change(name):
    """The task's file sets hub_id, hub_config and the splits; with task.path they go unread, and
    only a value changed from the file's is refused (test_config: test_bad_values_say_what_to_change)."""
    validate(compose_cfg(f"task={name}", "task.path=t.jsonl"))
