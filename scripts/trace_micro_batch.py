"""Follow one micro-batch through the update: every call from one grpo file into another while
`accumulate_gradients` runs one micro-batch of the tiny model (the layout probes ran before, as in a
run's later steps). `python scripts/trace_micro_batch.py [padded|packed|shared]` from the checkout.
docs/results/update_shape.md holds its output."""

import collections
import os
import sys

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.getcwd())

from grpo.batch import collate  # noqa: E402
from grpo.config import AlgoConfig, TinyModelConfig  # noqa: E402
from grpo.parallel.single import SingleStrategy  # noqa: E402
from grpo.rollout.base import Rollouts  # noqa: E402
from grpo.tiny.text import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpo.update import accumulate_gradients, loss_norm  # noqa: E402


def batch_of(tok):
    """4 prompts x 2 completions of 3-9 tokens."""
    g = torch.Generator().manual_seed(0)
    prompts = [[tok.bos_token_id] + torch.randint(4, 20, (3 + k,), generator=g).tolist() for k in range(4) for _ in range(2)]
    comps = [torch.randint(4, 20, (3 + k,), generator=g).tolist() for k in range(8)]
    rollouts = Rollouts(comps, [[-0.5] * len(c) for c in comps], ["stop"] * 8, 0)
    return collate(prompts, rollouts, torch.randn(8, generator=g), tok.pad_token_id, False)


def main(layout: str) -> None:
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id).float()
    algo = OmegaConf.structured(AlgoConfig(group_size=2, batch_size=8, packing=layout != "padded",
                                           shared_prompt=layout == "shared", micro_batch_tokens=10_000))
    strategy = SingleStrategy(None, model, algo, total_steps=2)
    batch = batch_of(tok)
    norm = loss_norm(batch, 14, float(batch.mask_BT.sum()))
    accumulate_gradients(strategy, batch, algo, norm, 1.0)  # the probes run once per model
    root = os.path.join(os.getcwd(), "grpo") + os.sep
    hops = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if callee.startswith(root) and caller.startswith(root) and callee != caller:
            hops.append((caller[len(root):], callee[len(root):], frame.f_code.co_name))

    sys.setprofile(profile)
    accumulate_gradients(strategy, batch, algo, norm, 1.0)
    sys.setprofile(None)
    entered = collections.Counter(callee for _, callee, _ in hops)
    print(f"{layout}: {len(hops)} calls across files, {len(entered)} files entered")
    for caller, callee, name in hops:
        print(f"  {caller} -> {callee} {name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "packed")
