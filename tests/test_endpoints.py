"""grpo/endpoints.py against plain HTTP servers on loopback: whatever a request meets is a ServerError
naming the URL and the path, so every caller's `except ServerError` (a served reward model's share, a
judge's retry, a trajectory's request) sees it; a served reward model's share cut off scores None."""

from __future__ import annotations

import json
import re
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo.endpoints import NoModelList, NotJson, Server, check_urls, parallel_map, wait_until
from grpo.errors import ConfigError, RewardStop, ServerError
from grpo.rewards.served_rm import ServedRewardModel
from grpo.tiny.text import build_char_tokenizer


class Answers(BaseHTTPRequestHandler):
    """Answers every request 200 with `body`; `declared`: the Content-Length sent (more than the body:
    the connection closes early, http.client's IncompleteRead)."""

    body, declared, status, location = b"", None, 200, None

    def do_GET(self):
        self.answer()

    def do_POST(self):
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.body == b"scores":  # a reward model: one score per input
            body = json.dumps({"data": [{"index": i, "probs": [0.5]} for i in range(len(asked["input"]))]}).encode()
            self.body, self.declared = body, len(body)
        self.answer()

    def answer(self):
        self.send_response(self.status)
        if self.location:
            self.send_header("Location", self.location)
        self.send_header("Content-Length", str(self.declared if self.declared is not None else len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(body, declared=None, status=200, location=None) -> the URL of a server answering so."""
    started = []

    def start(body: bytes, declared: int | None = None, status: int = 200, location: str | None = None) -> str:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Answers,), {"body": body, "declared": declared,
                                                                            "status": status, "location": location}))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_port}"

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def test_an_answer_cut_off_or_not_json_is_a_server_error_naming_the_url_and_path(serve):
    """Before, http.client's IncompleteRead and json's JSONDecodeError passed through Server.request:
    neither a ServerError nor an OSError."""
    cut = serve(b'{"data": [{"index": 0, "pro', declared=400)
    with pytest.raises(ServerError, match=re.escape(f"{cut}/classify broke off its answer") + ".*IncompleteRead"):
        Server(cut, None, 5).request("/classify", {"input": [[1, 2]]})
    html = serve(b"<html>gateway</html>")
    with pytest.raises(NotJson, match=re.escape(f"{html}/classify answered with no JSON") + ".*gateway"):
        Server(html, None, 5).request("/classify", {"input": [[1, 2]]})
    assert Server(html, None, 5).request("/classify", {"input": []}, text=True) == "<html>gateway</html>"
    # a health wait: a server that answers, but not JSON, will not answer JSON later: at once, not after the timeout
    with pytest.raises(NotJson, match="answered with no JSON"):
        wait_until(lambda: Server(html, None, 5).request("/v1/models"), timeout_s=60, poll_s=30, log=None)


@pytest.mark.parametrize("models", [b'{"object": "list"}', b'{"data": []}', b'{"data": ["m"]}', b"[]"])
def test_a_health_wait_on_a_server_that_lists_no_model_fails_at_once_naming_what_it_answered(serve, models):
    """Before, a JSON /v1/models without vLLM's `data` list ended the wait in a bare KeyError or IndexError."""
    url = serve(models)
    with pytest.raises(NoModelList, match=re.escape(f"{url}/v1/models answered {json.dumps(json.loads(models))}") + ".*OpenAI-compatible server"):
        Server(url, None, 5).wait_healthy(time.time() + 60, log=None)
    card = serve(b'{"data": [{"id": "m", "max_model_len": 256}]}')
    server = Server(card, None, 5)
    server.wait_healthy(time.time() + 60, log=None)
    assert (server.model, server.max_model_len) == ("m", 256)


def test_a_served_reward_model_share_cut_off_or_not_json_scores_none_the_others_kept(serve):
    """One server fine, the other's answer cut off (or not JSON): its share scores None with a warning,
    counted as failed; before, the batch's whole scoring raised."""
    good = serve(b"scores")
    for bad in (serve(b'{"data": [{"index": 0, "pro', declared=400), serve(b"<html>gateway</html>")):
        rm = ServedRewardModel([Server(good, None, 5), Server(bad, None, 5)], build_char_tokenizer())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert rm.scores(["1+1=2", "2+2=4", "3+3=6", "4+4=8"]) == [0.5, 0.5, None, None]
        assert rm.stats["failed"] == 2
        assert any(f"server {bad} failed on its 2 texts" in str(w.message) for w in seen), [str(w.message) for w in seen]


@pytest.mark.parametrize("status, location", [(401, None), (403, None), (404, None), (302, "http://elsewhere.example/classify")])
def test_a_served_reward_model_that_refuses_or_redirects_stops_the_run(serve, status, location):
    """A server restarted with another token, or moved behind a redirect, answers every later batch the
    same way: each batch scored None and the run went on for nothing. Stopped at once, as the judge is."""
    good = serve(b"scores")
    refusing = serve(b'{"error": "no"}', status=status, location=location)
    rm = ServedRewardModel([Server(good, None, 5), Server(refusing, None, 5)], build_char_tokenizer())
    with pytest.raises(RewardStop, match=re.escape(f"reward 'rm': {refusing}/classify answered {status}")):
        rm.scores(["1+1=2", "2+2=4", "3+3=6", "4+4=8"])
    rm = ServedRewardModel([Server(good, None, 5), Server(serve(b'{"error": "busy"}', status=503), None, 5)],
                           build_char_tokenizer())
    with warnings.catch_warnings(record=True):  # a 5xx may pass: that share scores None and the run goes on
        warnings.simplefilter("always")
        assert rm.scores(["1+1=2", "2+2=4", "3+3=6", "4+4=8"]) == [0.5, 0.5, None, None]


def test_a_served_reward_models_scores_are_matched_to_its_inputs_by_index():
    """vLLM's /classify answer carries each input's `index`: scores are read in that order, not the order
    the rows arrive in (a score on the wrong completion is a silently wrong reward)."""
    from grpo.rewards.served_rm import classify

    class Shuffled(Server):
        def request(self, path, body=None, timeout=None, text=False, send_token=True):
            return {"data": [{"index": 2, "probs": [0.3]}, {"index": 0, "probs": [0.1]}, {"index": 1, "probs": [0.2]}]}

    assert classify(Shuffled("http://127.0.0.1:1", None, 5.0), [[1], [2], [3]]) == [0.1, 0.2, 0.3]


@pytest.mark.parametrize("status, says", [(401, "GRPO_JUDGE_TOKEN"), (403, "the server refuses this client")])
def test_a_health_wait_that_is_refused_fails_at_once(status, says):
    """A server that answers 401 (403) to the health wait's request refuses this client's token: waiting
    cannot change that, so the wait fails at once saying why, not after its whole timeout (here 30 s,
    a start's default is minutes) with "did not become healthy"."""
    calls = []

    def refused():
        calls.append(1)
        raise ServerError(f"http://127.0.0.1:1/v1/models answered {status}: no", status)

    with pytest.raises(ServerError, match=rf"judge server is up but refused the request: .*answered {status}.*{says}"):
        wait_until(refused, timeout_s=30, poll_s=0.1, what="judge server", log=None)
    assert len(calls) == 1  # no second try: waiting cannot change a refusal


@pytest.mark.parametrize("key", ["rollout.remote.urls", "reward.judge.urls", "reward.rm.urls"])
def test_a_url_with_a_user_and_password_is_refused_without_showing_the_password(key):
    """http://user:pass@host passed validation, never worked (the clients send a Bearer token, no basic
    auth) and printed the password in every later health-check error."""
    for url in ("http://user:s3cret-pw@node7:8000", "https://s3cret-pw@node7:8000/vllm"):
        with pytest.raises(ConfigError) as e:
            check_urls(["http://node6:8000", url], key)
        group = key.removesuffix(".urls")
        assert str(e.value).startswith(f"{key}: '{url.split('//')[0]}//node7:8000")
        assert f"{group}.token_file" in str(e.value)
        assert "s3cret-pw" not in str(e.value)
    check_urls(["http://node7:8000/vllm", "https://[::1]:8443"], key)  # no userinfo: as before


def test_parallel_map_starts_no_item_after_an_error_with_several_workers():
    """Two workers over ["fail", 0.3, 0.3, 0.3, 0.3]: the first item fails once item 1 has started, and
    is raised; the other worker, busy with item 1 for 0.3 s, must then stop rather than take items 2, 3,
    4 (requests a failed batch no longer needs, each holding a server for its whole time). With
    workers=1 the one worker returns on its own error, so only several workers show it."""
    started, one_started = [], threading.Event()

    def item(x):
        started.append(x)
        if x == "fail":
            one_started.wait(5)
            raise ServerError("refused")
        one_started.set()
        time.sleep(x)
        return x

    with pytest.raises(ServerError, match="refused"):
        parallel_map(item, ["fail", 0.3, 0.3, 0.3, 0.3], workers=2)
    time.sleep(0.8)  # long enough for the busy worker to finish item 1 and (wrongly) start two more
    assert sorted(map(str, started)) == ["0.3", "fail"]


@pytest.mark.parametrize("status", [404, 401])
def test_a_health_wait_on_a_url_given_with_v1_fails_at_once_saying_to_give_the_root(serve, status):
    """http://host:8000/v1 (the OpenAI base URL) asks /v1/health: vLLM answers 404, grpo.serve with a token
    401 (not an open route), and either was polled for the whole health timeout (minutes), the 401 then
    blamed on the token. A 404 at the root is still waited out: a proxy (Ray Serve's) answers 404 until
    the application behind it is deployed."""
    root = serve(b'{"detail": "Not Found"}', status=status)
    with pytest.raises(ServerError, match=re.escape(f"{root}/v1/health answered {status}") + ".*give the server's root "
                                          + re.escape(f"URL ({root}), without /v1")):
        Server(root + "/v1", None, 5).wait_healthy(time.time() + 10, log=None, kind="judge server")
