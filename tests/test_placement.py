"""GPU placement and failure decisions, made by plain functions a CPU runs: which GPU ordinal a rank
takes, the tensor-parallel sizes vLLM 0.33 accepts and how dedicated engines split the free GPUs,
where the doctor puts its server, and how fast a dead engine or a refused transfer ends a wait.
The numbers are checked against vLLM 0.33.0's own rules (cited per test)."""

import subprocess
import sys
import time

import pytest

from grpo.dist import cuda_device_index
from grpo.errors import DeviceError, ServerError
from grpo.rollout.dedicated import engine_exit, plan_engines, vllm_tensor_parallel_sizes
from grpo.rollout.servers import ServerPool, free_port


def test_a_rank_never_asks_for_an_ordinal_it_cannot_see():
    """torchrun / a SLURM task with the node's GPUs: cuda:{local rank}. A task bound to one GPU
    (--gpus-per-task=1) sees it as cuda:0 whatever its local rank (the doctor's 2-rank check on a 1-GPU
    machine too); cuda:3 there is 'invalid device ordinal', and vLLM asserts LOCAL_RANK < device_count
    (vllm/v1/worker/gpu_worker.py). Two GPUs for four local ranks is a layout error, named."""
    assert [cuda_device_index(r, 8) for r in range(8)] == list(range(8))
    assert [cuda_device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    with pytest.raises(DeviceError, match="local rank 3 sees 2 GPU"):
        cuda_device_index(3, 2)


def test_tensor_parallel_sizes_are_the_ones_vllm_accepts():
    """vllm/config/model.py: heads % tp == 0; QKVParallelLinear: tp divides the KV heads, or the KV
    heads divide tp (replicated). Qwen2.5-1.5B: 12 heads, 2 KV heads; the tiny model: 4 and 4."""
    assert vllm_tensor_parallel_sizes(4, 4, 8) == [1, 2, 4]
    assert vllm_tensor_parallel_sizes(12, 2, 8) == [1, 2, 4, 6]  # 3: 2 KV heads cannot split into 3
    assert vllm_tensor_parallel_sizes(32, 8, 8) == [1, 2, 4, 8]
    assert vllm_tensor_parallel_sizes(None, None, 3) == [1, 2, 3]  # unknown model: vLLM decides


def test_dedicated_engines_fill_the_free_gpus_with_sizes_vllm_accepts():
    """One trainer on an 8-GPU node leaves 7: one engine of TP 7 exits at start for a 4-head model
    ('Total number of attention heads (4) must be divisible by tensor parallel size (7)'); auto makes 7
    engines of one GPU. 6 free GPUs for a 12-head / 2-KV-head model: 1 engine of TP 6."""
    seven = [f"cuda:{i}" for i in range(1, 8)]
    assert plan_engines(seven, 0, 4, 4) == [[d] for d in seven]
    six = [f"cuda:{i}" for i in range(2, 8)]
    assert plan_engines(six, 0, 12, 2) == [six]
    assert plan_engines(six, 3, 12, 2) == [six[0:2], six[2:4], six[4:6]]  # contiguous groups
    with pytest.raises(DeviceError, match=r"gives each engine 6 GPUs.*use num_engines in \[3, 6\]"):
        plan_engines(six, 1, 4, 4)
    with pytest.raises(DeviceError, match="num_engines=4 does not divide the 6 reserved devices"):
        plan_engines(six, 4, 12, 2)
    assert plan_engines(["cpu"], 0, 4, 4) == [["cpu"]] and plan_engines(["cpu"], 2, 4, 4) == [["cpu"], ["cpu"]]


@pytest.mark.starts_process
def test_an_engine_that_exits_at_start_ends_the_health_wait_at_once_with_its_log(tmp_path):
    """A real process that dies at start (as vLLM does on a bad --dtype, OOM, or a TP size it refuses),
    its port never answering: the wait ends within seconds quoting the exit code and the log's end,
    not after the start timeout (600 s by default)."""
    log = tmp_path / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; print('ValueError: Total number of attention "
                                 "heads (4) must be divisible by tensor parallel size (7)'); sys.exit(3)"],
                                stdout=out, stderr=subprocess.STDOUT)
    t0 = time.time()
    with pytest.raises(ServerError) as e:
        ServerPool([f"http://127.0.0.1:{free_port('127.0.0.1')}"], "token", 300, 10, log=None,
                   exited=[lambda: engine_exit(proc, str(log))])
    assert time.time() - t0 < 15
    assert "exited before it became healthy: exit code 3" in str(e.value)
    assert "must be divisible by tensor parallel size (7)" in str(e.value)


