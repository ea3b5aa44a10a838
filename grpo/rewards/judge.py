"""reward `judge`: an LLM judge on OpenAI-compatible servers reads each completion and answers; its
answer is the reward.

The judge's prompt is `reward.judge.template` with `{prompt}` (the task's prompt), `{completion}` and
`{answer}` (the task's reference answer) filled in, sent to `reward.judge.urls` (`python -m grpo.serve`,
a plain `vllm serve`, or any OpenAI-compatible endpoint) through `/v1/chat/completions` (the server
applies the judge's chat template) or `/v1/completions` (the text as is), greedy.

The score (`reward.judge.score`):
  - `logprobs`: the expected value over named answer tokens at the judge's first answer token:
    sum_c p(c) v(c) / sum_c p(c) over the `choices` (token -> value, e.g. yes: 1, no: 0; or with
    `rating: [0, 9]` the tokens "0".."9" valued as those numbers)
    found among the top `top_logprobs` tokens (a token matches a choice by its text with spaces
    stripped, case ignored; the probabilities of tokens that match one choice add up). Less than
    `min_choice_mass` (0.5) of the probability on the choices is a garbage answer: a judge that
    starts "The ..." at 0.98 would otherwise be scored from the noise of the other 0.02. Only one token is read, so at start every choice must be one token of the
    judge's tokenizer (vLLM's /tokenize): digit-splitting tokenizers (Qwen2, SmolLM2, Llama-2,
    Mistral) write "10" as "1" "0", and a judge sure of 10 would score 1.
  - `pattern`: every match of `pattern` in the judge's text (its first group if it has one), each
    looked up in `choices` (case ignored) or read as a number (those outside `rating`, when one is
    given, left out). They must agree on one value: no match is a garbage answer, and so are matches
    that disagree ("On a scale of 0 to 9, I give it 8" under the default number pattern: the first
    number would read 0) and a match at the end of an answer cut at `max_tokens` (the number may be
    cut short: "1" of "10"). Anchor the pattern to the form the template asks for
    (`Score: (\\d+)`) where the judge writes other numbers. The answer is 16 tokens unless `max_tokens` says,
    and at start `max_tokens` must hold the longest choice.

A batch is sent at once: identical judge prompts are asked once, at most `max_concurrency` requests
are in flight, each goes to the server with the fewest requests in flight (ties: the one answering
fastest lately), and a request that fails (unreachable, timed out, 5xx, 429) is retried on another
server up to `retries` times with a growing pause. A completion that stays unanswered, or whose
answer is garbage, gets None (excluded, advantage 0) with one warning per batch that counts them and
shows the first; fewer than `min_scored` of a batch scored stops the run (RewardStop) naming the
servers' errors. A server that refuses the token (401/403) or the model name (404), or redirects (3xx,
never followed), stops it at once.

The token: the judge's own, `reward.judge.token_file` or $GRPO_JUDGE_TOKEN (none: no Authorization
header), never the rollout servers' $GRPO_SERVE_TOKEN (grpo/auth.py); plain http to a host other
than loopback carries it only with `reward.judge.allow_plain_http=true`.
"""

from __future__ import annotations

import math
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait

from grpo.auth import JUDGE_TOKEN_ENV, client_token
from grpo.errors import ConfigError, RewardStop, ServerError
from grpo.endpoints import NoModelList, NotJson, Server, check_urls, is_redirect, parallel_map
from grpo.reward_config import DEFAULT_CHOICES, JudgeConfig

SCORES = ("logprobs", "pattern")
APIS = ("chat", "completions")
FATAL = (401, 403, 404)  # the token or the model name: every later request would fail the same way
RETRY_PAUSE_S = 0.5  # doubled per retry
PATTERN_MAX_TOKENS = 16  # score=pattern's default answer: a few words and a number
NO_TOKENIZE = (404, 405, 501)  # an endpoint without vLLM's /tokenize: its choices cannot be checked


def choice_of(token: str, choices: dict[str, float]) -> str | None:
    key = token.strip().lower()
    return next((c for c in choices if c.strip().lower() == key), None) if key else None


def expected_score(top: dict[str, float], choices: dict[str, float], min_mass: float = 0.0) -> float | None:
    """sum_c p(c) v(c) / sum_c p(c) over the choices among `top` (token text -> logprob); None if none
    is, or if their probability sum_c p(c) is below `min_mass`."""
    mass: dict[str, float] = {}
    for token, logprob in top.items():
        c = choice_of(token, choices)
        if c is not None:
            mass[c] = mass.get(c, 0.0) + math.exp(logprob)
    total = sum(mass.values())
    if total <= 0 or total < min_mass:
        return None
    return sum(p * float(choices[c]) for c, p in mass.items()) / total


