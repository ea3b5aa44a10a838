"""Routed experts from vLLM servers (grpo/moe/served_routes.py; built from vLLM 0.26.0's source, not yet
run: it needs a GPU): a choice's base64 `.npy` field decoded by value and laid out as the hf backend's
routes, a server without them or with routes of another length named with the fix, the server flag,
and dedicated engines on the CPU refused."""

import argparse
import base64
import io

import numpy as np
import pytest
import torch

from grpo.endpoints import Server
from grpo.errors import ConfigError
from grpo.moe import served_routes
from grpo.rollout.servers import ServerPool
from grpo.serve import vllm_argv
from grpo.rollout.vllm_api import VllmApi


def encoded(array: np.ndarray) -> str:
    """What vLLM's /v1/completions puts in a choice (serving.py: np.save, then b64encode)."""
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def test_a_choices_routes_decode_by_value_as_prompt_plus_completion_minus_one_rows():
    routes = np.array([[[0, 3], [7, 1]], [[2, 5], [4, 6]], [[1, 0], [3, 2]], [[6, 7], [5, 0]]], dtype=np.int32)
    got = served_routes.completion_routes({"routed_experts": encoded(routes)}, prompt_len=2, completion_len=3, url="u")
    assert got.dtype == torch.long and got.tolist() == routes.tolist()  # 2 + 3 - 1 rows, 2 MoE layers, top-2


def test_a_server_without_routes_or_with_other_rows_is_named_with_the_fix():
    with pytest.raises(ConfigError, match="http://s:1 returned no routed experts: start it with `python -m grpo.serve --routed-experts`"):
        served_routes.completion_routes({"routed_experts": None}, 2, 3, "http://s:1")
    with pytest.raises(ConfigError, match=r"shape \(5, 2, 2\) for a prompt of 2 and a completion of 3 tokens; expected \[4,"):
        served_routes.completion_routes({"routed_experts": encoded(np.zeros((5, 2, 2), dtype=np.int64))}, 2, 3, "u")
    pickled = base64.b64encode(b"\x80\x04K\x01.").decode()  # not an .npy: never unpickled
    with pytest.raises(ValueError):
        served_routes.completion_routes({"routed_experts": pickled}, 1, 1, "u")


def test_the_server_flag_follows_the_setting():
    args = argparse.Namespace(model="m", host="127.0.0.1", port=1, dtype="bfloat16", memory_fraction=0.9,
                              weight_transfer="nccl", max_model_len=0, enforce_eager=False, chunked_prefill=True,
                              routed_experts=True)
    api = VllmApi("0.26.0", False, False, False, False, False, False)
    assert served_routes.SERVER_FLAG == "--enable-return-routed-experts" and served_routes.SERVER_FLAG in vllm_argv(args, [], api=api)
    args.routed_experts = False
    assert served_routes.SERVER_FLAG not in vllm_argv(args, [], api=api)


def test_dedicated_engines_on_the_cpu_cannot_return_routes():
    served_routes.check_engines([["cuda:1"], ["cuda:2", "cuda:3"]], "rollout.routing_replay=true")
    with pytest.raises(ConfigError, match="rollout.routing_observe=true with rollout=dedicated on the CPU"):
        served_routes.check_engines([["cpu"]], "rollout.routing_observe=true")


def test_the_pool_lays_each_choices_routes_out_with_its_completion(monkeypatch):
    """ServerPool.generate with `routes` on: two prompts x n=2 on one server, each choice's routes kept
    with its completion (and a choice without them named)."""
    pool = ServerPool.__new__(ServerPool)  # no server to wait for: `complete` answers below
    pool.servers, pool.clients, pool.idle_since, pool.routes = [Server("http://s:1", None, 1)], 1, None, True
    prompts = [[5, 6, 7], [8]]
    answer = []
    for p, prompt in enumerate(prompts):
        for k in range(2):
            c = 1 + p + k  # completion lengths 1, 2, 2, 3
            answer.append({"token_ids": list(range(c)), "logprobs": {"token_logprobs": [-0.5] * c}, "finish_reason": "stop",
                           "routed_experts": encoded(np.full((len(prompt) + c - 1, 2, 2), 10 * p + k))})
    monkeypatch.setattr(ServerPool, "served_version", lambda self, server, version: version)
    monkeypatch.setattr(ServerPool, "complete", lambda self, server, ps, n, sampling, seed, timeout=None: answer)
    from grpo.rollout import Sampling

    out = pool.generate(prompts, 2, Sampling(max_new_tokens=4), version=0)
    assert [tuple(r.shape) for r in out.routed_experts] == [(3, 2, 2), (4, 2, 2), (2, 2, 2), (3, 2, 2)]  # P + C - 1
    assert [int(r[0, 0, 0]) for r in out.routed_experts] == [0, 1, 10, 11]
    answer[3]["routed_experts"] = None
    with pytest.raises(ConfigError, match="http://s:1 returned no routed experts"):
        pool.generate(prompts, 2, Sampling(max_new_tokens=4), version=0)
