"""Shared fixtures: compose the real Hydra config and shrink it; a tiny model built in code. And the
tiers' marks: which tests start a process, an engine, a server or a training run."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import signal
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import grpo.rollout.colocated
import grpo.train
from grpo.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Small enough for a test to run a few steps in seconds, big enough to be a real GRPO step.
FAST = [
    "steps=3",
    "algo.batch_size=32",
    "algo.group_size=4",
    "algo.warmup_steps=1",
    "logger.log_every=1",
    "logger.sample_every=0",
    "checkpoint_every=0",
]

register_configs()


# The tiers (docs/testing.md, "How tests are marked"). A test that starts a process, an engine, a
# server or a training run (in this process too) is marked `starts_process`: here, by a fixture of
# STARTING_FIXTURES it uses (directly or through another fixture), by the tiers made of runs (`slow`,
# `slurm`, `gpu`), or by its own `@pytest.mark.starts_process` where it starts one itself. `make test`
# runs the tests that are not marked and the `e2e_smoke` ones (one short run per rollout backend and
# parallel strategy); `make test-all` runs every one. An unmarked test that starts one fails
# (`pytest_runtest_setup` and `pytest_runtest_call` below), so a missing mark cannot hide a slow test
# in the fast tier.
STARTING_FIXTURES = {
    "server": "a `grpo.serve` process (test_remote, test_judge, test_trajectories); an OpenEnv server (test_openenv)",
    "rm_server": "a `grpo.serve --reward-model` process (test_reward_model_served)",
    "engine": "an in-process vLLM engine (test_rollout_vllm)",
    "judge_url": "a `grpo.serve` of SmolLM2-135M, or none (test_experiments)",
    "references": "tests/ddp_step.py's one-process references (test_sequence_parallel)",
}
TIERS_OF_RUNS = ("slow", "slurm", "gpu")


def starts_process(item) -> bool:
    return (any(item.get_closest_marker(tier) is not None for tier in ("starts_process", *TIERS_OF_RUNS))
            or not STARTING_FIXTURES.keys().isdisjoint(item.fixturenames))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if starts_process(item) and item.get_closest_marker("starts_process") is None:
            item.add_marker("starts_process")
        if item.get_closest_marker("e2e_smoke") and item.get_closest_marker("starts_process") is None:
            raise pytest.UsageError(f"{item.nodeid} is marked e2e_smoke but starts nothing")


# What the running unmarked test has started (None outside one): the watchers below, installed once for
# the session (a test's own monkeypatch of the same functions then stacks on them), write into it.
STARTED: dict[str, list[str] | None] = {"by_test": None}
COSTLY_PROGRAMS = ("torchrun", "bash", "sh")  # and every python*: a child that imports torch, vLLM or grpo


def started(what: str) -> None:
    if STARTED["by_test"] is not None:
        STARTED["by_test"].append(what)


def watch_starts() -> None:
    """Watch for a Python (or shell, torchrun) child process, a multiprocessing child (torch's spawn
    included), a run of grpo.train's loop (`grpo.train.run`, in this process too) and an in-process vLLM
    engine (`grpo.rollout.colocated.build_llm`). Probes a library runs (`uname -p`, `git rev-parse`,
    `lscpu`) are not watched: they cost nothing."""
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
    run, build_llm = grpo.train.run, grpo.rollout.colocated.build_llm

    def watched_popen_init(self, args, *rest, **kw):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(os.fsdecode(argv[0]).split()[0]) if argv else ""
        if program.startswith("python") or program in COSTLY_PROGRAMS:
            started(f"a process {[os.fsdecode(a) for a in argv][:6]}")
        popen_init(self, args, *rest, **kw)

    def watched_process_start(self):
        started(f"a multiprocessing child {self.name}")
        process_start(self)

    def watched_run(*args, **kw):
        started("a training run (grpo.train.run)")
        return run(*args, **kw)

    def watched_build_llm(*args, **kw):
        started("an in-process vLLM engine (grpo.rollout.colocated.build_llm)")
        return build_llm(*args, **kw)

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = watched_popen_init, watched_process_start
    grpo.train.run, grpo.rollout.colocated.build_llm = watched_run, watched_build_llm


watch_starts()


def watched(item, phase: str):
    """Run one phase of an unmarked test with STARTED collecting; fail it if it started anything."""
    STARTED["by_test"] = []
    try:
        result = yield
    finally:
        seen, STARTED["by_test"] = STARTED["by_test"], None
    if seen:
        pytest.fail(f"{item.nodeid} is not marked starts_process but its {phase} started {seen[0]}"
                    f"{f' (and {len(seen) - 1} more)' if len(seen) > 1 else ''}: mark the test "
                    "(@pytest.mark.starts_process) or, if a fixture started it, add the fixture to "
                    "STARTING_FIXTURES in tests/conftest.py", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("starts_process"):
        return (yield)
    return (yield from watched(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("starts_process"):
        return (yield)
    return (yield from watched(item, "call"))


@pytest.fixture(autouse=True)
def python_ctrl_c(request):
    """Each test starts with Python's own Ctrl-C (SIGINT raises KeyboardInterrupt), as a user's process
    has it, whatever ran before it in this process (under `make test-all`'s workers the files share
    processes in another order than alone). A test that leaves another handler behind is named in a
    warning, and the default is put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"{request.node.nodeid} left SIGINT handled by {left!r}; put Python's default back")


