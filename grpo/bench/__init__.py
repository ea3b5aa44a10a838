"""`python -m grpo.bench [COMMAND] [options]`: speed and memory of this codebase, one command per
benchmark, each printing its tables and writing a JSON report (`--out`, default
bench_results/COMMAND.json; the default `run`'s is bench_results/bench.json). Without a command:
`run`. `python -m grpo.bench COMMAND --help` lists a command's options.

Each command's code is its own module of this package: steps.py (run, with sync.py), asynchronous.py,
lora.py, shared_cores.py, warm_start.py, memory.py (update-memory, hf-scores), zero3.py (zero3-memory), zero3_head.py (zero3-head),
packing.py (update-packing), vs_trl.py (vs-trl), env_calls.py (env-calls), episodes.py (episodes), sequence.py
(sequence-memory), mfu.py (mfu); runs.py holds what their
trainings share and report.py their tables and JSON. This file is the dispatcher and imports no benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from grpo.cli import exit_on_user_error

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the config groups' options, read without grpo.config (torch)
COMMANDS = ("run", "async", "lora", "shared-cores", "warm-start", "update-memory", "hf-scores", "zero3-memory", "zero3-head", "update-packing",
            "vs-trl", "env-calls", "episodes", "sequence-memory", "mfu")
# the flags that chose a benchmark before the commands, and the command each is now
OLD_FLAGS = {"--async": "async", "--lora": "lora", "--shared-cores": "shared-cores", "--warm-start": "warm-start",
             "--update-memory": "update-memory", "--hf-scores": "hf-scores", "--zero3-memory": "zero3-memory",
             "--vs": "vs-trl"}


def csv(kind=str, what: str = "names", options: list[str] | None = None):
    """An argparse type: a comma-separated list ('' for none) of `kind`, each one of `options` when given;
    else a usage error naming the item and what to give (`--zero3-buckets abc` was a ValueError traceback,
    `--backends vlm` a Hydra error after the backends before it were timed)."""

    def parse(text: str) -> list:
        items = []
        for x in (x.strip() for x in text.split(",") if x.strip()):
            try:
                items.append(kind(x))
            except ValueError:
                noun = "a whole number" if kind is int else "a number"
                raise argparse.ArgumentTypeError(f"{x!r} is not {noun}: give {what}, comma-separated") from None
            if options is not None and x not in options:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(options)}: give {what}, comma-separated")
        return items

    parse.__name__ = f"{kind.__name__} list"
    return parse


def group_options(group: str) -> list[str]:
    """The options of a config group (`rollout`: colocated, dedicated, hf, remote): its YAML files under conf/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def run(args):
    from grpo.bench.steps import report_run  # lazy: a command imports its own deps

    return report_run(args.backends, args.steps, args.sync_repeats, args.parallel, args.zero3_buckets,
                      args.overrides)


def run_async(args):
    from grpo.bench.asynchronous import report_async  # lazy: a command imports its own deps

    return report_async(args.steps, args.learn_steps, args.engine_cores, args.overrides)


def run_lora(args):
    from grpo.bench.lora import report_lora  # lazy: a command imports its own deps

    return report_lora()


def run_shared_cores(args):
    from grpo.bench.shared_cores import report_shared_cores  # lazy: a command imports its own deps

    return report_shared_cores(args.steps, args.overrides)


def run_warm_start(args):
    from grpo.bench.warm_start import report_warm_start  # lazy: a command imports its own deps

    return report_warm_start(args.seeds, args.settings)


def run_update_memory(args):
    from grpo.bench.memory import report_update_memory  # lazy: a command imports its own deps

    return report_update_memory(args.layers)


def run_hf_scores(args):
    from grpo.bench.memory import report_hf_scores  # lazy: a command imports its own deps

    return report_hf_scores(args.layers)


def run_zero3_memory(args):
    from grpo.bench.zero3 import report_zero3_memory  # lazy: a command imports its own deps

    return report_zero3_memory(args.rows, args.tokens)


def run_zero3_head(args):
    from grpo.bench.zero3_head import report_zero3_head  # lazy: as above

    return report_zero3_head(args.tokens, args.chunk_mb)


def run_update_packing(args):
    from grpo.bench.packing import report_update_packing  # lazy: a command imports its own deps

    return report_update_packing(args.layers, args.prompts, args.group, args.repeats)


def run_vs_trl(args):
    from grpo.bench.vs_trl import report_trl  # lazy: a command imports its own deps

    return report_trl(args.steps, args.overrides)


def run_env_calls(args):
    from grpo.bench.env_calls import report_env_calls  # lazy: a command imports its own deps

    return report_env_calls(args.trajectories, args.step_ms, args.concurrency)


def run_episodes(args):
    from grpo.bench.episodes import report_episodes  # lazy: a command imports its own deps

    return report_episodes(args.steps, args.batch, args.latency_ms, args.settings, args.overrides, args.learn_steps,
                           args.learn_settings)


