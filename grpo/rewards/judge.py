"""reward `judge`: an LLM judge on OpenAI-compatible servers reads each completion and answers; its
answer is the reward.

The judge's prompt is `reward.judge.template` with `{prompt}` (the task's prompt), `{completion}` and
`{answer}` (the task's reference answer) filled in, sent to `reward.judge.urls` (`python -m grpo.serve`,
a plain `vllm serve`, or any OpenAI-compatible endpoint) through `/v1/chat/completions` (the server
applies the judge's chat template) or `/v1/completions` (the text as is), greedy.

The score (`reward.judge.score`):
  - `logprobs`: the expected value over named answer tokens at the judge's first answer token:
    sum_c p(c) v(c) / sum_c p(c) over the `choices` (token -> value, e.g. yes: 1, no: 0; or with
    `rating: [1, 10]` the tokens "1".."10" valued as those numbers)
    found among the top `top_logprobs` tokens (a token matches a choice by its text with spaces
    stripped, case ignored; the probabilities of tokens that match one choice add up). None found is
    a garbage answer.
  - `pattern`: the first match of `pattern` in the judge's text (its first group if it has one),
    looked up in `choices` (case ignored) or read as a number. No match is a garbage answer.

A batch is sent at once: identical judge prompts are asked once, at most `max_concurrency` requests
are in flight, each goes to the server with the fewest requests in flight (ties: the one answering
fastest lately), and a request that fails (unreachable, timed out, 5xx, 429) is retried on another
server up to `retries` times with a growing pause. A completion that stays unanswered, or whose
answer is garbage, gets None (excluded, advantage 0) with one warning per batch that counts them and
shows the first; fewer than `min_scored` of a batch scored stops the run (RewardStop) naming the
servers' errors. A server that refuses the token (401/403) or the model name (404) stops it at once.
"""

from __future__ import annotations

import math
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

from grpo.errors import ConfigError, RewardStop, ServerError
from grpo.endpoints import Server

SCORES = ("logprobs", "pattern")
APIS = ("chat", "completions")
FATAL = (401, 403, 404)  # the token or the model name: every later request would fail the same way
RETRY_PAUSE_S = 0.5  # doubled per retry


def choice_of(token: str, choices: dict[str, float]) -> str | None:
    key = token.strip().lower()
    return next((c for c in choices if c.strip().lower() == key), None) if key else None


def expected_score(top: dict[str, float], choices: dict[str, float]) -> float | None:
    """sum_c p(c) v(c) / sum_c p(c) over the choices among `top` (token text -> logprob); None if none is."""
    mass: dict[str, float] = {}
    for token, logprob in top.items():
        c = choice_of(token, choices)
        if c is not None:
            mass[c] = mass.get(c, 0.0) + math.exp(logprob)
    total = sum(mass.values())
    if total <= 0:
        return None
    return sum(p * float(choices[c]) for c, p in mass.items()) / total


def pattern_score(text: str, pattern: re.Pattern, choices: dict[str, float]) -> float | None:
    """The first match of `pattern` (its first group if any): a choice's value, else a number; else None."""
    m = pattern.search(text)
    if m is None:
        return None
    found = m.group(1) if m.groups() else m.group(0)
    c = choice_of(found, choices)
    if c is not None:
        return float(choices[c])
    try:
        value = float(found)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


FIELDS = re.compile(r"\{(prompt|completion|answer)\}")


def answer_choices(jc) -> dict[str, float]:
    """reward.judge.rating [low, high]: "low".."high" valued as the numbers they are; else reward.judge.choices."""
    if jc.rating:
        low, high = jc.rating
        return {str(i): float(i) for i in range(low, high + 1)}
    return {str(k): float(v) for k, v in jc.choices.items()}


def judge_prompt(template: str, prompt: str, completion: str, answer) -> str:
    """The template's fields filled in one pass: a completion's own braces ("{answer}") stay text."""
    values = {"prompt": prompt, "completion": completion, "answer": str(answer or "")}
    return FIELDS.sub(lambda m: values[m.group(1)], template)


