"""Probes for the project's first GPU run (REVIEW Part 4, "The probes and the matrix for a first GPU
run"), and the summary of its training runs. Used by scripts/gpu_first_run.sh; each part also runs on
a CPU (the CUDA-only parts say SKIP there), so the script can be checked without a GPU.

    python scripts/gpu_probes.py env                   # versions: torch, CUDA, cuDNN, the GPU
    python scripts/gpu_probes.py sdpa OUT.json         # probes (a), (b), (c)
    python scripts/gpu_probes.py summarize RUN_DIR...  # one row per run: loss, grad norm, sampler_diff, KL, memory

(a) pytorch issue 196678: bf16, L=704 (and 768 as a control), D=64, q[...,0]=1, k[...,0]=-120*sqrt(D)
    (every row's logsumexp far below -88.7), a tril bool attn_mask, backward: non-finite q.grad under
    torch's default backends, under each backend alone, and under grpo.update.forward.training_attention.
(b) the same with a left-padded mask whose first rows are all False (the padded layout's pad queries),
    ordinary random q/k/v, at L=704 and L=640.
(c) peak memory of 28 chained SDPA calls (2 rows, W=4096, 14 heads, D=64, bf16, requires_grad) with
    the shared layout's (R,1,W,W) bool mask against is_causal=True.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


def env() -> None:
    import platform

    import torch

    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"cuda available {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
        print(f"sdp enabled: flash {torch.backends.cuda.flash_sdp_enabled()}, mem_efficient "
              f"{torch.backends.cuda.mem_efficient_sdp_enabled()}, math {torch.backends.cuda.math_sdp_enabled()}, "
              f"cudnn {torch.backends.cuda.cudnn_sdp_enabled()}")
    for name in ("transformers", "deepspeed", "peft", "hydra", "omegaconf", "numpy", "tokenizers", "huggingface_hub"):
        try:
            mod = __import__(name)
            print(f"{name} {getattr(mod, '__version__', '?')} ({os.path.dirname(mod.__file__)})")
        except Exception as e:  # noqa: BLE001 - a probe reports, it does not stop
            print(f"{name}: not importable ({type(e).__name__}: {e})")
    try:
        from grpo.update.forward import sdpa_backends

        print(f"grpo.update.forward.sdpa_backends('cuda', {torch.__version__!r}) = {sdpa_backends('cuda')}")
    except Exception as e:  # noqa: BLE001
        print(f"grpo.update.forward: {type(e).__name__}: {e}")


def _backends():
    from torch.nn.attention import SDPBackend

    names = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    return [(n, getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


def _grad_run(q0, k0, v0, mask, g, context):
    """out and q.grad of sdpa(q, k, v, mask) under `context`, or the error's first line."""
    import torch
    import torch.nn.functional as F

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q0, k0, v0))
    try:
        with context:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            (out.float() * g).sum().backward()
        if q.device.type == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as e:
        return None, None, str(e).splitlines()[0][:160]
    return out.detach(), q.grad.detach(), None