def run_sequence_memory(args):
    from grpo.bench.sequence import report_sequence_memory  # lazy: a command imports its own deps

    return report_sequence_memory(args.sizes, args.layers, args.tokens)


def run_mfu(args):
    from grpo.bench.mfu import report_mfu  # lazy: a command imports its own deps

    return report_mfu(args.workloads, args.steps, args.run_dir, args.overrides)


def at_least(low: int, why: str):
    """An argparse type: an int >= `low`, else a usage error saying `why` (a shorter run trained to the end
    and then failed on an empty mean)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}: {why}")
        return value

    parse.__name__ = "int"  # argparse names the type in its message for a non-number
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grpo.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, fn, text: str, steps: int | None = None, overrides: bool = False, out: str | None = None,
                untimed: int = 1):
        c = commands.add_parser(name, help=text, description=text)
        c.set_defaults(fn=fn)
        c.add_argument("--out", default=f"bench_results/{out or name}.json", help="the JSON report (default: %(default)s)")
        if steps is not None:
            untimed_steps = "the first step is" if untimed == 1 else "the first and the last steps are"
            c.add_argument("--steps", type=at_least(untimed + 1, f"{untimed_steps} not timed"), default=steps,
                           help=f"steps of each training run; {untimed_steps} not timed (default: %(default)s)")
        if overrides:
            c.add_argument("overrides", nargs="*", help="Hydra overrides applied to every training run")
        return c

    c = command("run", run, "rollout throughput and step time per backend, weight-sync cost, step time per parallel "
                "strategy, ZeRO-3's gather cost against bucket size (the default)", steps=12, overrides=True, out="bench")
    backends, strategies = group_options("rollout"), group_options("parallel")
    c.add_argument("--backends", type=csv(what="rollout backends", options=backends), default="hf,colocated,dedicated,remote",
                   help=f"backends to time, of {', '.join(backends)} ('' for none)")
    c.add_argument("--sync-repeats", type=int, default=5, help="weight syncs per bucket size (the median is kept)")
    c.add_argument("--parallel", type=csv(what="parallel strategies", options=strategies), default="single,ddp,zero2,zero3",
                   help=f"strategies to time, of {', '.join(strategies)} ('' for none)")
    c.add_argument("--zero3-buckets", type=csv(float, "sizes in MB"), default="16,64,256,1024",
                   help="ZeRO-3 gather bucket sizes in MB ('' for none)")

    c = command("async", run_async, "asynchronous rollouts: step time with algo.max_staleness=0, 1, 2 "
                "(rollout=dedicated, then remote), then k=0 against k=1 learning the default task", steps=12, overrides=True)
    c.add_argument("--learn-steps", type=int, default=300, help="steps of each learning run (0: none)")
    c.add_argument("--engine-cores", type=int, default=len(os.sched_getaffinity(0)) // 2,
                   help="CPUs reserved for the engine, the rest for the trainer (0: all shared); default half")

    command("lora", run_lora, "LoRA against full fine-tuning on smollm2-135m: step time, step memory, sync bytes and "
            "seconds into a colocated engine")
    command("shared-cores", run_shared_cores, "the default run's step time alone and beside a busy process, one "
            "thread per core against threads=auto", steps=12, overrides=True)

    c = command("warm-start", run_warm_start, "the tiny model's warm start: steps to its target for each of --seeds "
                "under each of --settings")
    c.add_argument("--seeds", type=csv(int, "whole numbers"), default="0,1,2,3,4,5,6,7",
                   help="model.tiny.seed values")
    c.add_argument("--settings", default=None, help="of default, avx2, 1-thread; default: default,avx2 where torch "
                   "runs AVX512 kernels, else default,1-thread")

    for name, fn, text in (("update-memory", run_update_memory, "the update's peak memory at a 152k vocabulary: the "
                            "completion's logits whole against the head in pieces"),
                           ("hf-scores", run_hf_scores, "the hf backend's generate memory at a 152k vocabulary: every "
                            "step's scores kept against the sampled tokens' logprobs recorded")):
        c = command(name, fn, text)
        c.add_argument("--layers", type=int, default=2, help="layers of SmolLM2's body (of 30; default: %(default)s)")

    c = command("zero3-memory", run_zero3_memory, "ZeRO-3's per-rank memory at load and in an update, "
                "whole-then-partitioned against zero.Init, with and without a reference")
    c.add_argument("--rows", type=int, default=4, help="rows of the update's batch per rank")
    c.add_argument("--tokens", type=int, default=32, help="prompt and completion tokens per row")

    c = command("zero3-head", run_zero3_head, "the LM head's pieces under ZeRO-3: logits kept for the backward "
                "against each piece recomputed in it (a frozen head: its gradient taken in the forward), peak memory and "
                "seconds, tied, untied and frozen heads")
    c.add_argument("--tokens", type=int, default=4096, help="positions per rank (default: %(default)s)")
    c.add_argument("--chunk-mb", type=float, default=32.0, help="fp32 logits a piece (default: %(default)s)")

    c = command("update-packing", run_update_packing, "the update phase padded against packed (algo.packing) on "
                "SmolLM2-135M with completions of 4-400 tokens: seconds, tokens per second, peak memory")
    c.add_argument("--layers", type=int, default=30, help="layers of SmolLM2-135M kept (of 30; default: %(default)s)")
    c.add_argument("--prompts", type=int, default=2, help="prompts in the batch (default: %(default)s)")
    c.add_argument("--group", type=int, default=8, help="completions per prompt (default: %(default)s)")
    c.add_argument("--repeats", type=int, default=1, help="times each mode runs, alternating (default: %(default)s)")

    command("vs-trl", run_vs_trl, "TRL's GRPOTrainer against rollout=hf on the same model, prompts, rewards, batch "
            "and loss; the overrides set up both (e.g. experiment=smollm2_arithmetic_cpu; needs trl)", steps=12,
            overrides=True)

    c = command("env-calls", run_env_calls, "one turn of episodes whose environment step takes --step-ms: the "
                "environments called one after another (env.max_concurrency=1) and concurrently")
    c.add_argument("--trajectories", type=int, default=512, help="episodes, 8 per prompt (default: %(default)s)")
    c.add_argument("--step-ms", type=float, default=50.0, help="each environment step's time (default: %(default)s)")
    c.add_argument("--concurrency", type=csv(int, "whole numbers"), default="1,32",
                   help="env.max_concurrency values (default: %(default)s)")

    c = command("episodes", run_episodes, "multi-turn training on long-tailed guess episodes with a tool latency, "
                "rollout=remote on two local servers: turn-synchronous, per trajectory, and per trajectory with "
                "partial rollouts (episodes/s, engine idle fraction, the trainer's wait)", steps=10, overrides=True, untimed=2)
    c.add_argument("--batch", type=int, default=128, help="episodes per step, 16 per prompt (default: %(default)s)")
    c.add_argument("--latency-ms", type=float, default=50.0, help="each environment step's tool latency (default: %(default)s)")
    c.add_argument("--settings", type=csv(), default="turns,trajectories,partial", help="which schedules (default: %(default)s)")
    c.add_argument("--learn-steps", type=int, default=0, help="then experiment=guess_tiny on remote for this many steps "
                   "per --learn-settings, its held-out solve rate before and after (default: %(default)s, none)")
    c.add_argument("--learn-settings", type=csv(), default="turns,partial",
                   help="the schedules that learn (default: %(default)s)")

    c = command("sequence-memory", run_sequence_memory, "one rank's peak memory in an update on one long sequence, "
                "its rows split across S ranks (parallel.sequence_parallel)")
    c.add_argument("--sizes", type=csv(int, "whole numbers"), default="1,2,4",
                   help="values of S, each a torchrun of S processes (default: %(default)s)")
    c.add_argument("--layers", type=int, default=4, help="layers of SmolLM2's body (of 30; default: %(default)s)")
    c.add_argument("--tokens", type=int, default=8192, help="completion tokens of the sequence (default: %(default)s)")

    c = command("mfu", run_mfu, "each phase's seconds, FLOPs, tokens/s and MFU against the measured matmul peak, for "
                "short trainings side by side (default run, SmolLM2) and any --run-dir", steps=6, overrides=True)
    c.add_argument("--workloads", type=csv(), default="default,smollm2", help="of default, smollm2 ('' for none; default: %(default)s)")
    c.add_argument("--run-dir", action="append", default=[], help="a finished run folder to report too (repeatable)")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    for flag, name in OLD_FLAGS.items():
        if flag in argv:
            p.error(f"{flag} is now a command: python -m grpo.bench {name} [options] (see python -m grpo.bench --help)")
    if argv and argv[0] not in COMMANDS and not argv[0].startswith(("-", "~", "+")) and "=" not in argv[0]:
        p.error(f"unknown command {argv[0]!r}: choose from {', '.join(COMMANDS)}")  # `rnu` was taken for an override
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]  # no command: the default benchmark, with the options given
    args = p.parse_args(argv)
    if getattr(args, "overrides", None):  # an override Hydra cannot apply fails here, before the first benchmark trains
        from grpo.config import compose_config  # loads torch: only for a command given overrides

        exit_on_user_error(compose_config, args.overrides)
    import torch  # torch: heavy; the dispatcher and --help load no torch

    from grpo.bench.report import publish, scratch  # loads torch (grpo.cpus): here, not at the top, for the same reason

    torch.manual_seed(0)
    with scratch():
        publish(args.out, *exit_on_user_error(args.fn, args))