class Judge:
    """The reward function: `judge(completions, samples)` -> a score or None per completion.

    After each call `stats` holds its counts for the step's log: requests sent (after
    deduplication), failed requests, garbage answers and retries."""

    def __init__(self, jc, token: str | None):
        self.jc = jc
        self.servers = [Server(u, token, jc.request_timeout_s) for u in jc.urls]
        self.in_flight = [0] * len(self.servers)
        self.latency = [0.0] * len(self.servers)  # an EMA of each server's seconds per request
        self.lock = threading.Lock()
        self.pattern = re.compile(jc.pattern)
        self.choices = answer_choices(jc)
        self.model = jc.model
        self.stats: dict[str, float] = {}
        self.timeout_s = jc.batch_timeout_s  # the reward wrapper's bound on one batch (grpo/rewards/__init__.py)

    def wait_healthy(self) -> None:
        """Every server answers /health and lists a model; the first server's names the model when
        `reward.judge.model` is null."""
        deadline = time.time() + self.jc.health_timeout_s
        for s in self.servers:
            s.wait_healthy(deadline, note="(reward.judge.urls)", kind="judge server")
            if self.model is None:
                self.model = s.model

    def pick(self, avoid: int | None) -> int:
        with self.lock:
            order = sorted(range(len(self.servers)), key=lambda i: (i == avoid, self.in_flight[i], self.latency[i], i))
            self.in_flight[order[0]] += 1
            return order[0]

    def body(self, text: str) -> tuple[str, dict]:
        jc = self.jc
        body = {"model": self.model, "max_tokens": jc.max_tokens, "temperature": 0.0}
        if jc.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            if jc.score == "logprobs":
                body.update(logprobs=True, top_logprobs=jc.top_logprobs)
            return "/v1/chat/completions", body
        body["prompt"] = text
        if jc.score == "logprobs":
            body["logprobs"] = jc.top_logprobs
        return "/v1/completions", body

    def read(self, answer: dict) -> tuple[float | None, str]:
        """(score or None, what the judge said) from one server answer."""
        choice = answer["choices"][0]
        if self.jc.api == "chat":
            text = choice["message"].get("content") or ""
            if self.jc.score == "logprobs":
                content = (choice.get("logprobs") or {}).get("content") or []
                top = {t["token"]: t["logprob"] for t in content[0]["top_logprobs"]} if content else {}
                return expected_score(top, self.choices), text
        else:
            text = choice.get("text") or ""
            if self.jc.score == "logprobs":
                tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
                return expected_score(tops[0] if tops else {}, self.choices), text
        return pattern_score(text, self.pattern, self.choices), text

    def ask(self, text: str) -> tuple[float | None, str | None, str | None]:
        """(score, the judge's text, error): tries up to 1 + retries servers."""
        path, body = self.body(text)
        error, last = None, None
        for attempt in range(1 + self.jc.retries):
            if attempt:
                self.count("retries")
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 1))
            i = self.pick(avoid=last)
            t0 = time.perf_counter()
            try:
                answer = self.servers[i].request(path, body)
            except ServerError as e:
                if e.status in FATAL:
                    raise RewardStop(f"reward `judge`: {e}. Check reward.judge.token_file (or $GRPO_SERVE_TOKEN) and "
                                     f"reward.judge.model against the server.") from e
                error, last = str(e), i
                continue
            finally:
                with self.lock:
                    self.in_flight[i] -= 1
            with self.lock:
                seconds = time.perf_counter() - t0
                self.latency[i] = seconds if not self.latency[i] else 0.8 * self.latency[i] + 0.2 * seconds
            try:
                value, said = self.read(answer)
            except (KeyError, IndexError, TypeError) as e:
                return None, None, f"{self.servers[i].url} answered in a shape not understood ({type(e).__name__}: {e})"
            return value, said, None
        return None, None, error

    def count(self, key: str, k: int = 1) -> None:
        with self.lock:
            self.stats[key] = self.stats.get(key, 0) + k

    def __call__(self, completions: list[str], samples: list, **_) -> list[float | None]:
        texts = [judge_prompt(self.jc.template, s.prompt, c, s.answer) for c, s in zip(completions, samples)]
        unique = list(dict.fromkeys(texts))  # identical (prompt, completion) pairs asked once
        self.stats = {"requests": len(unique)}
        with ThreadPoolExecutor(min(self.jc.max_concurrency, len(unique)) or 1, thread_name_prefix="judge") as pool:
            asked = dict(zip(unique, pool.map(self.ask, unique)))
        failed = [(t, e) for t, (_, _, e) in asked.items() if e is not None]
        garbage = [(t, said) for t, (v, said, e) in asked.items() if e is None and v is None]
        self.stats.update(failed=len(failed), garbage=len(garbage))
        values = [asked[t][0] for t in texts]
        scored = sum(v is not None for v in values)
        if failed:
            warnings.warn(f"reward `judge`: {len(failed)} of {len(unique)} requests failed after "
                          f"{self.jc.retries} retries; their completions are excluded. First: {failed[0][1]}", stacklevel=2)
        if garbage:
            warnings.warn(f"reward `judge`: {len(garbage)} of {len(unique)} answers had no score "
                          f"(reward.judge.score={self.jc.score}); their completions are excluded. First answer: "
                          f"{garbage[0][1]!r}", stacklevel=2)
        if values and scored < self.jc.min_scored * len(values):
            why = failed[0][1] if failed else f"the judge's answers had no score, e.g. {garbage[0][1]!r}"
            why += "" if why.endswith((".", "?", "!")) else "."
            raise RewardStop(f"reward `judge` scored {scored} of {len(values)} completions, below reward.judge.min_scored="
                             f"{self.jc.min_scored:g}: {why} Check the servers {list(self.jc.urls)} and the judge's "
                             f"template and score settings.")
        return values


