"""`python -m grpo.bench update-memory` and `hf-scores`: the memory that a real vocabulary
costs, before and after, each measurement in a fresh process of this module
(`python -m grpo.bench.memory WORKER MODE OUT`) so each starts from the same resting memory.

Both run on a synthetic model with SmolLM2-135M's body (hidden 576, 9 heads, 3 KV heads, MLP 1536)
and Qwen2.5's 151,936-token vocabulary, built in code (no download), with `--layers` of the body's 30
layers: the logit side does not depend on depth, and the `body` row measures the rest.

- update: one forward + backward of the policy loss on one micro-batch of 8,192 completion tokens
  (16 x (64 prompt + 512 completion)). `logits`: the completion's logits whole, logit - logsumexp
  (grpo.update before the head ran in pieces); `pieces`: grpo.update.forward.batch_logprobs now; `body`:
  the body alone (its last hidden states summed), to subtract: the logit side is the peak above it.
  `frozen-body`, `frozen-recomputed` and `frozen`: the same with the head (and the tied input
  embedding) frozen, as under LoRA: its pieces recomputed in backward (the path before
  grpo/update/frozen_head.py) against their gradient taken in the forward (now).
- hf: `generate` of 32 x 128 new tokens through the hf backend's processors. `output_scores`: every
  step's scores kept, stacked and log-softmaxed (the hf backend before); `recorder`: the backend now.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from grpo.batch import collate
from grpo.rollout import Sampling
from grpo.rollout.base import Rollouts
from grpo.rollout.hf import SampledLogprobs, folder_defaults_off, generation_config, logits_processors
from grpo.update import frozen_head
from grpo.update.forward import batch_logprobs, token_logprobs

VOCAB = 151_936
# glibc raises its mmap threshold to the largest block freed (up to 32 MB), after which every
# step's 19 MB logits row comes from the heap and freed rows stay resident: 1.8 GB of the hf row
# at 128 tokens was that, 125 MB with the threshold fixed. Fixed, the peaks measure tensors.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


class PeakRSS:
    """This process's resident memory sampled every millisecond on a thread, all of it and its
    anonymous part (resident - shared: without memory-mapped files); peaks above entry, in MB
    (`peak_above_mb` = `rss_mb`, and `anon_mb`)."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self.sample()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> tuple[int, int]:
        with open("/proc/self/statm") as f:
            resident, shared = (int(x) * self.page for x in f.read().split()[1:3])
        return resident, resident - shared

    def _run(self):
        while not self.done.wait(0.001):
            self.peak = tuple(map(max, self.peak, self.sample()))

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = tuple(map(max, self.peak, self.sample()))
        self.rss_mb, self.anon_mb = ((p - b) / 2**20 for p, b in zip(self.peak, self.base))
        self.peak_above_mb = self.rss_mb


