"""One optimizer step on a fixed batch, for the loss-scale invariance test (test_parallel.py).

    python tests/ddp_step.py OUT N_MICRO                 # one process, parallel=single
    torchrun --nproc_per_node 2 tests/ddp_step.py OUT N_MICRO   # parallel=ddp, each rank half the rows

Writes OUT/<loss_type>.pt with the updated weights (rank 0), for every loss type.
"""

import copy
import os
import sys

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo.config import AlgoConfig, TinyModelConfig  # noqa: E402
from grpo.dist import dist_info, exit_process, init_distributed, shutdown  # noqa: E402
from grpo.models import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpo.parallel import STRATEGIES  # noqa: E402
from grpo.update import policy_update  # noqa: E402
from tests.test_gradient_invariance import make_batch  # noqa: E402


def main(out: str, n_micro: int) -> None:
    info = dist_info()
    init_distributed(info)
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    base = build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    batch = make_batch(tok, B=8)
    rows = batch.size // info.world_size
    local = batch.select(slice(info.rank * rows, (info.rank + 1) * rows))
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        algo = OmegaConf.structured(AlgoConfig(loss_type=loss_type, group_size=2, batch_size=8, lr=1e-2, warmup_steps=0,
                                               max_grad_norm=1e9, num_iterations=2, beta=0.05))
        algo.micro_batch_tokens = local.input_ids_BL.shape[1] * rows // n_micro
        model = copy.deepcopy(base)
        strategy = STRATEGIES["ddp" if info.world_size > 1 else "single"](None, model, algo, total_steps=10)
        # SGD at lr 1, so the weight change is exactly the (clipped) summed gradient: AdamW's first step
        # is lr * g / (|g| + eps), which turns float noise in near-zero gradients into visible changes.
        strategy.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        strategy.scheduler = torch.optim.lr_scheduler.LambdaLR(strategy.optimizer, lambda _: 1.0)
        ref = copy.deepcopy(base).eval()
        policy_update(strategy, local, algo, max_len=6, temperature=1.0, ref_model=ref)
        if info.rank == 0:
            torch.save(model.state_dict(), os.path.join(out, f"{loss_type}.pt"))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    exit_process(0)
