"""`python -m grpo.bench`: rollout throughput per backend, weight-sync cost, step-time breakdown,
step time per parallel strategy, and ZeRO-3's gather cost against bucket size; `--async`: step time
with asynchronous rollouts (algo.max_staleness 0, 1, 2; dedicated and remote) and their learning side by side.

Runs short trainings of the embedded default through each backend (for `remote` it starts a
`grpo.serve` server on this machine first), then times weight syncs of the same weights in buckets
of several sizes and one tensor per bucket (how TRL and OpenRLHF send them: one call each).
Then trains with each strategy (`single` as one process, the others as 2 torchrun processes), and
gathers a SmolLM2-135M-shaped model from ZeRO-3 shards on 2 processes bucket by bucket, recording
seconds and the peak memory above the resting state for each bucket size.
Prints tables and writes JSON (`--out`).
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

from grpo.bench_memory import PeakRSS
from grpo.bench_report import table, write_report


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compose(overrides: list[str]):
    from grpo.config import compose_config

    return compose_config(overrides)


@contextlib.contextmanager
def served(model_path: str, timeout_s: float = 300, cpus: list[int] | None = None):
    """A local `grpo.serve` on `model_path` for the remote backend; yields its URL. With `cpus`, the
    server is pinned to them (its vLLM threads bound there), as `rollout.dedicated.cpu_cores` pins engines."""
    from grpo.rollout.dedicated import pinned_engine_env
    from grpo.rollout.servers import free_port

    port = free_port("127.0.0.1")
    env = {**os.environ, **pinned_engine_env(cpus)}
    proc = subprocess.Popen([sys.executable, "-m", "grpo.serve", "--model", model_path, "--port", str(port),
                             "--max-model-len", "256", "--memory-fraction", "0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
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


@contextlib.contextmanager
def pinned(cpus: list[int] | None):
    """This process on `cpus` (one torch thread each) for the block, then as before; None: unchanged."""
    from grpo.cpus import set_num_threads

    if not cpus:
        yield
        return
    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    set_num_threads(len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        set_num_threads(threads)


def tiny_model_path() -> str:
    from grpo.models import resolve_model_folder

    return resolve_model_folder(compose(["run_dir=unused"]))


def backend_overrides(backend: str, url: str | None) -> list[str]:
    return [f"rollout={backend}"] + ([f"rollout.remote.urls=[{url}]"] if url else [])


def metrics_rows(run_dir: str) -> list[dict]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in rows if "step_s" in r][1:]  # the first step carries warm-ups


def bench_backend(backend: str, steps: int, extra: list[str], url: str | None = None) -> dict:
    from grpo.train import train

    run_dir = tempfile.mkdtemp(prefix=f"bench-{backend}-")
    cfg = compose([*backend_overrides(backend, url), f"steps={steps}", "checkpoint_every=0", "logger.log_every=1000",
                   "logger.sample_every=0", f"run_dir={run_dir}", *extra])
    train(cfg)
    rows = metrics_rows(run_dir)
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


def bench_async(steps: int, learn_steps: int, engine_cores: int, extra: list[str]) -> tuple[list[dict], list[dict]]:
    """algo.max_staleness k = 0, 1, 2 with rollout=dedicated, then with rollout=remote (a local
    `grpo.serve`): the same model, task and batch, one after another in this process (each starts its
    own engine), timed over the steps after the first. With `engine_cores` > 0 the engine gets the last
    that many CPUs and the trainer the rest (`rollout.dedicated.cpu_cores`; for remote the server and
    this process are pinned the same way), as reserved GPUs would be. Then the default task learned
    with k = 0 and k = 1 through rollout=dedicated for the same steps (0: no learning run)."""
    from grpo.rollout.dedicated import split_cpus
    from grpo.train import train

    # k = 0 is the synchronous loop exactly; k >= 1 its stale batches clipped around the sampler
    # (algo.trust_region=auto); the overrides may change both
    common = ["checkpoint_every=0", "logger.log_every=1000", "logger.sample_every=0", "export_model=false", *extra]
    dedicated = ["rollout=dedicated", f"rollout.dedicated.cpu_cores={engine_cores}"]
    training_cpus, engine_cpus = split_cpus(sorted(os.sched_getaffinity(0)), engine_cores) if engine_cores else (None, None)
    timing, learning = [], []
    for backend in ("dedicated", "remote"):
        with served(tiny_model_path(), cpus=engine_cpus) if backend == "remote" else contextlib.nullcontext() as url:
            for k in (0, 1, 2):
                run_dir = tempfile.mkdtemp(prefix=f"bench-async-{backend}{k}-")
                overrides = dedicated if backend == "dedicated" else backend_overrides("remote", url)
                t0 = time.perf_counter()
                with pinned(training_cpus if backend == "remote" else None):
                    train(compose([*common, *overrides, f"algo.max_staleness={k}", f"steps={steps}", f"run_dir={run_dir}"]))
                rows = metrics_rows(run_dir)
                mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
                timing.append({"backend": backend, "max_staleness": k, "steps_timed": len(rows), "step_s": mean("step_s"),
                               "wait_for_data_s": mean("time/wait_for_data_s"), "score_s": mean("time/score_s"),
                               "update_s": mean("time/update_s"), "sync_s": mean("time/sync_s"),
                               "engine_wait_s": mean("time/engine_wait_s"), "staleness": mean("async/staleness_mean"),
                               "sampler_kl": mean("sampler_kl"), "wall_s": time.perf_counter() - t0})
    for row in timing:
        row["speedup"] = next(r["step_s"] for r in timing if r["backend"] == row["backend"]) / row["step_s"]
    for k in (0, 1) if learn_steps else ():
        run_dir = tempfile.mkdtemp(prefix=f"bench-async-learn{k}-")
        summary = train(compose([*common, *dedicated, f"algo.max_staleness={k}", f"steps={learn_steps}", f"run_dir={run_dir}"]))
        learning.append({"max_staleness": k, "steps": learn_steps, "eval_before": summary["eval_before"],
                         "eval_after": summary["eval_after"], "eval_gain": summary["eval_gain"], "wall_s": summary["wall_s"]})
    return timing, learning


def bench_sync(backend_name: str, bucket_mb: list[float], repeats: int, url: str | None = None) -> list[dict]:
    """Seconds and MB/s to push the policy's weights into an engine, per bucket size; bucket 0
    means one tensor per bucket (how TRL and OpenRLHF send them: one call and transfer each)."""
    from grpo.models import load_model
    from grpo.weights import group_by_size
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
                rollout.update_weights(group_by_size(((n, p.detach()) for n, p in named), size), version=r)
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            results.append({"backend": backend_name, "bucket_mb": mb or "per-tensor", "tensors": len(named),
                            "model_mb": total_mb, "sync_s": s, "mb_per_s": total_mb / s})
    finally:
        rollout.close()
    return results


def bench_parallel(strategy: str, steps: int, extra: list[str], procs: int = 2) -> dict:
    """A short `rollout=hf` training under `strategy`: one process for single, else `procs` ranks."""
    run_dir = tempfile.mkdtemp(prefix=f"bench-{strategy}-")
    n = 1 if strategy == "single" else procs
    launch = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              "--nproc_per_node", str(n)]
    cmd = [*launch, "-m", "grpo.train", f"parallel={strategy}", "rollout=hf", f"steps={steps}", "checkpoint_every=0",
           "export_model=false", "logger.log_every=1000", "logger.sample_every=0", f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"parallel={strategy} failed:\n{out.stderr[-3000:]}")
    rows = metrics_rows(run_dir)
    mean = lambda k: statistics.mean(r[k] for r in rows)  # noqa: E731
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    return {"strategy": strategy, "procs": n, "steps_timed": len(rows), "step_s": mean("step_s"),
            "threads": summary.get("threads_per_process"),
            "generate_s": mean("time/generate_s"), "update_s": mean("time/update_s"), "sync_s": mean("time/sync_s")}


def bench_shared_cores(steps: int, extra: list[str]) -> list[dict]:
    """Step time of the default run (one process) alone and beside one busy single-threaded process,
    with a thread per core (torch's default, what runs did before `threads=auto`) and with
    `threads=auto` (grpo/cpus.py). The ratio to the same setting alone is the slowdown a shared
    login node or CI runner causes."""
    cores = len(os.sched_getaffinity(0))
    rows, alone = [], {}
    for busy in (False, True):
        for setting in (str(cores), "auto"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                time.sleep(1.0 if busy else 0)
                r = bench_parallel("single", steps, [f"threads={setting}", *extra])
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            label = "auto" if setting == "auto" else f"{setting} (one per core)"
            if not busy:
                alone[setting] = r["step_s"]
            rows.append({"threads": label, "beside": "one busy process" if busy else "nothing", "step_s": r["step_s"],
                         "threads_used": r["threads"], "vs_alone": r["step_s"] / alone[setting]})
    return rows


def lora_worker(mode: str, out: str, rows: int = 8, prompt: int = 64, completion: int = 64, steps: int = 3) -> None:
    """`model=smollm2-135m`, full fine-tuning (mode `full`) or a rank-16 LoRA adapter (`lora`), in its
    own process: the median time and the peak memory (above the resting state after loading) of a
    training step (forward + backward of the policy loss on rows x (prompt + completion) tokens, then
    AdamW), then the sync into a colocated vLLM engine: the bytes sent, `update_weights`' seconds,
    and the first generation after it (where vLLM loads an adapter)."""
    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.dist import DistInfo
    from grpo.models import build_policy
    from grpo.parallel.single import SingleStrategy
    from grpo.rollout import Sampling, build_rollout
    from grpo.rollout.base import Rollouts
    from grpo.update import collate, forward_logprobs

    cfg = compose(["model=smollm2-135m", "rollout=colocated", "run_dir=unused", "rollout.vllm.max_model_len=256",
                   *(["model.lora.rank=16", "model.lora.alpha=32"] if mode == "lora" else [])])
    model, tok, path = build_policy(cfg, DistInfo(), log=lambda *_: None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (prompt,), generator=g).tolist() for _ in range(rows)]
    done = [torch.randint(100, 40000, (completion,), generator=g).tolist() for _ in range(rows)]
    batch = collate(prompts, Rollouts(done, [[0.0] * completion] * rows, ["length"] * rows, 0), torch.ones(rows),
                    tok.pad_token_id, False)
    strategy = SingleStrategy(cfg.parallel, model, OmegaConf.structured(AlgoConfig(lr=1e-5, warmup_steps=0)), 100)
    times = []
    with PeakRSS() as mem:
        for _ in range(steps):
            t0 = time.perf_counter()
            logp, _ = forward_logprobs(strategy.model, batch, 1.0)
            strategy.backward(-logp.mean())
            strategy.step()
            times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as run_dir:
        rollout = build_rollout(cfg.rollout, strategy.model, tok, path, run_dir=run_dir)
        nbytes = sum(t.numel() * t.element_size() for b in strategy.weight_buckets(64 * 2**20) for _, t in b)
        syncs, firsts = [], []
        for version in range(1, 4):
            t0 = time.perf_counter()
            rollout.update_weights(strategy.weight_buckets(64 * 2**20), version=version)
            t1 = time.perf_counter()
            rollout.generate([prompts[0]], 1, Sampling(max_new_tokens=1, temperature=0.0))
            syncs.append(t1 - t0)
            firsts.append(time.perf_counter() - t1)
        rollout.close()
    with open(out, "w") as f:
        json.dump({"mode": mode, "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                   "step_s": sorted(times)[len(times) // 2], "step_peak_above_rest_mb": mem.peak_above_mb,
                   "sync_mb": nbytes / 2**20, "sync_s": sorted(syncs)[1], "first_generate_after_sync_s": sorted(firsts)[1]}, f)


def bench_lora() -> list[dict]:
    rows = []
    for mode in ("full", "lora"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, "-m", "grpo.bench", "--lora-worker", mode, f.name], check=True)
            rows.append(json.load(open(f.name)))
    return rows


def zero3_sync_worker(bucket_mbs: list[float], out: str) -> None:
    """Under torchrun: ZeRO-3 shards of a SmolLM2-135M-shaped model (random weights) on each rank;
    for each bucket size, gather the full weights bucket by bucket and pack each bucket into one
    contiguous buffer, as the grpo_gloo transport does before sending it."""
    import gc

    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo import dist
    from grpo.config import AlgoConfig, ParallelConfig
    from grpo.parallel.zero import Zero3Strategy

    dist.init_distributed(dist.dist_info())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    largest_mb = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    strategy = Zero3Strategy(OmegaConf.structured(ParallelConfig(strategy="zero3")), model,
                             OmegaConf.structured(AlgoConfig()), total_steps=1)
    del model

    def gather_all(bucket_bytes: int) -> None:
        for bucket in strategy.weight_buckets(bucket_bytes):
            flat = torch.cat([t.reshape(-1) for _, t in bucket])
            del flat

    gather_all(int(min(bucket_mbs) * 2**20))  # warm-up: first-touch pages and DeepSpeed's buffers
    results = []
    for mb in sorted(bucket_mbs):
        gc.collect()
        dist.barrier()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            gather_all(int(mb * 2**20))
            seconds = time.perf_counter() - t0
        results.append({"bucket_mb": mb, "gather_s": seconds, "mb_per_s": model_mb / seconds,
                        "peak_above_rest_mb": mem.peak_above_mb, "model_mb": model_mb, "largest_tensor_mb": largest_mb})
    if dist.rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.shutdown()


def bench_zero3_sync(bucket_mbs: list[float]) -> list[dict]:
    out = os.path.join(tempfile.mkdtemp(prefix="bench-zero3-sync-"), "sync.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "grpo.bench",
           "--zero3-sync-worker", out, "--zero3-buckets", ",".join(map(str, bucket_mbs))]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"ZeRO-3 sync bench failed:\n{res.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def bench_trl(steps: int, ours: dict) -> dict:
    """TRL's GRPOTrainer on the same tiny model, task, batch (32 prompts x 16), completion length,
    learning rate and loss, generating with transformers on this CPU, as `rollout=hf` does."""
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"--vs trl needs TRL: `.venv/bin/pip install trl==1.16.0` ({e})") from e
    from grpo.rewards.exact_match import exact_match as grpo_exact_match
    from grpo.tasks import build_task
    from grpo.tasks.base import Sample

    cfg = compose(["run_dir=unused"])
    path = tiny_model_path()
    task = build_task(cfg.task)
    data = Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in task.train])

    def exact_match(completions, answer, **_):  # TRL's reward signature around this codebase's reward
        return grpo_exact_match(completions, [Sample(prompt="", answer=a) for a in answer])

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backends", default="hf,colocated,dedicated,remote")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results/bench.json")
    p.add_argument("--parallel", default="single,ddp,zero2,zero3", help="strategies to time ('' for none)")
    p.add_argument("--zero3-buckets", default="16,64,256,1024", help="ZeRO-3 gather bucket sizes in MB ('' for none)")
    p.add_argument("--zero3-sync-worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--update-memory", action="store_true", help="only the update's peak memory at a 152k "
                   "vocabulary: the completion's logits whole against the head in pieces (grpo/bench_memory.py)")
    p.add_argument("--hf-scores", action="store_true", help="only the hf backend's generate memory at a 152k "
                   "vocabulary: every step's scores kept against the sampled tokens' logprobs recorded")
    p.add_argument("--layers", type=int, default=2, help="--update-memory, --hf-scores: layers of SmolLM2's body")
    p.add_argument("--lora", action="store_true", help="only LoRA against full fine-tuning on smollm2-135m: "
                   "step time, step memory, sync bytes and seconds into a colocated engine")
    p.add_argument("--lora-worker", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--shared-cores", action="store_true", help="only the step time alone and beside a busy process, "
                   "one thread per core against threads=auto")
    p.add_argument("--async", dest="async_", action="store_true", help="only asynchronous rollouts: step time "
                   "with algo.max_staleness=0, 1, 2 (rollout=dedicated, then remote), then k=0 against k=1 learning the default task")
    p.add_argument("--learn-steps", type=int, default=300, help="--async: steps of each learning run (0: none)")
    p.add_argument("--engine-cores", type=int, default=len(os.sched_getaffinity(0)) // 2,
                   help="--async: CPUs reserved for the engine, the rest for the trainer (0: all shared); default half")
    p.add_argument("--zero3-memory", action="store_true", help="only ZeRO-3's per-rank memory at load and in an "
                   "update, whole-then-partitioned against zero.Init, with and without a reference (grpo/bench_zero3.py)")
    p.add_argument("--warm-start", action="store_true", help="only the tiny model's warm start: steps to its "
                   "target for each of --seeds under each of --settings (grpo/bench_warm_start.py)")
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="--warm-start: model.tiny.seed values")
    p.add_argument("--settings", default=None, help="--warm-start: of default, avx2, 1-thread; "
                   "default: default,avx2 where torch runs AVX512 kernels, else default,1-thread")
    p.add_argument("--vs", choices=["trl"], help="also run TRL's GRPOTrainer on the same setup (needs trl)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every training run")
    args = p.parse_args()
    torch.manual_seed(0)
    zero3_buckets = [float(b) for b in args.zero3_buckets.split(",") if b]
    if args.zero3_sync_worker:
        return zero3_sync_worker(zero3_buckets, args.zero3_sync_worker)

    if args.zero3_memory:
        from grpo.bench_zero3 import report_zero3_memory

        return report_zero3_memory(args.out)
    if args.warm_start:
        from grpo.bench_warm_start import report_warm_start

        return report_warm_start([int(x) for x in args.seeds.split(",")], args.settings, args.out)
    if args.lora_worker:
        return lora_worker(*args.lora_worker)
    if args.lora:
        rows = bench_lora()
        print("\nsmollm2-135m: full fine-tuning vs LoRA rank 16 (all 7 projections); step on 8 x (64 + 64) tokens, "
              "sync into a colocated vLLM engine (median of 3)")
        print(table(rows, ["mode", "trainable_params", "step_s", "step_peak_above_rest_mb", "sync_mb", "sync_s",
                           "first_generate_after_sync_s"]))
        write_report(args.out, {"lora": rows})
        return
    if args.update_memory:
        from grpo.bench_memory import bench_update_memory

        rows = bench_update_memory(args.layers)
        print(f"\nforward + backward of the policy loss, SmolLM2-135M's body ({args.layers} layers) with a 152k vocabulary, "
              "one micro-batch of 8192 completion tokens: 16 x (64 prompt + 512 completion)")
        print(table(rows, ["mode", "peak_above_rest_mb", "logit_side_mb", "vs_logits", "seconds", "logp_diff",
                           "head_grad_rel_diff"]))
        write_report(args.out, {"update_memory": rows})
        return
    if args.hf_scores:
        from grpo.bench_memory import bench_hf_scores

        rows = bench_hf_scores(args.layers)
        print(f"\nhf generate, SmolLM2-135M's body ({args.layers} layers) with a 152k vocabulary, 32 rows x 128 new tokens")
        print(table(rows, ["mode", "peak_above_rest_mb", "vs_output_scores", "seconds", "logp_sum"]))
        write_report(args.out, {"hf_scores": rows})
        return
    if args.shared_cores:
        rows = bench_shared_cores(args.steps, args.overrides)
        print("\nstep time of the default run alone and beside one busy process (rollout=hf, parallel=single)")
        print(table(rows, ["threads", "beside", "threads_used", "step_s", "vs_alone"]))
        write_report(args.out, {"shared_cores": rows})
        return

    if args.async_:
        timing, learning = bench_async(args.steps, args.learn_steps, args.engine_cores, args.overrides)
        print(f"\nasynchronous rollouts, engine on {args.engine_cores or 'all shared'} CPU(s) (means over the steps after the first)")
        print(table(timing, ["backend", "max_staleness", "step_s", "speedup", "wait_for_data_s", "score_s", "update_s", "sync_s",
                             "engine_wait_s", "staleness", "sampler_kl", "wall_s"]))
        if learning:
            print("\nlearning the default task, the same steps")
            print(table(learning, ["max_staleness", "steps", "eval_before", "eval_after", "eval_gain", "wall_s"]))
        write_report(args.out, {"async": timing, "async_learning": learning})
        return

    backends = [b for b in args.backends.split(",") if b]
    steps, sync = [], []
    for b in backends:
        with served(tiny_model_path()) if b == "remote" else contextlib.nullcontext() as url:
            steps.append(bench_backend(b, args.steps, args.overrides, url))
            if b != "hf":  # hf shares the trainer's module: nothing is sent
                sync += bench_sync(b, [0, 0.25, 64], args.sync_repeats, url)
    parallel = [bench_parallel(s, args.steps, args.overrides) for s in args.parallel.split(",") if s]
    zero3 = bench_zero3_sync(zero3_buckets) if zero3_buckets else []
    report = {"steps": steps, "sync": sync, "parallel": parallel, "zero3_sync": zero3, "peak_rss_mb": peak_rss_mb(),
              "threads": torch.get_num_threads()}
    if args.vs == "trl":
        hf = next((r for r in steps if r["backend"] == "hf"), None) or bench_backend("hf", args.steps, args.overrides)
        report["vs_trl"] = bench_trl(args.steps, hf)

    if steps:
        print("\nrollout and step time (tiny model, 512 completions per step)")
        print(table(steps, ["backend", "gen_tokens_per_s", "step_s", "generate_s", "score_s", "update_s", "sync_s"]))
    if sync:
        print("\nweight sync (median of repeats)")
        print(table(sync, ["backend", "bucket_mb", "tensors", "model_mb", "sync_s", "mb_per_s"]))
    if parallel:
        print("\nstep time per strategy (rollout=hf; single is 1 process, the others 2)")
        print(table(parallel, ["strategy", "procs", "step_s", "generate_s", "update_s", "sync_s"]))
    if zero3:
        print(f"\nZeRO-3 gather of a {zero3[0]['model_mb']:.0f} MB model on 2 ranks, per bucket size (rank 0; "
              f"largest tensor {zero3[0]['largest_tensor_mb']:.0f} MB)")
        print(table(zero3, ["bucket_mb", "gather_s", "mb_per_s", "peak_above_rest_mb"]))
    if "vs_trl" in report:
        v = report["vs_trl"]
        print(f"\nTRL {v['trl_version']} GRPOTrainer: {v['trl_step_s']:.3f} s/step vs grpo (rollout=hf) "
              f"{v['grpo_step_s']:.3f} s/step: TRL takes {v['trl_over_grpo']:.2f}x as long")
    print(f"\npeak RSS {report['peak_rss_mb']:.0f} MB")
    write_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
