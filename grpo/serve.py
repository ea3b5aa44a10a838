"""`python -m grpo.serve --model DIR [--port P] [--token T]`: a vLLM server that `rollout=remote` can
train against.

It is vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`) started with:
  - the RL routes mounted (`VLLM_SERVER_DEV_MODE=1`): /init_weight_transfer_engine, /update_weights...;
  - the `grpo_gloo` weight-transfer backend (`--weight-transfer-config`; works on CPU and GPU
    servers, staging each bucket through host memory);
  - logprobs after temperature and top-k/top-p (`--logprobs-mode processed_logprobs`), as the sampler drew;
  - `guard_weight_routes` as middleware: the routes that change the server's weights or state need
    `Authorization: Bearer <token>`. A token is required whenever the server binds to anything but
    the loopback interface, and it doubles as vLLM's `--api-key` for the /v1 routes.

Any further arguments go to vLLM unchanged. The plain equivalent, for `vllm serve` users:
  VLLM_SERVER_DEV_MODE=1 GRPO_SERVE_TOKEN=T python -m vllm.entrypoints.openai.api_server --model DIR \
    --weight-transfer-config '{"backend": "grpo_gloo"}' --logprobs-mode processed_logprobs \
    --middleware grpo.serve.guard_weight_routes --api-key T
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
import socket
import sys

TOKEN_ENV = "GRPO_SERVE_TOKEN"
# Routes that change weights or engine state; everything under them is guarded.
GUARDED = (
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version",
    "/pause", "/resume", "/abort_requests", "/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache",
    "/reset_mm_cache", "/scale_elastic_ep", "/weight_checker",
)


def is_guarded(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in GUARDED)


def token_ok(header: str | None, token: str | None) -> bool:
    """With no token configured (loopback only) every local caller may; otherwise an exact Bearer."""
    if not token:
        return True
    return bool(header) and header.startswith("Bearer ") and hmac.compare_digest(header[7:], token)


async def guard_weight_routes(request, call_next):
    """ASGI middleware (vLLM `--middleware`): 401 for a guarded route without the shared token."""
    if is_guarded(request.url.path) and not token_ok(request.headers.get("authorization"), os.environ.get(TOKEN_ENV)):
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": f"{request.url.path} needs 'Authorization: Bearer <{TOKEN_ENV}>'"}, status_code=401)
    return await call_next(request)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def vllm_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    transfer = {"backend": "grpo_gloo"}
    argv = [
        "--model", args.model, "--host", args.host, "--port", str(args.port),
        "--dtype", args.dtype,
        "--gpu-memory-utilization", str(args.memory_fraction),
        "--weight-transfer-config", json.dumps(transfer),
        "--logprobs-mode", "processed_logprobs",
        "--middleware", "grpo.serve.guard_weight_routes",
        "--enable-prefix-caching",
    ]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.token:
        argv += ["--api-key", args.token]
    return argv + extra


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_url(folder: str, host: str, port: int) -> str:
    """Atomically, so a trainer polling the folder never reads half a URL."""
    name = socket.gethostname() if host in ("0.0.0.0", "::") else host
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}-{port}.url")
    with open(path + ".tmp", "w") as f:
        f.write(f"http://{name}:{port}\n")
    os.replace(path + ".tmp", path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or hub id (the trainer's model.path); `tiny`: the "
                   "embedded model of the default config, built if missing")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs --token")
    p.add_argument("--port", type=int, default=8000, help="0: a port found free on this machine")
    p.add_argument("--url-dir", help="write this server's URL (http://host:port) into DIR/<host>-<port>.url, "
                   "for trainers that discover their servers (slurm/train_remote.sbatch, grpo.launch servers=N)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"shared secret (or ${TOKEN_ENV})")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's own maximum")
    p.add_argument("--memory-fraction", type=float, default=0.2, help="vLLM's --gpu-memory-utilization")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    args, extra = p.parse_known_args(argv)
    if not is_loopback(args.host) and not args.token:
        p.error(f"--host {args.host} is reachable from other machines: give --token (or set {TOKEN_ENV}) so no one "
                "else can push weights into this server.")
    if args.model == "tiny":
        from grpo.launch import compose_train, model_folder

        args.model = model_folder(compose_train(["run_dir=unused"]))
    if args.port == 0:
        args.port = free_port(args.host)
    if args.url_dir:
        write_url(args.url_dir, args.host, args.port)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    if args.token:
        os.environ[TOKEN_ENV] = args.token
    argv_out = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_argv(args, extra)]
    sys.stdout.flush()
    os.execv(sys.executable, argv_out)  # become the server: signals and exit codes are vLLM's own


if __name__ == "__main__":
    main()