def _case(label, q0, k0, v0, mask, g, rows_to_compare=None) -> dict:
    """One probe case under the default backends, each backend alone, and the trainer's choice;
    non-finite counts and the largest gap to an fp32 MATH reference (on rows_to_compare)."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from grpo.update.forward import training_attention

    ref_out, ref_grad, err = _grad_run(q0.float(), k0.float(), v0.float(), mask, g,
                                       sdpa_kernel([SDPBackend.MATH]))
    contexts = [("default", contextlib.nullcontext())]
    contexts += [(n, sdpa_kernel([b])) for n, b in _backends()]
    contexts.append(("trainer", training_attention(q0.device)))
    result = {"case": label, "shape": list(q0.shape), "mask": list(mask.shape), "runs": {}}
    for name, ctx in contexts:
        out, grad, err = _grad_run(q0, k0, v0, mask, g, ctx)
        if err is not None:
            result["runs"][name] = {"error": err}
            continue
        sel = (slice(None),) * 2 + (rows_to_compare,) if rows_to_compare is not None else (slice(None),)
        finite_ref = torch.isfinite(ref_grad[sel]) if ref_grad is not None else None
        gap = None
        if ref_grad is not None:
            d = (grad.float()[sel] - ref_grad[sel]).abs()
            d = d[finite_ref & torch.isfinite(d)]
            gap = float(d.max()) if d.numel() else None
        result["runs"][name] = {
            "nonfinite_out": int((~torch.isfinite(out)).sum()),
            "nonfinite_qgrad": int((~torch.isfinite(grad)).sum()),
            "qgrad_elems": grad.numel(),
            "max_abs_qgrad_gap_vs_fp32_math": gap,
            "max_abs_qgrad_ref": (float(ref_grad[sel][finite_ref].abs().max())
                                  if ref_grad is not None and bool(finite_ref.any()) else None),
        }
    return result


def probe_a(device, L: int) -> dict:
    import torch

    torch.manual_seed(0)
    B, H, D = 2, 4, 64
    q = torch.randn(B, H, L, D, device=device)
    k = torch.randn(B, H, L, D, device=device)
    v = torch.randn(B, H, L, D, device=device)
    q[..., 0] = 1.0
    k[..., 0] = -120.0 * math.sqrt(D)  # score -120 on every key: logsumexp ~ -120 + log(L) < -88.7
    mask = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    g = torch.randn(B, H, L, D, device=device)
    return _case(f"(a) pytorch#196678 sink rows, L={L}", q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, g)


def probe_b(device, L: int) -> dict:
    import torch

    torch.manual_seed(1)
    B, H, D = 4, 4, 64
    pads = [0, 64, L // 3, (5 * L) // 7][:B]  # L=704: 0, 64, 234, 502
    q, k, v = (torch.randn(B, H, L, D, device=device) for _ in range(3))
    idx = torch.arange(L, device=device)
    causal = idx[None, :] <= idx[:, None]
    mask = torch.stack([causal & (idx[None, :] >= p) for p in pads])[:, None]  # (B,1,L,L), rows i < p all False
    g = torch.randn(B, H, L, D, device=device)
    r = _case(f"(b) left padding {pads}, L={L}", q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, g,
              rows_to_compare=slice(max(pads), None))
    r["pads"] = pads
    return r


def probe_c(device, W: int = 4096, R: int = 2, H: int = 14, D: int = 64, layers: int = 28) -> list[dict]:
    """Peak memory over `layers` chained SDPA calls (forward, then backward) with a (R,1,W,W) bool
    mask (shared-prompt trees: dense, here plain causal) against is_causal=True."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from grpo.update.forward import training_attention

    if device.type != "cuda":
        return [{"case": "(c)", "skipped": "CUDA only"}]
    idx = torch.arange(W, device=device)
    mask = (idx[None, :] <= idx[:, None]).expand(R, 1, W, W).contiguous()
    mask_bytes = mask.numel() * mask.element_size()
    rows = []
    for label, ctx, use_mask in [("is_causal=True", contextlib.nullcontext(), False),
                                 ("bool mask, default backends", contextlib.nullcontext(), True),
                                 ("bool mask, trainer backends", training_attention(device), True)]:
        torch.manual_seed(2)
        x0 = torch.randn(R, H, W, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            t0 = time.perf_counter()
            with ctx:
                h = x0
                for _ in range(layers):
                    h = F.scaled_dot_product_attention(h, h, h, attn_mask=mask if use_mask else None,
                                                       is_causal=not use_mask)
                torch.cuda.synchronize()
                t_fwd = time.perf_counter() - t0
                after_fwd = torch.cuda.memory_allocated() - base
                peak_fwd = torch.cuda.max_memory_allocated() - base
                h.float().sum().backward()
            torch.cuda.synchronize()
            t_all = time.perf_counter() - t0
            rows.append({"case": f"(c) {label}", "saved_after_forward_MiB": after_fwd / 2**20,
                         "peak_forward_MiB": peak_fwd / 2**20,
                         "peak_with_backward_MiB": (torch.cuda.max_memory_allocated() - base) / 2**20,
                         "fwd_s": t_fwd, "fwd_bwd_s": t_all,
                         "nonfinite_grad": int((~torch.isfinite(x0.grad)).sum()),
                         "mask_MiB": mask_bytes / 2**20 if use_mask else 0.0})
        except RuntimeError as e:
            rows.append({"case": f"(c) {label}", "error": str(e).splitlines()[0][:200]})
        del x0
        h = None
        torch.cuda.empty_cache()
    return rows


def sdpa(out_path: str) -> int:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    # on the CPU the probes run small (CPU SDPA at L=704 in bf16 is slow on 2 cores): same code paths
    sizes_a, sizes_b = ([704, 768], [704, 640]) if device.type == "cuda" else ([192], [192])
    for L in sizes_a:
        results.append(probe_a(device, L))
    for L in sizes_b:
        results.append(probe_b(device, L))
    results.extend(probe_c(device))
    for r in results:
        if "runs" in r:
            print(r["case"], "q", r["shape"], "mask", r["mask"])
            for name, x in r["runs"].items():
                if "error" in x:
                    print(f"    {name:20} not run: {x['error']}")
                else:
                    gap = x["max_abs_qgrad_gap_vs_fp32_math"]
                    print(f"    {name:20} non-finite out {x['nonfinite_out']:>7}  q.grad {x['nonfinite_qgrad']:>7} "
                          f"of {x['qgrad_elems']}  max|q.grad - fp32 math| "
                          f"{'n/a' if gap is None else f'{gap:.3e}'} (|ref| max {x['max_abs_qgrad_ref']})")
        else:
            print(json.dumps(r))
    with open(out_path, "w") as f:
        json.dump({"device": str(device), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                   "results": results}, f, indent=1)
    return 0


KEYS = ["loss", "grad_norm", "sampler_diff", "sampler_kl", "kl", "entropy", "clip_frac", "guard/skipped_steps",
        "trained_completions", "step_s", "time/update_s", "time/generate_s"]


def summarize(run_dirs: list[str]) -> int:
    from grpo.log import read_metrics  # grpo: imported where used, as the probes above do

    rows = []
    for d in run_dirs:
        name = os.path.basename(d.rstrip("/"))
        row = {"run": name}
        try:
            steps = read_metrics(os.path.join(d, "metrics.jsonl"))  # null (a NaN loss, an inf grad_norm): NaN
        except OSError as e:
            row["error"] = f"no metrics.jsonl ({e.strerror})"
            rows.append(row)
            continue
        train = [s for s in steps if "loss" in s]
        for k in KEYS:
            row[k] = [s.get(k) for s in train]
        # a step that trained nothing (every group flat, skipped) logs its update statistics as NaN: unmeasured, not a NaN kernel
        nonfinite = [k for k in KEYS for s, v in zip(train, row[k]) if isinstance(v, float) and not math.isfinite(v)
                     and (s.get("grad_norm") or k in ("loss", "grad_norm"))]
        row["nonfinite"] = sorted(set(nonfinite))
        try:
            s = json.load(open(os.path.join(d, "summary.json")))
            for k in ("eval_before", "eval_after", "steps", "wall_s", "peak_memory_gb", "world_size"):
                row[k] = s.get(k)
        except OSError:
            row["error"] = "no summary.json"
        rows.append(row)

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if math.isfinite(v) else str(v)
        return str(v)

    print("| run | steps | loss | grad norm | sampler_diff | sampler_kl | kl | skipped | peak GB | wall s | s/step (last 3) | eval before -> after | non-finite |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "loss" not in r:
            print(f"| {r['run']} | {r.get('error')} |" + " |" * 11)
            continue
        ss = [x for x in r["step_s"] if x is not None][-3:]
        print(f"| {r['run']} | {fmt(r.get('steps'))} | {' '.join(fmt(x) for x in r['loss'])} | "
              f"{' '.join(fmt(x) for x in r['grad_norm'])} | {' '.join(fmt(x) for x in r['sampler_diff'])} | "
              f"{' '.join(fmt(x) for x in r['sampler_kl'])} | {' '.join(fmt(x) for x in r['kl'])} | "
              f"{fmt(r['guard/skipped_steps'][-1] if r['guard/skipped_steps'] else None)} | "
              f"{fmt(r.get('peak_memory_gb'))} | {fmt(r.get('wall_s'))} | "
              f"{fmt(sum(ss) / len(ss) if ss else None)} | {fmt(r.get('eval_before'))} -> {fmt(r.get('eval_after'))} | "
              f"{','.join(r['nonfinite']) or 'none'} |")
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "env":
        env()
        return 0
    if cmd == "sdpa":
        return sdpa(rest[0] if rest else "sdpa_probes.json")
    if cmd == "summarize":
        return summarize(rest)
    print(f"unknown command {cmd!r}\n{__doc__}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
