"""`python -m grpo.bench`: rollout throughput per backend, weight-sync cost, step-time breakdown.

Runs short trainings of the embedded default through each backend, then times weight syncs of the
same weights bucketed vs. one tensor per call. Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time

import torch


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from grpo.config import register_configs

    register_configs()
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(conf, version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def bench_backend(backend: str, steps: int, extra: list[str]) -> dict:
    from grpo.train import train

    run_dir = tempfile.mkdtemp(prefix=f"bench-{backend}-")
    cfg = compose([f"rollout={backend}", f"steps={steps}", "checkpoint_every=0", "logger.log_every=1000",
                   "logger.sample_every=0", f"run_dir={run_dir}", *extra])
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "step_s" in r][1:]  # the first step carries the engine's warm-up
    mean = lambda k: statistics.mean(r[k] for r in rows)  # noqa: E731
    return {
        "backend": backend,
        "steps_timed": len(rows),
        "gen_tokens_per_s": mean("gen_tokens_per_s"),
        "step_s": mean("step_s"),
        "generate_s": mean("time/generate_s"),
        "score_s": mean("time/score_s"),
        "update_s": mean("time/update_s"),
        "sync_s": mean("time/sync_s"),
        "model_path": cfg.model.path if cfg.model.path != "tiny" else None,
    }


def bench_sync(backend_name: str, bucket_mb: list[float], repeats: int) -> list[dict]:
    """Seconds and MB/s to push the policy's weights into an engine, per bucket size; bucket 0
    means one tensor per call (how TRL and OpenRLHF send them)."""
    from grpo.models import ensure_tiny_model, load_model
    from grpo.parallel.base import bucket_tensors
    from grpo.rollout import build_rollout
    from grpo.tasks import build_task

    cfg = compose([f"rollout={backend_name}", "run_dir=unused"])
    path = ensure_tiny_model(cfg.model, cfg.task, build_task(cfg.task), cfg.rollout.max_new_tokens)
    model, tok = load_model(path)
    rollout = build_rollout(cfg.rollout, model, tok, path)
    named = list(model.named_parameters(remove_duplicate=False))
    total_mb = sum(p.numel() * p.element_size() for _, p in named) / 2**20
    results = []
    try:
        for mb in bucket_mb:
            times = []
            for r in range(repeats):
                t0 = time.perf_counter()
                if mb == 0:
                    for n, p in named:
                        rollout.update_weights([[(n, p.detach())]], version=r)
                else:
                    rollout.update_weights(bucket_tensors(((n, p.detach()) for n, p in named), int(mb * 2**20)), version=r)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            results.append({"backend": backend_name, "bucket_mb": mb or "per-tensor", "tensors": len(named),
                            "model_mb": total_mb, "sync_s": s, "mb_per_s": total_mb / s})
    finally:
        rollout.close()
    return results


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backends", default="hf,colocated")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results/bench.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every training run")
    args = p.parse_args()
    torch.manual_seed(0)

    backends = args.backends.split(",")
    steps = [bench_backend(b, args.steps, args.overrides) for b in backends]
    sync = [row for b in backends if b != "hf" for row in bench_sync(b, [0, 0.25, 64], args.sync_repeats)]
    report = {"steps": steps, "sync": sync, "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads()}

    print("\nrollout and step time (tiny model, 512 completions per step)")
    print(table(steps, ["backend", "gen_tokens_per_s", "step_s", "generate_s", "score_s", "update_s", "sync_s"]))
    if sync:
        print("\nweight sync (median of repeats)")
        print(table(sync, ["backend", "bucket_mb", "tensors", "model_mb", "sync_s", "mb_per_s"]))
    print(f"\npeak RSS {report['peak_rss_mb']:.0f} MB")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
