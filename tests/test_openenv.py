"""env=openenv (grpo/envs/openenv.py) against a loopback OpenEnv server built with openenv-core itself:
grpo's guess-the-number game behind OpenEnv's `create_app`, served by uvicorn on a free port in a
thread. The adapter plays it by value, a 2-step training run plays several turns per episode
against it, and the errors a user can fix say what to change."""

from __future__ import annotations

import ast
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from grpo.envs import GuessEnv
from grpo.errors import ConfigError
from grpo.tasks.base import Sample
from tests.conftest import FAST, ROOT, compose_cfg


def guess_app(max_sessions: int, miss_reward: float | None = 0.0):
    """OpenEnv's server for grpo/envs/guess.py's game: the action's `message` is the guess, the
    observation's `message` is "<", ">" or "?" (empty on reset and on the hit, which gives reward 1).
    The secret is reset's `answer` (the task's sample, sent by env.kwargs.reset_fields=[answer]).
    A miss's reward is `miss_reward` (the game's 0.0; None: the Observation's reward left unset)."""
    from openenv.core.env_server import Action, Environment, Observation, State, create_app

    class GuessAction(Action):
        message: str

    class GuessObservation(Observation):
        message: str = ""

    class GuessEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # one session per trajectory, many at once

        def __init__(self):
            super().__init__()
            self.game, self.steps = GuessEnv(), 0

        def reset(self, seed=None, episode_id=None, answer=None, **kwargs):
            self.game.reset(Sample("", str(answer)), seed or 0)
            self.steps = 0
            return GuessObservation()

        def step(self, action, timeout_s=None, **kwargs):
            step = self.game.step(action.message)
            self.steps += 1
            reward = step.reward if step.done else miss_reward
            return GuessObservation(message=step.observation or "", reward=reward, done=step.done)

        @property
        def state(self):
            return State(step_count=self.steps)

    return create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_sessions)