def smollm2_body(layers: int, vocab: int = VOCAB):
    """SmolLM2-135M's shape with `layers` layers and a `vocab`-token head, fp32, seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).float()


def random_batch(rows: int, prompt: int, completion: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    done = [torch.randint(3, vocab, (completion,), generator=g).tolist() for _ in range(rows)]
    return collate(prompts, Rollouts(done, [[0.0] * completion] * rows, ["length"] * rows, 0), torch.ones(rows), 0, False)


def whole_logits_logprobs(model, batch):
    """grpo.update.forward.batch_logprobs before the pieces: the completion's logits whole (logits_to_keep),
    then logit - logsumexp, which keeps the fp32 tokens x vocabulary tensor for backward."""
    T = batch.completion_ids_BT.shape[1]
    logits = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                   position_ids=batch.position_ids_BL, logits_to_keep=T + 1).logits[:, -(T + 1) : -1]
    return token_logprobs(logits, batch.completion_ids_BT)


def update_worker(mode: str, out: str, layers: int, rows: int = 16, prompt: int = 64, completion: int = 512) -> None:
    model = smollm2_body(layers).train()
    if mode.startswith("frozen"):  # as under LoRA
        model.get_output_embeddings().requires_grad_(False)
    if mode == "frozen-recomputed":
        frozen_head.applies = lambda head: False
    batch = random_batch(rows, prompt, completion, VOCAB)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        if mode.endswith("body"):
            hidden = model.model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                                 position_ids=batch.position_ids_BL).last_hidden_state
            hidden.sum().backward()
            logp = torch.zeros(())
        elif mode == "logits":
            logp = whole_logits_logprobs(model, batch)
            (-logp.mean()).backward()
        else:
            logp, _ = batch_logprobs(model, batch, 1.0, max_tokens=rows * (prompt + completion))
            (-logp.mean()).backward()
        seconds = time.perf_counter() - t0
    grad = model.get_output_embeddings().weight.grad
    body_grad = model.model.layers[-1].mlp.down_proj.weight.grad
    with open(out, "w") as f:
        json.dump({"mode": mode, "peak_above_rest_mb": mem.peak_above_mb, "seconds": seconds, "vocab": VOCAB,
                   "completion_tokens": rows * completion, "logp_sum": float(logp.detach().double().sum()),
                   "head_grad_sum": float(grad.double().abs().sum()) if grad is not None else 0.0,
                   "body_grad_sum": float(body_grad.double().abs().sum())}, f)


def hf_worker(mode: str, out: str, layers: int, rows: int = 32, prompt: int = 16, new_tokens: int = 128) -> None:
    model = smollm2_body(layers).eval()
    ids = torch.randint(3, VOCAB, (rows, prompt), generator=torch.Generator().manual_seed(0))
    sampling = Sampling(max_new_tokens=new_tokens, temperature=1.0)
    # no stop token: every row runs the whole budget
    cfg = generation_config(sampling, pad_id=0, stop_ids=[VOCAB + 1])
    if mode == "output_scores":
        cfg = GenerationConfig(**{**cfg.to_dict(), "output_scores": True})
    recorder = SampledLogprobs()
    torch.manual_seed(0)
    with PeakRSS() as mem, torch.no_grad(), folder_defaults_off(model):
        t0 = time.perf_counter()
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg,
                             logits_processor=logits_processors(sampling, recorder))
        new = gen.sequences[:, prompt:]
        if mode == "output_scores":
            scores = torch.stack(gen.scores, dim=1).float()
            logp = torch.log_softmax(scores, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        else:
            logp = recorder.logprobs(new)
        seconds = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump({"mode": mode, "peak_above_rest_mb": mem.peak_above_mb, "seconds": seconds, "vocab": VOCAB,
                   "rows": rows, "new_tokens": new.shape[1], "logp_sum": float(logp.double().sum())}, f)


def run_workers(worker: str, modes: list[str], layers: int) -> list[dict]:
    rows = []
    for mode in modes:
        print(f"bench: {worker} {mode}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, "-m", "grpo.bench.memory", worker, mode, f.name, str(layers)], check=True,
                           env={**os.environ, **ALLOCATOR})
            rows.append(json.load(open(f.name)))
    return rows


def bench_update_memory(layers: int) -> list[dict]:
    rows = run_workers("update", ["body", "logits", "pieces", "frozen-body", "frozen-recomputed", "frozen"], layers)
    for body, before, *after in (rows[:3], rows[3:]):  # each against its own body and the path before
        for row in (before, *after):
            row["logit_side_mb"] = row["peak_above_rest_mb"] - body["peak_above_rest_mb"]
            row["vs_before"] = row["logit_side_mb"] / before["logit_side_mb"]
            row["logp_diff"] = abs(row["logp_sum"] - before["logp_sum"])
            grad = "head_grad_sum" if before["head_grad_sum"] else "body_grad_sum"
            row["grad_rel_diff"] = abs(row[grad] - before[grad]) / before[grad]
    return rows


def bench_hf_scores(layers: int) -> list[dict]:
    rows = run_workers("hf", ["output_scores", "recorder"], layers)
    for row in rows:
        row["vs_output_scores"] = row["peak_above_rest_mb"] / rows[0]["peak_above_rest_mb"]
    return rows


def report_update_memory(layers: int) -> tuple[dict, list]:
    rows = bench_update_memory(layers)
    return {"update_memory": rows}, [
        (f"forward + backward of the policy loss, SmolLM2-135M's body ({layers} layers) with a 152k vocabulary, "
         "one micro-batch of 8192 completion tokens: 16 x (64 prompt + 512 completion)", rows,
         ["mode", "peak_above_rest_mb", "logit_side_mb", "vs_before", "seconds", "logp_diff", "grad_rel_diff"])]


def report_hf_scores(layers: int) -> tuple[dict, list]:
    rows = bench_hf_scores(layers)
    return {"hf_scores": rows}, [
        (f"hf generate, SmolLM2-135M's body ({layers} layers) with a 152k vocabulary, 32 rows x 128 new tokens", rows,
         ["mode", "peak_above_rest_mb", "vs_output_scores", "seconds", "logp_sum"])]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo.bench.memory",
                                     description="One measurement in a fresh process; `python -m grpo.bench "
                                                 "update-memory` and `hf-scores` run one per mode.")
    parser.add_argument("worker", choices=["update", "hf"])
    parser.add_argument("mode", help="update: logits, pieces, body, frozen-body, frozen-recomputed or frozen; "
                                     "hf: output_scores or recorder")
    parser.add_argument("out", help="the JSON file the row is written to")
    parser.add_argument("layers", type=int, help="decoder layers of SmolLM2-135M's body (of 30)")
    args = parser.parse_args()
    {"update": update_worker, "hf": hf_worker}[args.worker](args.mode, args.out, args.layers)
