"""env=openenv: an OpenEnv environment (github.com/meta-pytorch/OpenEnv), served by its own server, as a
grpo environment. Optional: `pip install 'grpo[openenv]'` (openenv-core, tested at 0.3.0); only this
module imports openenv, and only when an environment is built.

    grpo                      an OpenEnv server: create_app(Environment, Action, Observation)
    first make_env            GET /schema (once per process): the server answers, the fields exist
    reset(sample, seed)       WebSocket /ws, one session per trajectory: reset(seed=seed, **reset_fields)
                              -> the observation's text field (None when empty)
    step(text)                step({action_field: text}) -> Step(observation[observation_field],
                              reward, done, info = every field of the observation)
    close()                   ends the session

Text in, text out: the turn's text goes into one string field of the environment's Action
(`action_field`, "message" as in OpenEnv's echo and TextArena environments), and one string field of
its Observation (`observation_field`; by default its only one) is what the policy sees next.

One session per trajectory: the server must admit as many sessions as a batch has trajectories
(`create_app(..., max_concurrent_envs=N)`, on an Environment with SUPPORTS_CONCURRENT_SESSIONS =
True). OpenEnv's default is 1; a server that refuses a session raises a ConfigError, which stops the
run rather than ending every other episode as "error". The clients of a process share one event
loop on one daemon thread (openenv's own sync wrapper starts a thread per client: hundreds here).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import urllib.request
from functools import lru_cache
from typing import Any, Optional, Sequence

from grpo.envs.base import Step
from grpo.errors import ConfigError

INSTALL = "pip install 'grpo[openenv]' (openenv-core==0.3.0)"
OBSERVATION_BASE = {"done", "reward", "metadata"}  # fields every OpenEnv Observation has: never the text


def client_class():
    """openenv-core's dictionary client (actions and observations as plain dicts, so no environment
    package is needed here): the one place grpo imports openenv."""
    try:
        from openenv.core.generic_client import GenericEnvClient  # openenv: optional (the grpo[openenv] extra)
    except ImportError as e:
        raise ConfigError(f"env=openenv needs openenv-core, which could not be imported ({e}): {INSTALL}.") from e
    return GenericEnvClient


def http_url(base_url: str) -> str:
    """OpenEnv clients take http(s):// or ws(s):// URLs; /schema is plain HTTP."""
    url = re.sub(r"^ws(s?)://", r"http\1://", base_url.rstrip("/"))
    return url if "://" in url else f"http://{url}"


@lru_cache(maxsize=None)
def server_fields(base_url: str, action_field: str, observation_field: Optional[str], timeout_s: float) -> str:
    """Checks the server's schemas (GET /schema) once per process: it answers, its Action has
    `action_field` and requires nothing else, and its Observation has the text field; returns that
    field (`observation_field`, or the Observation's only string field)."""
    url = http_url(base_url) + "/schema"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            schemas = json.load(response)
    except (OSError, ValueError) as e:  # refused, unknown host, timed out, HTTP error, not JSON
        raise ConfigError(f"no OpenEnv server answered at env.kwargs.base_url={base_url!r} (GET {url}: {e}); start "
                          "the server (e.g. `uvicorn my_env.server.app:app --port 8000`) or point base_url at it.") from e
    action, observation = schemas.get("action", {}), schemas.get("observation", {})
    fields = action.get("properties", {})
    if action_field not in fields:
        raise ConfigError(f"env.kwargs.action_field={action_field!r} is not a field of the Action of the OpenEnv "
                          f"server at {base_url} ({sorted(fields)}); set it to the field that takes the turn's text.")
    others = [f for f in action.get("required", []) if f != action_field]
    if others:
        raise ConfigError(f"the Action of the OpenEnv server at {base_url} also requires {others}; env=openenv sends "
                          f"only env.kwargs.action_field={action_field!r}: serve an Action with one required text field.")
    shown = observation.get("properties", {})
    texts = [name for name, spec in shown.items() if name not in OBSERVATION_BASE and is_text(spec)]
    if observation_field is None:
        if len(texts) != 1:
            raise ConfigError(f"the Observation of the OpenEnv server at {base_url} has {len(texts)} text fields "
                              f"({texts}); set env.kwargs.observation_field to the one the policy should see "
                              f"(its fields: {sorted(shown)}).")
        return texts[0]
    if observation_field not in shown:
        raise ConfigError(f"env.kwargs.observation_field={observation_field!r} is not a field of the Observation of "
                          f"the OpenEnv server at {base_url} ({sorted(shown)}).")
    return observation_field


def is_text(spec: dict) -> bool:
    """A JSON-schema property that holds a string (`str`, or `Optional[str]` as pydantic writes it)."""
    return spec.get("type") == "string" or any(s.get("type") == "string" for s in spec.get("anyOf", []))