def check(cfg) -> None:
    """validate's part: reward.judge's settings, with nothing contacted."""
    from grpo.auth import read_token_file
    from grpo.errors import TokenError

    jc = cfg.reward.judge
    if not jc.urls:
        raise ConfigError("reward `judge` needs reward.judge.urls=[http://host:port,...]: OpenAI-compatible servers "
                          "(e.g. `python -m grpo.serve --model JUDGE --port 8100`).")
    for url in jc.urls:
        if not re.match(r"^https?://[^/\s]+(/.*)?$", str(url)):
            raise ConfigError(f"reward.judge.urls: {url!r} is not an http(s)://host:port URL.")
    if jc.api not in APIS:
        raise ConfigError(f"reward.judge.api={jc.api!r} is not one of {list(APIS)}.")
    if jc.score not in SCORES:
        raise ConfigError(f"reward.judge.score={jc.score!r} is not one of {list(SCORES)}.")
    if jc.rating is not None and (len(jc.rating) != 2 or jc.rating[0] > jc.rating[1]):
        raise ConfigError(f"reward.judge.rating={list(jc.rating)} must be [low, high] with low <= high, e.g. [1, 10].")
    if jc.score == "logprobs" and not (jc.choices or jc.rating):
        raise ConfigError("reward.judge.score=logprobs reads the probabilities of reward.judge.choices: give at least "
                          "one, e.g. reward.judge.choices={yes: 1.0, no: 0.0}, or reward.judge.rating=[1,10].")
    for token, value in dict(jc.choices).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"reward.judge.choices[{token!r}]={value!r} must be a number.")
    try:
        re.compile(jc.pattern)
    except re.error as e:
        raise ConfigError(f"reward.judge.pattern={jc.pattern!r} is not a regular expression ({e}).") from e
    if "{completion}" not in jc.template:
        raise ConfigError("reward.judge.template has no {completion}: the judge would not see what it scores.")
    if jc.max_tokens < 1 or jc.top_logprobs < 1 or jc.max_concurrency < 1 or jc.retries < 0:
        raise ConfigError("reward.judge needs max_tokens >= 1, top_logprobs >= 1, max_concurrency >= 1 and retries >= 0.")
    if not 0 <= jc.min_scored <= 1:
        raise ConfigError(f"reward.judge.min_scored={jc.min_scored} is a fraction of a batch: 0 to 1.")
    if jc.request_timeout_s <= 0 or jc.batch_timeout_s <= 0:
        raise ConfigError("reward.judge.request_timeout_s and batch_timeout_s must be > 0.")
    if jc.token_file:
        try:
            read_token_file(jc.token_file)
        except TokenError as e:
            raise ConfigError(f"reward.judge.token_file: {e}") from e


def build(cfg, device=None) -> Judge:
    """The reward function of `reward.judge`, once its servers answer."""
    from grpo.auth import load_token

    judge = Judge(cfg.reward.judge, load_token(cfg.reward.judge.token_file))
    judge.wait_healthy()
    return judge