def match_value(found: str, choices: dict[str, float], rating=None) -> float | None:
    """One match's value: a choice's, else a finite number (within `rating` [low, high] if given)."""
    c = choice_of(found, choices)
    if c is not None:
        return float(choices[c])
    try:
        value = float(found)
    except ValueError:
        return None
    if not math.isfinite(value) or (rating and not rating[0] <= value <= rating[1]):
        return None
    return value


def pattern_score(text: str, pattern: re.Pattern, choices: dict[str, float], rating=None, cut: bool = False) -> float | None:
    """The one value every match of `pattern` (its first group if any) reads (`match_value`; those that
    read none left out); None when none does, or when they disagree. `cut`: the answer stopped at
    max_tokens, so a match that reaches its end, or only a separator before it, may be cut short ("1"
    of "10", "1." of "1.5") and is no score."""
    matches = list(pattern.finditer(text))
    if not matches or (cut and text[matches[-1].end():] in ("", ".", ",")):
        return None
    # its first group that took part in the match: in `(yes|no)|Score: (\d)` group 1 is None for "Score: 7",
    # and in `Score: (\d+)?` for "Score: n/a" (no group took part: it reads nothing)
    found = [m.group(0) if not m.groups() else next((g for g in m.groups() if g is not None), None) for m in matches]
    values = {match_value(f, choices, rating) for f in found if f is not None} - {None}
    return values.pop() if len(values) == 1 else None


TEMPLATE_FIELDS = ("prompt", "completion", "answer")
FIELDS = re.compile(r"\{(prompt|completion|answer)\}")
# a name in braces, as a field is written ({answr}, {Answer}: group 2), unless a LaTeX command's argument
# (\boxed{yes}, \frac{a}{b}: group 1; two letters at least, so "\n{answr}", a newline as Hydra keeps
# it, is still read); other braces ({"score": 1}, a lone {) hold no name
NAMED = re.compile(r"(\\[A-Za-z]{2,}\*?(?:\{[^{}]*\})*)|\{\s*([A-Za-z_]\w*)\s*\}")