@pytest.fixture
def refused_url():
    """A maker of URLs on which nothing listens, each port held (bound, never listening) until the test
    ends: a connection there is refused at once, and no other process (another xdist worker's server,
    an outgoing connection) can be given the port meanwhile, as it could one `free_port` picked."""
    held = []

    def make() -> str:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        held.append(s)
        return f"http://127.0.0.1:{s.getsockname()[1]}"

    yield make
    for s in held:
        s.close()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One tiny-model cache for the session (GRPO_CACHE wins if set, to reuse builds across runs). Under
    pytest-xdist (`make test-all`'s workers) the workers share one: a folder is published by an atomic
    rename (grpo/packaged.py), so two workers that build the same model at once keep the first."""
    if os.environ.get("GRPO_CACHE"):
        return os.environ["GRPO_CACHE"]
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return str(tmp_path_factory.mktemp("grpo-cache"))
    shared = tmp_path_factory.getbasetemp().parent / "grpo-cache"  # the run's root, above each worker's own
    shared.mkdir(exist_ok=True)
    return str(shared)


def measured(rows: list[dict], key: str = "sampler_diff") -> list[float]:
    """The steps' `key` where a step measured it: one whose groups were all flat (algo.zero_std_groups=drop,
    the default) trains no token and logs null (NaN as read_metrics reads it back), not 0 (which read as
    parity). At least one step must."""
    values = [r[key] for r in rows if r[key] is not None and r[key] == r[key]]
    assert values, f"no step measured {key} (every step's groups were flat): {rows}"
    return values


def compose_cfg(*overrides: str, run_dir: str | None = None, cache: str | None = None):
    extra = [f"run_dir={run_dir}"] if run_dir else ["run_dir=unused"]
    if cache:
        extra.append(f"model.cache_dir={cache}")
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[*extra, *overrides])


@pytest.fixture
def make_cfg(tmp_path, cache_dir):
    """Compose the real config with FAST values, a fresh run folder and the session's model cache."""

    def _make(*overrides: str, fast: bool = True):
        return compose_cfg(*(FAST if fast else []), *overrides, run_dir=str(tmp_path / "run"), cache=cache_dir)

    return _make


@pytest.fixture(scope="session")
def tiny_lm():
    """A randomly initialised tiny Qwen2 and the char tokenizer (no warm start, no disk)."""
    from grpo.config import TinyModelConfig
    from grpo.tiny.text import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    return model.float(), tok


