"""Tokens: each client group sends its own, kept off command lines and out of run folders, and only
where nobody on the way can read it.

- Whose token: the rollout servers' (`GRPO_SERVE_TOKEN` or `rollout.remote.token_file`) guards their
  weight routes, so it goes to them alone. The judge sends `GRPO_JUDGE_TOKEN` or
  `reward.judge.token_file`, the served reward model `GRPO_RM_TOKEN` or `reward.rm.token_file`, never
  the servers' token by fallback: a judge URL may be anyone's endpoint. A job that starts a judge
  itself (grpo.launch, slurm/train_remote.sbatch) hands it the job's token explicitly.
- How it travels: through the environment (readable by its owner in /proc/<pid>/environ) or a file
  only its owner can read (chmod 600). A command line is visible to every user of the machine (`ps`),
  and a run folder's config.yaml is copied around with its results.
- Where it goes: over https, or plain http to loopback; plain http to another host only where the
  config says so (`*.allow_plain_http`, e.g. a job's own servers on the cluster's network). Redirects
  are never followed (grpo/endpoints.py), so the header never reaches a host that was not configured.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import stat
from urllib.parse import urlparse

from grpo.errors import TokenError

TOKEN_ENV = "GRPO_SERVE_TOKEN"  # the rollout servers' (and `grpo.serve`'s own)
JUDGE_TOKEN_ENV = "GRPO_JUDGE_TOKEN"
RM_TOKEN_ENV = "GRPO_RM_TOKEN"

# what an `Authorization: Bearer` header carries as it is: a token with a space, a control character (a
# CRLF file's \r) or non-ASCII was accepted at start, then no request could ever match it.
BEARER_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what a header carries unquoted and compares byte for byte


def check_token(token: str, where: str) -> str:
    """`token`, if a Bearer header can carry it (BEARER_TOKEN); else a TokenError naming `where` it came
    from and never the token itself."""
    if not BEARER_TOKEN.fullmatch(token):
        raise TokenError(f"the token in {where} has characters an 'Authorization: Bearer' header cannot carry (it may "
                         "hold visible ASCII characters only: no spaces, control characters or non-ASCII). Make a new "
                         "one, e.g. python -c 'import secrets; print(secrets.token_hex(32))'.")
    return token


def read_token_file(path: str) -> str:
    """The token in `path`, which only its owner may read (chmod 600): a token others can read guards nothing."""
    path = os.path.expanduser(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise TokenError(f"token file {path} cannot be read ({e.strerror}).") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(f"token file {path} is readable by other users (mode {stat.S_IMODE(mode):o}); chmod 600 {path}.")
    try:  # a folder, or a file that went away since the stat: a TokenError, which every caller catches
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TokenError(f"token file {path} cannot be read ({e.strerror}).") from e
    # bytes that are not UTF-8 (a binary file) decoded replaced, so check_token refuses them by name, not a
    # UnicodeDecodeError that no caller's `except TokenError` sees
    token = raw.decode("utf-8", errors="replace").strip()
    if not token:
        raise TokenError(f"token file {path} is empty.")
    return check_token(token, f"token file {path}")


def load_token(token_file: str | None = None, env_var: str = TOKEN_ENV, env: dict | None = None) -> str | None:
    """The token from `token_file` if given, else from $`env_var`; None when neither is set. Each client
    names its own variable: there is no fallback to another client's."""
    if token_file:
        return read_token_file(token_file)
    env = os.environ if env is None else env
    token = env.get(env_var) or None
    return None if token is None else check_token(token, f"${env_var}")


def is_loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (IPv4's also as a dual-stack socket reports it, ::ffff:127.0.0.1):
    traffic that never leaves the machine."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def sends_in_clear(url: str) -> bool:
    """Whether a request to `url` crosses a network unencrypted: plain http:// to a host other than loopback."""
    parts = urlparse(str(url))
    return parts.scheme.lower() == "http" and not is_loopback(parts.hostname or "")


def check_token_transport(urls, token: str | None, allow_plain_http: bool, group: str) -> None:
    """Refuse to send `token` in the clear (`sends_in_clear`) unless `<group>.allow_plain_http` says so;
    `group` is the config group, e.g. reward.judge. No token, no header: nothing to protect."""
    if not token or allow_plain_http:
        return
    for url in urls:
        if sends_in_clear(url):
            raise TokenError(f"{group}.urls: {url} is plain http to another host, so its token would cross the network "
                             f"unencrypted, readable by anyone on the way. Use https://, or, on a network you trust (a "
                             f"cluster's own), set {group}.allow_plain_http=true.")


def client_token(token_file: str | None, env_var: str, urls, allow_plain_http: bool, group: str) -> str | None:
    """A client group's token (`<group>.token_file`, else $`env_var`; None: no Authorization header),
    once each of its `urls` may carry it (`check_token_transport`). Read at validate and again at build."""
    try:
        token = load_token(token_file, env_var)
    except TokenError as e:
        raise TokenError(f"{group}.token_file: {e}") from e
    check_token_transport(urls, token, allow_plain_http, group)
    return token


def token_ok(header: str | None, token: str | None) -> bool:
    """With no token configured (loopback only) every local caller may; otherwise an exact Bearer.
    Compared as bytes: compare_digest raises a TypeError on a non-ASCII str (a header any client can send)."""
    if not token:
        return True
    return bool(header) and header.startswith("Bearer ") and hmac.compare_digest(
        header[7:].encode("utf-8", "surrogatepass"), token.encode())
