"""reward `rm` on servers (`reward.rm.urls`): the reward model behind `python -m grpo.serve --model DIR
--reward-model` (vLLM's pooling runner), the trainer holding only its tokenizer.

- What is sent: token ids, not text. The trainer tokenizes `sample.prompt + completion` with the reward
  model's own tokenizer (`reward.rm.path`, the folder or hub id the servers serve), special tokens
  included (a BOS its tokenizer adds), exactly as the in-process model does, so the server scores the
  same ids whatever vLLM's own tokenization of the text would give.
- The route: POST /classify {"input": [[ids], ...], "use_activation": false}. Its `probs` hold each
  input's logits at its last token; `use_activation: false` keeps the raw logit (vLLM's default puts a
  one-label head through a sigmoid), the number the in-process model returns.
- The batch is split in equal contiguous shares, one request per server, sent in parallel.
- A server that fails on its share (down, an error status, slower than `reward.rm.request_timeout_s`, an
  answer cut off, not JSON or of the wrong shape) leaves that share's scores None, with a warning naming
  the server and its answer (counted, `rm/failed`): the run goes on, and the other shares keep their
  scores. One that refuses the token or the route (401, 403, 404) or redirects stops the run
  (RewardStop), as the judge does: every later batch would fail the same way. A text longer than the server's context (its max_model_len) scores None, with a warning
  (`rm/too_long`), by the in-process model's check (`within_context`). The call returns when every
  share has its answer or its request timeout: no reward.timeout_s, and no one-at-a-time retry
  (grpo/rewards/__init__.py).
- At build, every server must answer /health within `reward.rm.health_timeout_s`, then one /classify
  probe: a wrong token (401), a server of a policy (no /classify) or a model with several labels is
  an error then, not None at every step.
- The token: the reward model servers' own, `reward.rm.token_file` or $GRPO_RM_TOKEN (start the servers
  with it: `GRPO_SERVE_TOKEN=... python -m grpo.serve --reward-model` or `--token-file`), never the rollout
  servers' $GRPO_SERVE_TOKEN by fallback; plain http to a host other than loopback carries it only with
  `reward.rm.allow_plain_http=true` (grpo/auth.py).
"""

from __future__ import annotations

import time
import warnings

from grpo.errors import ConfigError, RewardStop, ServerError
from grpo.rewards.reward_model import RewardModel, ScoreNormaliser, within_context
from grpo.auth import RM_TOKEN_ENV, client_token
from grpo.endpoints import Server, check_urls, is_redirect, parallel_map, split_by_load

STOPS = (401, 403, 404)  # the token, or a server without /classify (restarted as another): no later batch would score


def check_served(rm) -> None:
    """validate's part for `reward.rm.urls` (nothing is contacted)."""
    check_urls(rm.urls, "reward.rm.urls", "Each is a `grpo.serve --reward-model` server.")
    rm_token(rm)
    if rm.health_timeout_s <= 0:
        raise ConfigError(f"reward.rm.health_timeout_s={rm.health_timeout_s} must be > 0.")
    if rm.request_timeout_s <= 0:
        raise ConfigError(f"reward.rm.request_timeout_s={rm.request_timeout_s} must be > 0: one server's share of a "
                          f"batch scores None past it.")


def rm_token(rm) -> str | None:
    """The reward model servers' token (reward.rm.token_file, else $GRPO_RM_TOKEN), once their URLs may carry it."""
    return client_token(rm.token_file, RM_TOKEN_ENV, rm.urls, rm.allow_plain_http, "reward.rm")


def classify(server: Server, ids: list[list[int]]) -> list[float]:
    """Each token-id list's raw score from one server (one /classify request)."""
    answer = server.request("/classify", {"input": ids, "use_activation": False})
    try:
        rows = sorted(answer["data"], key=lambda d: d["index"])
        values = [float(r["probs"][0]) for r in rows if len(r["probs"]) == 1]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ServerError(f"{server.url}/classify answered {str(answer)[:300]}, not one score per input ({e!r})") from e
    if len(values) != len(ids):
        raise ServerError(f"{server.url}/classify answered {len(rows)} rows ({str(answer)[:300]}) for {len(ids)} inputs "
                          f"of one score each: is it serving a reward model with one label?")
    return values


class ServedRewardModel(RewardModel):
    """A reward model scored by servers: the in-process RewardModel's tokenization and normalisation,
    each server's forward instead of the local one."""

    def __init__(self, servers: list[Server], tokenizer, normaliser: ScoreNormaliser | None = None):
        super().__init__(None, tokenizer, max_tokens=0, normaliser=normaliser)
        self.servers = servers

    def scores(self, texts: list[str]) -> list[float | None]:
        """Raw scores in the order given; None where a server failed or a text exceeds its context."""
        ids = self.tokenizer(texts).input_ids  # as RewardModel.scores: special tokens included
        out: list[float | None] = [None] * len(texts)
        self.stats = {"too_long": 0, "failed": 0}
        fits = {}  # server -> the indices of its share that fit its context (RewardModel's check)
        for i, (start, end) in enumerate(split_by_load(len(texts), [1.0] * len(self.servers))):
            server = self.servers[i]
            keep, problem = within_context([len(x) for x in ids[start:end]], server.max_model_len,
                                           f"{server.url}'s context")
            fits[i] = [start + k for k in keep]
            self.stats["too_long"] += end - start - len(keep)
            if problem:
                warnings.warn(f"reward 'rm': {problem}", stacklevel=2)

        def ask(i: int) -> str | None:  # what went wrong, warned of in the caller's thread
            server = self.servers[i]
            try:
                values = classify(server, [ids[k] for k in fits[i]])
            except ServerError as e:  # whatever the request met (endpoints.Server.request), or an answer of the wrong shape
                if e.status in STOPS or is_redirect(e.status):
                    raise RewardStop(f"reward 'rm': {str(e).rstrip('.')}. Every later batch would be refused the same way: check "
                                     f"reward.rm.token_file (or ${RM_TOKEN_ENV}) and reward.rm.urls against the "
                                     f"server.") from e
                return f"server {server.url} failed on its {len(fits[i])} texts ({e}); they score None"
            for k, v in zip(fits[i], values):
                out[k] = v
            return None

        asked = [i for i in fits if fits[i]]
        for i, problem in zip(asked, parallel_map(ask, asked)):
            if problem:
                self.stats["failed"] += len(fits[i])
                warnings.warn(f"reward 'rm': {problem}", stacklevel=2)
        return out


def build_served(rm, tokenizer, normaliser: ScoreNormaliser) -> ServedRewardModel:
    """The served reward model, every server healthy and answering a /classify probe now (errors name it)."""
    token = rm_token(rm)
    servers = [Server(str(u), token, rm.request_timeout_s) for u in rm.urls]
    deadline = time.time() + rm.health_timeout_s
    parallel_map(lambda s: s.wait_healthy(deadline, kind="reward model server"), servers)
    probe = tokenizer(["1+1=2"]).input_ids
    for server in servers:
        try:
            classify(server, probe)
        except ServerError as e:
            raise ServerError(f"reward model server {server.url} does not score texts: {e}. Start it with "
                              f"`python -m grpo.serve --model DIR --reward-model` and the token the trainer has "
                              f"(${RM_TOKEN_ENV} or reward.rm.token_file).", e.status) from e
    return ServedRewardModel(servers, tokenizer, normaliser)
