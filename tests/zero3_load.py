"""ZeRO-3 loading and the sharded reference, on 2 ranks (test_zero.py):

    torchrun --nproc_per_node 2 tests/zero3_load.py MODEL_FOLDER OUT

The policy is built in bf16 under `Zero3Strategy.loading` (deepspeed.zero.Init): right after
`build_policy` every parameter is an empty placeholder and this rank holds about half of the
elements, and gathered they equal the folder's weights. The engine accumulates gradients in fp32.
The reference (algo.beta > 0) is built the same way and is a partitioned engine; rank 0 takes 6
rows in 6 micro-batches, rank 1 takes 2, so rank 1 must pad its reference forwards too (else the
gathers would hang). Before any step the reference and the policy give the same logprobs: KL 0.
Rank 0 writes OUT (JSON).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.ddp_step import exit_process  # noqa: E402


def main(folder: str, out: str) -> None:
    import deepspeed
    from safetensors.torch import load_file

    from grpo.dist import dist_info, init_distributed
    from grpo.models import build_policy, build_reference
    from grpo.parallel.zero import Zero3Strategy
    from grpo.tiny.folders import resolve_on_node
    from grpo.tiny.text import build_char_tokenizer
    from grpo.update import policy_update
    from tests.conftest import compose_cfg
    from tests.test_gradient_invariance import make_batch

    info = dist_info()
    init_distributed(info)
    cfg = compose_cfg("parallel=zero3", f"model.path={folder}", "model.dtype=bfloat16", "algo.beta=0.04", "algo.zero_std_groups=keep",
                      "algo.batch_size=8", "algo.group_size=2", "algo.warmup_steps=0")
    path = resolve_on_node(cfg, info, log=lambda *_: None)
    model, _ = build_policy(cfg, path, info, log=lambda *_: None,
                            loading=Zero3Strategy.loading(cfg.parallel, cfg.algo, torch.bfloat16))
    params = list(model.parameters())
    result = {
        "placeholders": all(p.numel() == 0 for p in params),  # nothing whole on this rank
        "local_elements": sum(p.ds_tensor.numel() for p in params),  # this rank's shards
        "full_elements": sum(p.ds_numel for p in params),
    }
    saved = load_file(os.path.join(folder, "model.safetensors"))
    with deepspeed.zero.GatheredParameters(params):
        result["max_diff_to_folder"] = max(
            (p.detach().float() - saved[n].to(torch.bfloat16).float()).abs().max().item() for n, p in model.named_parameters())
    strategy = Zero3Strategy(cfg.parallel, model, cfg.algo, total_steps=1)
    result["data_types"] = [str(t) for t in strategy.engine.get_data_types()]
    ref = build_reference(cfg, path, strategy)
    result["reference_placeholders"] = all(p.numel() == 0 for p in ref.module.parameters())

    batch = make_batch(build_char_tokenizer(), B=8)
    local = batch.select(slice(0, 6) if info.rank == 0 else slice(6, 8))
    cfg.algo.micro_batch_tokens = local.input_ids_BL.shape[1]  # one row per micro-batch: 6 on rank 0, 2 on rank 1
    stats = policy_update(strategy, local, cfg.algo, max_len=6, temperature=1.0, ref_model=ref)
    result["kl"], result["loss"] = stats["kl"], stats["loss"]
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