def edit_distance(a: str, b: str) -> int:
    """Levenshtein: the fewest single-character insertions, deletions and substitutions from a to b."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ca != cb))
    return row[-1]


def meant_field(name: str) -> str | None:
    """The field a name in braces was likely meant to be (it reaches the judge unfilled): the same name
    in another case or spacing, a plural, or up to len/3 edits away (at most 2, so {answr} and
    {compleiton} are caught but no word of 2 letters is, and {yes}, {no} or {score} are text)."""
    key = name.lower()
    for field in TEMPLATE_FIELDS:
        if key in (field, field + "s") or edit_distance(key, field) <= min(2, len(key) // 3):
            return field
    return None


def misspelled_fields(template: str) -> dict[str, str]:
    """Each `{name}` of the template that is not a field but looks meant as one (`meant_field`) -> that
    field; judge_prompt fills only the fields as written, the rest stays text."""
    exact = {f"{{{f}}}" for f in TEMPLATE_FIELDS}
    return {m.group(0): field for m in NAMED.finditer(template)
            if m.group(2) and m.group(0) not in exact and (field := meant_field(m.group(2)))}


def answer_choices(jc) -> dict[str, float]:
    """reward.judge.rating [low, high]: "low".."high" valued as the numbers they are; else reward.judge.choices,
    or `DEFAULT_CHOICES` where it is empty. Empty by default, rather than {yes, no} in the schema: Hydra merges
    a dict given on the command line into the one there, so yes and no could never be replaced, only added to."""
    if jc.rating:
        low, high = jc.rating
        return {str(i): float(i) for i in range(low, high + 1)}
    return {str(k): float(v) for k, v in (jc.choices or DEFAULT_CHOICES).items()}


def answer_length(jc) -> int:
    """reward.judge.max_tokens, or what the score reads: one token (logprobs), a short text (pattern)."""
    if jc.max_tokens is not None:
        return jc.max_tokens
    return 1 if jc.score == "logprobs" else PATTERN_MAX_TOKENS


def check_choice_tokens(jc, tokens: dict[str, list], max_tokens: int) -> None:
    """Refuse choices the judge cannot answer as they are read, given each choice's tokens in the
    judge's tokenizer: under logprobs one that is more than one token (only the first answer token
    is read, so "10" split "1" "0" would score as the choice "1"); under pattern one longer than
    the answer (cut, "10" reads as "1")."""
    if jc.score == "logprobs":
        split = {c: t for c, t in tokens.items() if len(t) > 1}
        if split:
            c, t = next(iter(split.items()))
            words = "" if {w.strip().lower() for w in split} & {"yes", "no"} else ", or words like yes/no"
            raise ConfigError(
                f"reward.judge: the judge's tokenizer splits {c!r} into {t} ({len(split)} of {len(tokens)} choices are "
                f"more than one token), and score=logprobs reads only the first answer token: a judge sure of {c!r} "
                f"would score as {t[0]!r}. Use choices of one token each (e.g. reward.judge.rating=[0, 9]{words}), or "
                f"reward.judge.score=pattern to read the judge's text.")
    longest = max(tokens, key=lambda c: len(tokens[c]), default=None)
    if jc.score == "pattern" and longest is not None and len(tokens[longest]) > max_tokens:
        raise ConfigError(
            f"reward.judge.max_tokens={max_tokens} cannot hold the choice {longest!r} ({len(tokens[longest])} tokens of "
            f"the judge's tokenizer: {tokens[longest]}): the answer would be cut. Raise reward.judge.max_tokens to at "
            f"least {len(tokens[longest])}, more for words before it (or leave it null: {PATTERN_MAX_TOKENS}).")


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
        self.max_tokens = answer_length(jc)
        self.model = jc.model
        self.stats: dict[str, float] = {}
        self.past_deadline = threading.Event()  # set once a batch ran past reward.judge.batch_timeout_s

    def wait_healthy(self) -> None:
        """Every server answers /health and lists a model; the first server's names the model when
        `reward.judge.model` is null. Then the choices are checked against the judge's tokenizer."""
        deadline = time.time() + self.jc.health_timeout_s
        for s in self.servers:
            try:
                s.wait_healthy(deadline, note="(reward.judge.urls)", kind="judge server")
            except NoModelList as e:  # JSON, but no served model (its message asks the question)
                raise ConfigError(f"reward.judge.urls: {e}") from e
            except NotJson as e:  # an HTML page, a proxy's answer
                raise ConfigError(f"reward.judge.urls: {e}: is it an OpenAI-compatible server (`python -m grpo.serve`, "
                                  f"`vllm serve`)?") from e
            if self.model is None:
                self.model = s.model
        tokens = self.choice_tokens()
        if tokens is None:
            warnings.warn(f"reward `judge`: {self.servers[0].url} has no /tokenize (not vLLM), so the choices "
                          f"{list(self.choices)[:12]} cannot be checked to be one token each of the judge's tokenizer "
                          f"(score=logprobs reads one token: a \"10\" written as \"1\" \"0\" would score 1).", stacklevel=2)
        else:
            check_choice_tokens(self.jc, tokens, self.max_tokens)

    def choice_tokens(self) -> dict[str, list] | None:
        """Each choice as the judge's tokenizer writes it, from vLLM's /tokenize on the first server;
        None where the server has none."""
        server = self.servers[0]

        def tokenize(choice: str) -> list:
            said = server.request("/tokenize", {"model": self.model, "prompt": choice, "add_special_tokens": False,
                                                "return_token_strs": True})
            return said.get("token_strs") or said["tokens"]

        try:
            return dict(zip(self.choices, parallel_map(tokenize, list(self.choices), workers=8)))
        except (NotJson, KeyError, TypeError, AttributeError):  # an answer that is no vLLM tokenization
            return None
        except ServerError as e:
            if e.status in NO_TOKENIZE:
                return None
            raise

    def pick(self, avoid: int | None) -> int:
        with self.lock:
            order = sorted(range(len(self.servers)), key=lambda i: (i == avoid, self.in_flight[i], self.latency[i], i))
            self.in_flight[order[0]] += 1
            return order[0]

    def body(self, text: str) -> tuple[str, dict]:
        jc = self.jc
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0}
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
                return expected_score(top, self.choices, self.jc.min_choice_mass), text
        else:
            text = choice.get("text") or ""
            if self.jc.score == "logprobs":
                tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
                return expected_score(tops[0] if tops else {}, self.choices, self.jc.min_choice_mass), text
        cut = choice.get("finish_reason") == "length"
        return pattern_score(text, self.pattern, self.choices, self.jc.rating, cut), text

    def ask(self, text: str) -> tuple[float | None, str | None, str | None]:
        """(score, the judge's text, error): tries up to 1 + retries servers."""
        path, body = self.body(text)
        error, last = None, None
        for attempt in range(1 + self.jc.retries):
            if self.past_deadline.is_set():  # the batch is over: no new request behind the loop's back
                return None, None, error or f"not sent: the batch ran past reward.judge.batch_timeout_s={self.jc.batch_timeout_s:g}"
            if attempt:
                self.count("retries")
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 1))
            i = self.pick(avoid=last)
            t0 = time.perf_counter()
            try:
                answer = self.servers[i].request(path, body)
            except ServerError as e:
                if is_redirect(e.status):
                    raise RewardStop(f"reward `judge`: {e}") from e
                if e.status in FATAL:
                    raise RewardStop(f"reward `judge`: {e}. Check reward.judge.token_file (or ${JUDGE_TOKEN_ENV}) and "
                                     f"reward.judge.model against the server.") from e
                error, last = str(e), i  # unreachable, an error status, an answer cut off or not JSON: retried
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

    def ask_all(self, texts: list[str]) -> dict:
        """Every text asked, within reward.judge.batch_timeout_s: past it, the requests not yet sent are
        dropped (their completions score None, counted as failed) and those in flight end within their
        own request_timeout_s. The judge runs in the trainer's thread (a model reward is not run under
        reward.timeout_s), so this returns only when no request of the batch is left running."""
        self.past_deadline.clear()
        pool = ThreadPoolExecutor(min(self.jc.max_concurrency, len(texts)) or 1, thread_name_prefix="judge")
        futures = {t: pool.submit(self.ask, t) for t in texts}
        done, late = wait(futures.values(), timeout=self.jc.batch_timeout_s)
        if late:
            self.past_deadline.set()
        pool.shutdown(wait=True, cancel_futures=True)
        why = f"not answered within reward.judge.batch_timeout_s={self.jc.batch_timeout_s:g}"
        return {t: f.result() if f.done() and not f.cancelled() else (None, None, why) for t, f in futures.items()}

    def __call__(self, completions: list[str], samples: list, **_) -> list[float | None]:
        texts = [judge_prompt(self.jc.template, s.prompt, c, s.answer) for c, s in zip(completions, samples)]
        unique = list(dict.fromkeys(texts))  # identical (prompt, completion) pairs asked once
        self.stats = {"requests": len(unique), "retries": 0}  # every call the same keys: each rank logs each one
        asked = self.ask_all(unique)
        failed = [(t, e) for t, (_, _, e) in asked.items() if e is not None]
        garbage = [(t, said) for t, (v, said, e) in asked.items() if e is None and v is None]
        self.stats.update(failed=len(failed), garbage=len(garbage))
        values = [asked[t][0] for t in texts]
        scored = sum(v is not None for v in values)
        if failed:
            warnings.warn(f"reward `judge`: {len(failed)} of {len(unique)} requests failed after "
                          f"{self.jc.retries} retries; their completions are excluded. First: {failed[0][1]}", stacklevel=2)
        if garbage:
            how = ((f"less than reward.judge.min_choice_mass={self.jc.min_choice_mass:g} of the first token's probability "
                    f"on the choices" if self.jc.min_choice_mass > 0 else f"none of the choices among the first token's "
                    f"reward.judge.top_logprobs={self.jc.top_logprobs}") if self.jc.score == "logprobs" else
                   f"no match of reward.judge.pattern, or matches that disagree: anchor it to the form the template asks "
                   f"for, e.g. 'Score: (\\d+)'")
            warnings.warn(f"reward `judge`: {len(garbage)} of {len(unique)} answers had no score "
                          f"(reward.judge.score={self.jc.score}: {how}); their completions are excluded. First answer: "
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
    jc = cfg.reward.judge
    if not jc.urls:
        raise ConfigError("reward `judge` needs reward.judge.urls=[http://host:port,...]: OpenAI-compatible servers "
                          "(e.g. `python -m grpo.serve --model JUDGE --port 8100`).")
    check_urls(jc.urls, "reward.judge.urls")
    if jc.api not in APIS:
        raise ConfigError(f"reward.judge.api={jc.api!r} is not one of {list(APIS)}.")
    if jc.score not in SCORES:
        raise ConfigError(f"reward.judge.score={jc.score!r} is not one of {list(SCORES)}.")
    if jc.rating is not None and len(jc.rating) != 2:
        raise ConfigError(f"reward.judge.rating={list(jc.rating)} must be [low, high], e.g. reward.judge.rating=[0, 9].")
    if jc.rating is not None and jc.rating[0] > jc.rating[1]:
        raise ConfigError(f"reward.judge.rating={list(jc.rating)} is backwards: give the low end first, "
                          f"reward.judge.rating={sorted(jc.rating)}.")
    if jc.score == "logprobs" and len(answer_choices(jc)) < 2:  # every answer would score the one value
        if jc.rating:
            raise ConfigError(f"reward.judge.rating={list(jc.rating)} is one value: under score=logprobs every answer "
                              f"would score {jc.rating[0]}. Give a range, e.g. reward.judge.rating=[0,9].")
        raise ConfigError(f"reward.judge.choices={dict(jc.choices)} is one choice: under score=logprobs every answer "
                          "would score its value. Give two or more; they replace the default yes/no, e.g. "
                          "+reward.judge.choices={yes: 1.0, no: 0.0, maybe: 0.5}, or reward.judge.rating=[0,9].")
    for token, value in dict(jc.choices).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"reward.judge.choices[{token!r}]={value!r} must be a number.")
    try:
        re.compile(jc.pattern)
    except re.error as e:
        raise ConfigError(f"reward.judge.pattern={jc.pattern!r} is not a regular expression ({e}).") from e
    if unread := unread_settings(jc, JudgeConfig()):
        it, setting = ("it", "the setting") if len(unread) == 1 else ("them", "these settings")
        raise ConfigError(f"{'; '.join(unread)}: the judge's score never reads {setting}, so nothing changes. Set what "
                          f"reads {it}, or remove {setting}.")
    if "{completion}" not in jc.template:
        raise ConfigError("reward.judge.template has no {completion}: the judge would not see what it scores.")
    if misspelled := misspelled_fields(jc.template):
        fields = ", ".join(f"{{{f}}}" for f in TEMPLATE_FIELDS)
        fixes = ", ".join(f"{{{f}}} for {name}" for name, f in sorted(misspelled.items()))
        raise ConfigError(f"reward.judge.template has {', '.join(sorted(misspelled))}, not one of its fields {fields} "
                          f"(written exactly so): it would reach the judge as written, unfilled. Write {fixes}.")
    if (jc.max_tokens is not None and jc.max_tokens < 1) or jc.top_logprobs < 1 or jc.max_concurrency < 1 or jc.retries < 0:
        raise ConfigError("reward.judge needs max_tokens >= 1 (or null), top_logprobs >= 1, max_concurrency >= 1 and retries >= 0.")
    if not 0 <= jc.min_scored <= 1:
        raise ConfigError(f"reward.judge.min_scored={jc.min_scored} is a fraction of a batch: 0 to 1.")
    if not 0 <= jc.min_choice_mass <= 1:
        raise ConfigError(f"reward.judge.min_choice_mass={jc.min_choice_mass} is a probability: 0 to 1.")
    if jc.request_timeout_s <= 0 or jc.batch_timeout_s <= 0:
        raise ConfigError("reward.judge.request_timeout_s and batch_timeout_s must be > 0.")
    judge_token(jc)