_loop: Optional[tuple[int, asyncio.AbstractEventLoop]] = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's one loop for OpenEnv clients, on a daemon thread (a forked child starts its own)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="grpo-openenv", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


def sample_field(sample, name: str) -> Any:
    if name in ("prompt", "answer"):
        return getattr(sample, name)
    if name in (sample.meta or {}):
        return sample.meta[name]
    raise ConfigError(f"env.kwargs.reset_fields names {name!r}, which the task's samples do not have "
                      f"(prompt, answer, or a key of their meta: {sorted(sample.meta or {})}).")


# The two uses of the client's internals (`_ws`, `_send`; openenv-core 0.3.0), both checked by
# tests/test_openenv.py: a refused session is a ConfigError, and closing logs nothing on the server.

async def request(client, coroutine):
    """One client call. A server that refuses a session (CAPACITY_REACHED) sends its error and closes
    the socket at once, often before the call's message goes out: the send then fails, and the
    error, still buffered, is raised as openenv-core raises an error reply."""
    from websockets.exceptions import ConnectionClosed  # websockets: openenv-core's, optional as it is

    try:
        return await coroutine
    except ConnectionClosed as e:
        try:
            reply = json.loads(await asyncio.wait_for(client._ws.recv(), 1.0))
        except Exception:  # noqa: BLE001 - nothing buffered: the connection's own error stands
            raise e from None
        if reply.get("type") != "error":
            raise
        error = reply.get("data", {})
        raise RuntimeError(f"Server error: {error.get('message')} (code: {error.get('code')})") from e


async def end_session(client, timeout_s: float) -> None:
    """Ends a session the way the server expects: the "close" message, then the server closes the
    socket. openenv-core 0.3.0's own `close()` closes the socket at once, and its server, finding it
    closed, logs a traceback per session (here one per trajectory, every step)."""
    if client._ws is not None:
        try:
            await client._send({"type": "close"})
            await asyncio.wait_for(client._ws.wait_closed(), timeout_s)
        except Exception:  # noqa: BLE001 - the socket is closed below either way
            pass
    await client.close()


class OpenEnvAdapter:
    """One trajectory's session with an OpenEnv server (see the module docstring); built by
    `env=openenv` from `env.kwargs`."""

    def __init__(self, base_url: str, action_field: str = "message", observation_field: Optional[str] = None,
                 reset_fields: Sequence[str] = (), connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0):
        if not base_url:
            raise ConfigError("env=openenv needs env.kwargs.base_url, the OpenEnv server's URL (http://host:port).")
        client = client_class()
        # env.kwargs.reset_fields=answer (one name, not [answer]) is a str: list() made it ['a', 'n', 's', ...]
        fields = [reset_fields] if isinstance(reset_fields, str) else list(reset_fields or [])
        self.base_url, self.action_field, self.reset_fields = base_url, action_field, fields
        self.observation_field = server_fields(base_url, action_field, observation_field, connect_timeout_s)
        self.timeout_s = connect_timeout_s + message_timeout_s  # the client bounds each; this bounds both
        self.client = client(base_url=base_url, connect_timeout_s=connect_timeout_s, message_timeout_s=message_timeout_s)

    def reset(self, sample, seed: int) -> Optional[str]:
        data = {"seed": seed, **{name: sample_field(sample, name) for name in self.reset_fields}}
        result = self.call(self.client.reset(**data))  # connects on first use
        return self.text(result.observation) or None

    def step(self, action: str) -> Step:
        result = self.call(self.client.step({self.action_field: action}))
        reward = None if result.reward is None else float(result.reward)
        return Step(self.text(result.observation), reward, bool(result.done), dict(result.observation))

    def close(self) -> None:
        self.call(end_session(self.client, self.timeout_s))

    def text(self, observation: dict) -> Optional[str]:
        value = observation.get(self.observation_field)
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, (int, float)):
            return str(value)
        raise TypeError(f"observation field {self.observation_field!r} holds a {type(value).__name__}, not text; "
                        f"set env.kwargs.observation_field to a text field of {sorted(observation)}")

    def call(self, coroutine):
        """Runs one client call on the shared loop. openenv-core's client reports a server's refusal as
        RuntimeError("Server error: ... (code: CAPACITY_REACHED)"): that one is a setup mistake."""
        future = asyncio.run_coroutine_threadsafe(request(self.client, coroutine), event_loop())
        try:
            return future.result(self.timeout_s)
        except RuntimeError as e:
            if "CAPACITY_REACHED" not in str(e):
                raise
            raise ConfigError(f"the OpenEnv server at {self.base_url} refused a session ({e}). grpo opens one per "
                              "trajectory at once: serve the environment with create_app(..., max_concurrent_envs=N), "
                              "N at least the trajectories of a batch (algo.batch_size; evaluation's prompts), on an "
                              "Environment with SUPPORTS_CONCURRENT_SESSIONS = True.") from e
        finally:
            future.cancel()  # a call past its time must not linger on the loop