class Loopback:
    """uvicorn serving `app` on 127.0.0.1, a free port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the loopback OpenEnv server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        self.errors: list[str] = []  # what the server logged as errors (uvicorn configures its loggers on start)
        self.handler = logging.Handler(logging.ERROR)
        self.handler.emit = lambda record: self.errors.append(record.getMessage())
        logging.getLogger("uvicorn.error").addHandler(self.handler)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        logging.getLogger("uvicorn.error").removeHandler(self.handler)


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openenv.core", reason="the extra grpo[openenv] (part of dev)")
    loopback = Loopback(guess_app(max_sessions=256))  # a batch's sessions, and the last batch's still closing
    yield loopback
    loopback.stop()


def test_the_adapter_plays_guess_on_an_openenv_server_by_value(server):
    from grpo.envs.openenv import OpenEnvAdapter

    env = OpenEnvAdapter(server.url, reset_fields=["answer"])
    assert env.observation_field == "message"  # the Observation's only text field
    assert env.reset(Sample("Guess 1-15:", "7"), seed=3) is None  # an empty reset observation: nothing shown
    # secret 7: 8 -> "<" (lower), 4 -> ">", not a number -> "?", 6 -> ">", 7 -> the hit, reward 1, done
    steps = [env.step(guess) for guess in ("8", "4", "x", "6", "7")]
    assert [(s.observation, s.reward, s.done) for s in steps] == [
        ("<", 0.0, False), (">", 0.0, False), ("?", 0.0, False), (">", 0.0, False), ("", 1.0, True)]
    assert steps[0].info == {"message": "<"}  # every field of the observation
    env.close()
    # a second episode on a fresh session: the server's state is per trajectory
    again = OpenEnvAdapter(server.url, reset_fields=["answer"])
    assert again.reset(Sample("Guess 1-15:", "3"), seed=0) is None
    assert again.step("3").reward == 1.0
    again.close()
    time.sleep(0.2)
    assert server.errors == []  # sessions end cleanly: no traceback on the server per trajectory


def test_a_server_step_without_a_reward_is_no_reward_not_a_zero():
    """An Observation's reward is optional (null in its schema): a step without one is Step.reward None
    ("none given": the episode's reward is its other steps'), never 0.0, which a run would average in."""
    pytest.importorskip("openenv.core", reason="the extra grpo[openenv] (part of dev)")
    from grpo.envs.openenv import OpenEnvAdapter

    loopback = Loopback(guess_app(max_sessions=4, miss_reward=None))
    try:
        env = OpenEnvAdapter(loopback.url, reset_fields=["answer"])
        env.reset(Sample("Guess 1-15:", "7"), seed=0)
        assert [env.step(guess).reward for guess in ("8", "4", "7")] == [None, None, 1.0]
        env.close()
    finally:
        loopback.stop()


def test_setup_mistakes_are_config_errors_that_say_what_to_change(server, monkeypatch):
    from grpo.envs import openenv as adapter
    from grpo.envs.openenv import OpenEnvAdapter

    with pytest.raises(ConfigError, match=r"action_field='code' is not a field .*\['message', 'metadata'\]"):
        OpenEnvAdapter(server.url, action_field="code")
    with pytest.raises(ConfigError, match=r"observation_field='text' is not a field"):
        OpenEnvAdapter(server.url, observation_field="text")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConfigError, match="no OpenEnv server answered at env.kwargs.base_url"):
        OpenEnvAdapter(closed)
    env = OpenEnvAdapter(server.url, reset_fields=["secret"])
    with pytest.raises(ConfigError, match="reset_fields names 'secret'"):
        env.reset(Sample("Guess 1-15:", "7"), seed=0)
    env.close()

    # OpenEnv's default is one session per server; grpo opens one per trajectory at once
    small = Loopback(guess_app(max_sessions=1))
    try:
        first, second = OpenEnvAdapter(small.url, reset_fields=["answer"]), OpenEnvAdapter(small.url, reset_fields=["answer"])
        assert first.reset(Sample("", "5"), seed=0) is None
        second.call(second.client.connect())  # the server refuses the session at once and closes the socket:
        time.sleep(0.3)  # the reset's message then meets a closed socket, its refusal still unread
        with pytest.raises(ConfigError, match="max_concurrent_envs"):
            second.reset(Sample("", "5"), seed=1)
        first.close()
        second.close()
    finally:
        small.stop()

    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)  # as if openenv-core were not installed
    with pytest.raises(ConfigError, match=r"pip install 'grpo\[openenv\]'"):
        adapter.OpenEnvAdapter(server.url)


@pytest.mark.starts_process
def test_only_the_adapter_imports_openenv():
    """The core never imports openenv: read from the source (function bodies included), and at run
    time (importing grpo.envs and resolving env=openenv loads no openenv module)."""
    importers = []
    for path in (ROOT / "grpo").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "openenv" or n.startswith("openenv.") for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["grpo/envs/openenv.py"]
    code = ("import sys, grpo.envs; grpo.envs.resolve_env('openenv'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'openenv'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_guess_training_run_through_the_openenv_server_equals_env_guess(server, tmp_path, cache_dir):
    """experiment=guess_tiny with env=openenv: the tiny model's episodes go turn by turn through the
    OpenEnv server ("<" or ">" between guesses, reward 1 on a hit), and train exactly as the same
    game played in process (env=guess): the same episodes, rewards and losses, step by step."""
    from grpo.train import train

    def run(name, *env):
        # threads pinned: threads=auto counts the CPUs idle at each run's start, and two runs compared
        # bit for bit must not differ in that (under make test-all the other worker's runs keep a core busy)
        cfg = compose_cfg(*FAST, "experiment=guess_tiny", *env, "env.max_observation_tokens=4", "algo.batch_size=64",
                          "steps=2", "eval_every=0", "checkpoint_every=0", "threads=1", run_dir=str(tmp_path / name),
                          cache=cache_dir)
        train(cfg)
        rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
        return [{k: v for k, v in r.items() if k.startswith(("episode/", "reward/", "loss", "sampler_diff", "kl"))
                 and k != "episode/env_s"} for r in rows if "loss" in r]

    errors_before = len(server.errors)
    served = run("openenv", "env=openenv", f"env.kwargs.base_url='{server.url}'", "env.kwargs.reset_fields=[answer]")
    assert len(served) == 2 and max(r["episode/turns_max"] for r in served) > 1
    assert all(r["episode/errors"] == 0 and r["episode/observation_tokens"] > 0 for r in served)
    assert all(r["reward/mean"] > 0 and r["episode/finish_stop"] > 0 for r in served)  # hits: reward 1 each
    assert len(server.errors) == errors_before  # 128 sessions opened and closed cleanly
    assert served == run("in_process", "env=guess")


def serve_schema(schema: dict) -> tuple:
    """A plain HTTP server on a free port answering GET /schema with `schema` (no OpenEnv needed):
    what `server_fields` reads before any session."""
    import http.server

    body = json.dumps(schema).encode()

    class Schema(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/schema" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Schema)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def test_the_schema_check_names_the_text_field_or_refuses_an_ambiguous_or_unservable_one():
    """Two text fields and no env.kwargs.observation_field: refused (taking the first would show the policy
    a field no one chose); an Action requiring a second field: refused (only action_field is sent); a named
    observation field the Observation lacks: refused; the one text field beside done/reward/metadata: taken."""
    from grpo.envs.openenv import server_fields

    action = {"properties": {"message": {"type": "string"}}, "required": ["message"]}
    base = {"done": {"type": "boolean"}, "reward": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            "metadata": {"type": "object"}}
    two = {"action": action, "observation": {"properties": {**base, "board": {"type": "string"},
                                                            "hint": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}
    one = {"action": action, "observation": {"properties": {**base, "board": {"type": "string"}}}}
    needs_two = {"action": {"properties": {"message": {"type": "string"}, "game": {"type": "string"}},
                            "required": ["message", "game"]}, "observation": one["observation"]}
    servers = [serve_schema(s) for s in (two, one, needs_two)]
    try:
        (_, ambiguous), (_, single), (_, demanding) = servers
        with pytest.raises(ConfigError, match=r"has 2 text fields \(\['board', 'hint'\]\); set env.kwargs.observation_field"):
            server_fields(ambiguous, "message", None, 5.0)
        assert server_fields(ambiguous, "message", "hint", 5.0) == "hint"
        assert server_fields(single, "message", None, 5.0) == "board"
        with pytest.raises(ConfigError, match=r"observation_field='text' is not a field of the Observation"):
            server_fields(single, "message", "text", 5.0)
        with pytest.raises(ConfigError, match=r"also requires \['game'\]"):
            server_fields(demanding, "message", None, 5.0)
    finally:
        for httpd, _ in servers:
            httpd.shutdown()


def test_websocket_urls_read_the_schema_over_the_matching_http_scheme():
    from grpo.envs.openenv import http_url

    assert [http_url(u) for u in ("wss://env.example:443/", "ws://127.0.0.1:8000", "localhost:8000", "https://h")] == [
        "https://env.example:443", "http://127.0.0.1:8000", "http://localhost:8000", "https://h"]


def test_one_reset_field_given_without_brackets_is_that_field(monkeypatch):
    """env.kwargs.reset_fields=answer (a str, not [answer]) sends the sample's answer, not its letters."""
    import grpo.envs.openenv as openenv

    class Client:
        def __init__(self, **_):
            pass

        async def reset(self, **data):
            return type("Result", (), {"observation": {"message": str(data)}})()

    monkeypatch.setattr(openenv, "server_fields", lambda *_: "message")  # the server's /schema, not needed here
    monkeypatch.setattr(openenv, "client_class", lambda: Client)
    env = openenv.OpenEnvAdapter("http://localhost:8000", reset_fields="answer")
    assert env.reset_fields == ["answer"]
    assert env.reset(Sample("Guess 1-15:", "7"), 3) == str({"seed": 3, "answer": "7"})
