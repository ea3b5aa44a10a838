"""The shared secret between a trainer and its rollout servers, kept off command lines and out of
run folders.

A command line is visible to every user of the machine (`ps`), and a run folder's config.yaml is
copied around with its results, so the token travels only through the environment
(`GRPO_SERVE_TOKEN`, readable by its owner in /proc/<pid>/environ) or a file only its owner can read
(`--token-file` for `grpo.serve`, `rollout.remote.token_file` for the trainer).
"""

from __future__ import annotations

import hmac
import os
import stat

from grpo.errors import TokenError

TOKEN_ENV = "GRPO_SERVE_TOKEN"


def read_token_file(path: str) -> str:
    """The token in `path`, which only its owner may read (chmod 600): a token others can read guards nothing."""
    path = os.path.expanduser(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise TokenError(f"token file {path} cannot be read ({e.strerror}).") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(f"token file {path} is readable by other users (mode {stat.S_IMODE(mode):o}); chmod 600 {path}.")
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise TokenError(f"token file {path} is empty.")
    return token


def load_token(token_file: str | None = None, env: dict | None = None) -> str | None:
    """The token from `token_file` if given, else from $GRPO_SERVE_TOKEN; None when neither is set."""
    if token_file:
        return read_token_file(token_file)
    env = os.environ if env is None else env
    return env.get(TOKEN_ENV) or None


def token_ok(header: str | None, token: str | None) -> bool:
    """With no token configured (loopback only) every local caller may; otherwise an exact Bearer."""
    if not token:
        return True
    return bool(header) and header.startswith("Bearer ") and hmac.compare_digest(header[7:], token)
