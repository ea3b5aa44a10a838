"""`python -m grpo.bench`: rollout throughput per backend, weight-sync cost, step-time breakdown.

Runs short trainings of the embedded default through each backend (for `remote` it starts a
`grpo.serve` server on this machine first), then times weight syncs of the same weights in buckets
of several sizes and one tensor per bucket (how TRL and OpenRLHF send them: one call each).
Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

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


@contextlib.contextmanager
def served(model_path: str, timeout_s: float = 300):
    """A local `grpo.serve` on `model_path` for the remote backend; yields its URL."""
    from grpo.rollout.remote import free_port

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "grpo.serve", "--model", model_path, "--port", str(port),
                             "--max-model-len", "256", "--memory-fraction", "0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"grpo.serve on {model_path} did not start") from None
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def tiny_model_path() -> str:
    from grpo.models import ensure_tiny_model
    from grpo.tasks import build_task

    cfg = compose(["run_dir=unused"])
    return ensure_tiny_model(cfg.model, cfg.task, build_task(cfg.task), cfg.rollout.max_new_tokens)


def backend_overrides(backend: str, url: str | None) -> list[str]:
    return [f"rollout={backend}"] + ([f"rollout.remote.urls=[{url}]"] if url else [])


def bench_backend(backend: str, steps: int, extra: list[str], url: str | None = None) -> dict:
    from grpo.train import train

    run_dir = tempfile.mkdtemp(prefix=f"bench-{backend}-")
    cfg = compose([*backend_overrides(backend, url), f"steps={steps}", "checkpoint_every=0", "logger.log_every=1000",
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


def bench_sync(backend_name: str, bucket_mb: list[float], repeats: int, url: str | None = None) -> list[dict]:
    """Seconds and MB/s to push the policy's weights into an engine, per bucket size; bucket 0
    means one tensor per bucket (how TRL and OpenRLHF send them: one call and transfer each)."""
    from grpo.models import load_model
    from grpo.parallel.base import bucket_tensors
    from grpo.rollout import build_rollout

    cfg = compose([*backend_overrides(backend_name, url), "run_dir=unused"])
    path = tiny_model_path()
    model, tok = load_model(path)
    rollout = build_rollout(cfg.rollout, model, tok, path, run_dir=tempfile.mkdtemp(prefix="bench-sync-"))
    named = list(model.named_parameters(remove_duplicate=False))
    total_mb = sum(p.numel() * p.element_size() for _, p in named) / 2**20
    results = []
    try:
        for mb in bucket_mb:
            times = []
            for r in range(repeats):
                t0 = time.perf_counter()
                size = 1 if mb == 0 else int(mb * 2**20)  # 1 byte: every tensor alone in its bucket
                rollout.update_weights(bucket_tensors(((n, p.detach()) for n, p in named), size), version=r)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            results.append({"backend": backend_name, "bucket_mb": mb or "per-tensor", "tensors": len(named),
                            "model_mb": total_mb, "sync_s": s, "mb_per_s": total_mb / s})
    finally:
        rollout.close()
    return results


def bench_trl(steps: int, ours: dict) -> dict:
    """TRL's GRPOTrainer on the same tiny model, task, batch (32 prompts x 16), completion length,
    learning rate and loss, generating with transformers on this CPU, as `rollout=hf` does."""
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"--vs trl needs TRL: `.venv/bin/pip install trl==1.16.0` ({e})") from e
    from grpo.tasks import build_task

    cfg = compose(["run_dir=unused"])
    path = tiny_model_path()
    task = build_task(cfg.task)
    data = Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in task.train])

    def exact_match(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.t0)

    a = cfg.algo
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=a.batch_size,
        num_generations=a.group_size, max_completion_length=cfg.rollout.max_new_tokens, learning_rate=a.lr,
        warmup_steps=a.warmup_steps, lr_scheduler_type="linear", max_steps=steps, beta=0.0, loss_type="grpo",
        temperature=cfg.rollout.temperature, use_cpu=True, bf16=False, report_to=[], logging_steps=1000,
        save_strategy="no", seed=0, max_grad_norm=a.max_grad_norm,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=exact_match, args=args,
                          train_dataset=data, processing_class=AutoTokenizer.from_pretrained(path), callbacks=[timer])
    trainer.train()
    trl_step = statistics.mean(timer.times[1:])
    import trl

    return {"trl_version": trl.__version__, "trl_step_s": trl_step, "grpo_step_s": ours["step_s"],
            "trl_over_grpo": trl_step / ours["step_s"], "steps_timed": len(timer.times) - 1}


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
    p.add_argument("--backends", default="hf,colocated,dedicated,remote")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results/bench.json")
    p.add_argument("--vs", choices=["trl"], help="also run TRL's GRPOTrainer on the same setup (needs trl)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every training run")
    args = p.parse_args()
    torch.manual_seed(0)

    backends = args.backends.split(",")
    steps, sync = [], []
    for b in backends:
        with served(tiny_model_path()) if b == "remote" else contextlib.nullcontext() as url:
            steps.append(bench_backend(b, args.steps, args.overrides, url))
            if b != "hf":  # hf shares the trainer's module: nothing is sent
                sync += bench_sync(b, [0, 0.25, 64], args.sync_repeats, url)
    report = {"steps": steps, "sync": sync, "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads()}
    if args.vs == "trl":
        hf = next((r for r in steps if r["backend"] == "hf"), None) or bench_backend("hf", args.steps, args.overrides)
        report["vs_trl"] = bench_trl(args.steps, hf)

    print("\nrollout and step time (tiny model, 512 completions per step)")
    print(table(steps, ["backend", "gen_tokens_per_s", "step_s", "generate_s", "score_s", "update_s", "sync_s"]))
    if sync:
        print("\nweight sync (median of repeats)")
        print(table(sync, ["backend", "bucket_mb", "tensors", "model_mb", "sync_s", "mb_per_s"]))
    if "vs_trl" in report:
        v = report["vs_trl"]
        print(f"\nTRL {v['trl_version']} GRPOTrainer: {v['trl_step_s']:.3f} s/step vs grpo (rollout=hf) "
              f"{v['grpo_step_s']:.3f} s/step: TRL takes {v['trl_over_grpo']:.2f}x as long")
    print(f"\npeak RSS {report['peak_rss_mb']:.0f} MB")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