def unread_settings(jc, defaults) -> list[str]:
    """The reward.judge.* settings given (other than `defaults`', the schema's) that the chosen score never
    reads, each with what would read it: they would change nothing, without a word (choices remapping a
    rating's 1..5, whose own numbers are its values; a pattern anchored to `Score: (\\d+)` under
    score=logprobs, scored from the first token instead)."""
    unread = {
        "choices": (bool(jc.rating), "reward.judge.rating=null: a rating's numbers are its choices, each its own value"),
        "pattern": (jc.score == "logprobs", "reward.judge.score=pattern"),
        "min_choice_mass": (jc.score == "pattern", "reward.judge.score=logprobs"),
        "top_logprobs": (jc.score == "pattern", "reward.judge.score=logprobs"),
    }
    given = {"choices": dict(jc.choices), **{key: getattr(jc, key) for key in ("pattern", "min_choice_mass", "top_logprobs")}}
    return [f"reward.judge.{key}={given[key]!r} (read only with {needs})"
            for key, (is_unread, needs) in unread.items() if is_unread and given[key] != getattr(defaults, key)]


def judge_token(jc) -> str | None:
    """The judge's own token (reward.judge.token_file, else $GRPO_JUDGE_TOKEN), once its URLs may carry it."""
    return client_token(jc.token_file, JUDGE_TOKEN_ENV, jc.urls, jc.allow_plain_http, "reward.judge")


def build(cfg, device=None) -> Judge:
    """The reward function of `reward.judge`, once its servers answer and its choices are checked."""
    judge = Judge(cfg.reward.judge, judge_token(cfg.reward.judge))
    judge.wait_healthy()
    return judge
