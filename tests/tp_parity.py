"""Parity round trip for a colocated engine shared by 2 ranks (tensor parallel, external_launcher).

    torchrun --standalone --nproc_per_node 2 tests/tp_parity.py OUT_DIR     (used by test_parallel.py)
"""

import json
import os
import sys

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo import dist  # noqa: E402
from grpo.config import RolloutConfig, TinyModelConfig  # noqa: E402
from grpo.tiny.text import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpo.rollout.colocated import ColocatedBackend  # noqa: E402
from tests.parity import sync_round_trip  # noqa: E402


def main(out: str) -> None:
    dist.init_distributed(dist.dist_info())
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    path = os.path.join(out, "model")
    if dist.rank() == 0:
        model.save_pretrained(path)
        tok.save_pretrained(path)
    dist.barrier()
    cfg = OmegaConf.structured(RolloutConfig(backend="colocated", max_new_tokens=32))
    cfg.vllm.memory_fraction, cfg.vllm.max_model_len, cfg.vllm.tensor_parallel_size = 0.1, 128, 2
    backend = ColocatedBackend(cfg, model, tok, path)
    result = sync_round_trip(backend, model, tok)
    with open(os.path.join(out, f"rank{dist.rank()}.json"), "w") as f:
        json.dump(result, f)
    backend.close()
    dist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
