"""A vLLM server watched from outside its API, by the process that uses it: where a server this
process started listens (`wait_for_url`: its URL file, or its process's exit with the end of its log),
and why a server will never answer (`engine_dead`: each pool server's watch, grpo/endpoints.py
Server.watch), so a request to a server whose engine died fails within seconds, naming why (and, for
a dedicated engine, the end of its log), where vLLM would hold it open until its timeout.

vLLM 0.32 whose engine core died (killed for memory, crashed) keeps its API process: it answers
/health with 503 (EngineDeadError), stops listening within 5 s (its watchdog), and holds a request
sent as the engine died open, unanswered, until the client gives up; its process exits only then.
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

from grpo.endpoints import Server
from grpo.errors import ServerError


def log_tail(path: str, lines: int = 15) -> str:
    """The last `lines` lines of a log file (what vLLM said last), or why there are none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:]).strip()
    except OSError as e:
        return f"(no log: {e})"


URL_POLL_S = 0.2  # how often `wait_for_url` looks into the folder


def wait_for_url(folder: str, timeout_s: float, exited=None, what: str = "grpo.serve") -> str:
    """The URL of a `grpo.serve --port 0 --url-dir FOLDER` this process started (dedicated's engines,
    the doctor's and the bench's servers). The server binds and listens on a port the kernel finds free,
    then writes its URL into FOLDER (grpo/serve.py write_url), before its model loads: no port is named
    before its server listens, so no other user of the machine can take it in between and receive the
    token. FOLDER is the server's own, made empty for it (tempfile.mkdtemp: this user's alone), so the
    one URL file in it is this server's; two are an error, never a guess. `exited`: None while the
    server's process runs, else what it left (its exit code, its log's end): an error at once, not
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = sorted(glob.glob(os.path.join(glob.escape(folder), "*.url")))
        if len(found) > 1:
            raise ServerError(f"{what}: {folder} holds {len(found)} URL files ({', '.join(map(os.path.basename, found))}), "
                              "where one server writes one: give each server a fresh folder of its own (tempfile.mkdtemp).")
        if found:
            return Path(found[0]).read_text().strip()
        if exited is not None and (gone := exited()):
            raise ServerError(f"{what} exited before it wrote its URL into {folder}: {gone}")
        if time.monotonic() >= deadline:
            raise ServerError(f"{what} wrote no URL into {folder} within {round(timeout_s, 1):g} s and still runs: it is stuck "
                              "before it listens (resolving its model, importing vLLM); its log says where.")
        time.sleep(URL_POLL_S)


def refused(e: ServerError) -> bool:
    """A request that found nothing listening at the server's address."""
    cause = e.__cause__
    return isinstance(getattr(cause, "reason", cause), ConnectionRefusedError)


def engine_dead(server: Server, exited=None, log: str | None = None) -> str | None:
    """Why `server` will never answer, or None while it may: each pool server's `watch` (endpoints.py
    Server.watched). In order: the process gone (`exited`, an engine this trainer started: its exit code
    and log), its `log` saying EngineDeadError (a dedicated engine's), /health answering 503 or refusing
    the connection (any server). A /health that is slow or times out says nothing: the request's own
    timeout decides then."""
    if exited is not None and (gone := exited()):
        return f"its process exited ({gone})"
    if log is not None and "EngineDeadError" in log_tail(log, lines=400):
        return f"its vLLM engine died (EngineDeadError); the end of {log}:\n{log_tail(log)}"
    try:
        server.send("/health", None, timeout=5, send_token=False)  # open to all (grpo/serve.py OPEN_ROUTES)
        return None
    except ServerError as e:
        if e.status == 503:
            why = "it answers /health with 503: its vLLM engine died (EngineDeadError)"
        elif refused(e):
            why = "it no longer accepts connections (vLLM stops listening once its engine died)"
        else:
            return None
    return why + (f"; the end of {log}:\n{log_tail(log)}" if log else "; its log says why")