@pytest.mark.starts_process
def test_a_server_process_given_a_dead_parent_does_not_start():
    """grpo.serve --parent-pid (the trainer's pid) arms the parent-death signal itself; a parent that
    is already gone means the trainer died while it started: it exits at once, before vLLM."""
    out = subprocess.run([sys.executable, "-m", "grpo.serve", "--model", "unused", "--parent-pid", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "the process that started it (1) is gone" in out.stderr


def test_an_nccl_broadcast_wait_is_bounded_and_ends_on_abort():
    """PyNccl broadcasts have no timeout: the sender polls the broadcast's CUDA event
    (`nccl_transfer.wait_until_done`) instead of `stream.synchronize()`, so a server that never posts
    its receive costs request_timeout_s at most, and a refused /update_weights (abort) ends it at once."""
    from grpo.rollout.nccl_transfer import wait_until_done

    calls = iter([False, False, True])
    wait_until_done(lambda: next(calls), 5)  # completes on the third poll
    t0 = time.time()
    with pytest.raises(TimeoutError, match="did not complete within 0.2 s"):
        wait_until_done(lambda: False, 0.2)
    with pytest.raises(RuntimeError, match="aborted: the server refused its half"):
        wait_until_done(lambda: False, 60, aborted=lambda: True)
    assert time.time() - t0 < 5


@pytest.mark.starts_process
def test_a_single_process_group_binds_its_own_store_port():
    """One process (DeepSpeed's group of one): the store listens on a port the kernel chose at bind
    time, exported as MASTER_PORT, instead of a port found free and bound later."""
    script = ("import os, torch.distributed as d\n"
              "from grpo.dist import DistInfo, init_distributed\n"
              "init_distributed(DistInfo(), force=True)\n"
              "print(d.is_initialized(), d.get_world_size(), os.environ['MASTER_PORT'])\n"
              "d.destroy_process_group()\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    initialized, world, port = out.stdout.split()
    assert initialized == "True" and world == "1" and int(port) > 0


@pytest.mark.starts_process
def test_grpo_serve_port_0_writes_a_url_whose_port_it_already_holds(model_dir, tmp_path):
    """`grpo.serve --port 0 --url-dir D`: the port in the URL it writes is bound by the server process
    from that moment (held across the exec into vLLM), so another process cannot take it between
    the URL and vLLM's own bind (before: picked free, released, written, bound seconds later)."""
    import os
    import signal
    import socket

    from tests.conftest import ROOT, wait_for

    proc = subprocess.Popen([sys.executable, "-m", "grpo.serve", "--model", model_dir, "--port", "0", "--url-dir",
                             str(tmp_path), "--max-model-len", "128", "--memory-fraction", "0.1"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "GRPO_SERVE_TOKEN": "t"})
    try:
        wait_for(lambda: list(tmp_path.glob("*.url")), proc, None, "grpo.serve to write its URL", 120, every_s=0.2)
        url = next(tmp_path.glob("*.url")).read_text().strip()
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # held: while vLLM starts, and once it listens
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.starts_process
def test_a_stopped_run_exits_without_waiting_for_a_remote_request_in_flight(tmp_path):
    """A process whose pool is generating against a server that does not answer (a long generation),
    then closed (Ctrl-C, a stop signal): it exits at once, not after request_timeout_s. The server is a
    real HTTP server answering the health, model and version routes and holding /v1/completions open."""
    import http.server
    import json
    import threading

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": {}, "/v1/models": {"data": [{"id": "m"}]}, "/version": {"version": "0.32.0"},
                    "/weight_info": {"weight_version": None}}
            self._answer(body.get(self.path, {}))

        def do_POST(self):
            time.sleep(120)  # a generation that outlives the run

        def _answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    script = (f"import time\nfrom grpo.rollout.servers import ServerPool\nfrom grpo.rollout.base import Sampling\n"
              f"pool = ServerPool(['{url}'], None, 30, 90, can_push=False, log=None)\n"
              "pool.submit([[1, 2, 3]], 2, Sampling(max_new_tokens=4, temperature=1.0, seed=None), 0)\n"
              "time.sleep(1)\npool.close()\nprint('closed', flush=True)\n")
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    elapsed = time.time() - t0
    httpd.shutdown()
    httpd.server_close()  # shutdown() stops serving; the listening socket stays open until this
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr
    assert elapsed < 30, f"exit waited {elapsed:.0f} s for the request in flight"