@pytest.fixture(scope="session")
def random_rm():
    """A tiny Qwen2ForSequenceClassification at random (no training) with the char tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from grpo.tiny.text import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, num_labels=1)
    return Qwen2ForSequenceClassification(config).eval(), tok


@pytest.fixture(scope="session")
def rm_dir(random_rm, tmp_path_factory) -> str:
    """`random_rm` saved as an HF folder, for servers and `load_reward_model`."""
    model, tok = random_rm
    path = tmp_path_factory.mktemp("random-rm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# What a hub model's generation_config.json may hold (Qwen2.5-Instruct ships a repetition_penalty,
# top_k and top_p of its own): every engine and `generate` would apply these unless the backend pins
# its sampling to what the trainer's logprobs assume. Written into the test folders engines load.
HUB_GENERATION_DEFAULTS = {"repetition_penalty": 1.3, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.1,
                           "no_repeat_ngram_size": 2}


def with_hub_generation_defaults(folder) -> str:
    """Write HUB_GENERATION_DEFAULTS as `folder`'s generation_config.json, and check that transformers
    reads them (else a test on this folder could not fail)."""
    from transformers import GenerationConfig

    GenerationConfig(**HUB_GENERATION_DEFAULTS, do_sample=True).save_pretrained(folder)
    loaded = GenerationConfig.from_pretrained(folder)
    assert all(getattr(loaded, k) == v for k, v in HUB_GENERATION_DEFAULTS.items()), loaded
    return str(folder)


@pytest.fixture(scope="module")
def model_dir(tiny_lm, tmp_path_factory):
    """`tiny_lm` saved as an HF folder (config, safetensors, tokenizer, and a hub model's sampling
    defaults in generation_config.json), for engines that load from disk."""
    model, tok = tiny_lm
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return with_hub_generation_defaults(path)


@pytest.fixture(scope="session")
def learning_policy(cache_dir) -> str:
    """The default tiny model, built once in the session's cache: the precondition of every test that
    asserts clipping, moved weights, a growing sampler/trainer difference or learning. A policy that
    never earns a reward changes nothing, whatever the code under test does, so this asserts its warm
    start reached the target before such a test reads anything else."""
    from grpo.tiny.folders import resolve_model_folder

    cfg = compose_cfg(cache=cache_dir)
    path = resolve_model_folder(cfg, log=lambda *_: None)  # raises WarmStartError below the target
    info = json.load(open(os.path.join(path, "grpo_tiny.json")))
    target = cfg.model.tiny.warm_start_accuracy
    assert info["warm_start_train_accuracy"] >= target, (
        f"precondition (a learning policy): the tiny model in {path} reached greedy train accuracy "
        f"{info['warm_start_train_accuracy']:.3f}, below its target {target}")
    return path


def assert_rewards_vary(rows: list[dict]) -> None:
    """Precondition of a test that needs a gradient: some group of some step had rewards that differ."""
    assert any(r["reward/zero_std_frac"] < 1 for r in rows), (
        "precondition (a learning signal): every group of every step had equal rewards, so nothing could "
        f"train; zero_std_frac per step: {[r['reward/zero_std_frac'] for r in rows]}")


@pytest.fixture(scope="session")
def hub_like_policy(learning_policy, tmp_path_factory) -> str:
    """The warm-started tiny model's folder plus a hub model's generation_config.json: a run on it
    keeps sampler_diff at ~1e-6 only if the backend samples exactly what the trainer scores."""
    import shutil

    path = tmp_path_factory.mktemp("hub-like") / "model"
    shutil.copytree(learning_policy, path)
    return with_hub_generation_defaults(path)


def wait_for(ready, proc, log_path, what: str, timeout_s: float, every_s: float = 1.0) -> None:
    """Poll `ready()` until it is true while `proc` runs. `proc` exiting first, or `timeout_s` passing
    (the process then stopped), fails with the end of its log (`log_path`; None: no log kept)."""
    import time

    def log_tail() -> str:
        return Path(log_path).read_text()[-3000:] if log_path else "(no log kept)"

    deadline = time.time() + timeout_s
    while not ready():
        assert proc.poll() is None, f"{what}: the process exited with {proc.returncode}: {log_tail()}"
        if time.time() > deadline:
            stop_served(proc)
            raise AssertionError(f"{what}: not within {timeout_s} s: {log_tail()}")
        time.sleep(every_s)


def answers(url: str) -> bool:
    """Whether an HTTP server answers `url` (any status but an error)."""
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except OSError:
        return False


@contextlib.contextmanager
def server_scratch():
    """The environment entries giving a server a TMPDIR of its own directly in /tmp (its scratch folder,
    grpo/scratch.py, is made there: under pytest-xdist's deeper tmp_path a socket's path would not fit,
    and it fell back to /tmp itself), with the tests' warm compile cache; the folder is removed after the
    block. A server stopped by SIGKILL cannot remove its scratch folder (vLLM's sockets, its FileStore
    file): test_judge's and test_servers' left one in /tmp at every run."""
    import shutil
    import tempfile

    from grpo.scratch import inductor_cache_dir

    tmp = tempfile.mkdtemp(prefix="grpo-test-", dir="/tmp")
    try:
        yield {"TMPDIR": tmp, "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def serve_tiny(model_dir: str, log_path, token: str, *extra_args: str, max_model_len: int = 128,
               start_timeout_s: float = 240, env: dict[str, str] | None = None):
    """A real `python -m grpo.serve` of `model_dir` on a port it finds free and listens on before it names
    it (`--port 0 --url-dir`, read back by server_watch.wait_for_url, as the trainer's own servers are),
    its routes guarded by `token` (given in the environment, never on a command line), `extra_args` after
    the common ones (`--lora-rank 8`, `--reward-model`), `env` added to the server's environment
    (`server_scratch`); returns (process, url) once /health answers. Stop
    it with `stop_served`. The one start-and-wait of the tests' servers: remote, judge, per-trajectory,
    LoRA and reward-model tests."""
    import sys
    import tempfile

    from grpo.auth import TOKEN_ENV
    from grpo.rollout.dedicated import engine_exit
    from grpo.rollout.server_watch import wait_for_url

    url_dir = tempfile.mkdtemp(prefix="grpo-test-serve-", dir=os.path.dirname(str(log_path)))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo.serve", "--model", model_dir, "--port", "0", "--url-dir", url_dir,
             "--max-model-len", str(max_model_len), "--memory-fraction", "0.1", *extra_args],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {}), TOKEN_ENV: token},
        )
    deadline = time.monotonic() + start_timeout_s  # one budget for the URL and /health
    try:
        url = wait_for_url(url_dir, start_timeout_s, lambda: engine_exit(proc, str(log_path)), f"grpo.serve of {model_dir}")
    except BaseException:  # not left running, as wait_for leaves nothing
        stop_served(proc)
        raise
    wait_for(lambda: answers(url + "/health"), proc, log_path, "grpo.serve to answer /health", max(1.0, deadline - time.monotonic()))
    return proc, url


def stop_served(proc) -> None:
    """Ctrl-C to the server's process group, as a user stops it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
