#!/usr/bin/env bash
# Throughput of a 2-run sweep on SLURM (both runs at once, one job each, `cpus_per_task` CPUs each)
# against the same two runs one after another on this machine (each with all its CPUs):
#
#   export SLURM_CONF=/tmp/grpo-slurm/slurm.conf     # slurm/dev-cluster.sh up
#   slurm/sweep-bench.sh [STEPS] [grpo.train overrides...]      # default: 60 steps of the default run
#
# Prints both wall times (start of the first process to the end of the last, start-up included) and
# the ratio of the sweep's throughput to the sequential one's; docs/slurm.md's numbers come from here.
# Nothing here is timed in a test: the machine's cores are shared and timings are noisy.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-60}
shift || true
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-/tmp/grpo-sweep-bench}
rm -rf "$OUT"
mkdir -p "$OUT"

t0=$(date +%s.%N)
for lr in 1e-3 2e-3; do
    "$PYTHON" -m grpo.train steps="$STEPS" algo.lr=$lr hydra.run.dir="$OUT/sequential-$lr" "$@" > "$OUT/sequential-$lr.log" 2>&1
done
t1=$(date +%s.%N)
"$PYTHON" -m grpo.train -m hydra/launcher=slurm algo.lr=1e-3,2e-3 steps="$STEPS" hydra.sweep.dir="$OUT/sweep" "$@" \
    > "$OUT/sweep.log" 2>&1
t2=$(date +%s.%N)

"$PYTHON" - "$OUT" "$t0" "$t1" "$t2" <<'EOF'
import json, statistics, sys
out, t0, t1, t2 = sys.argv[1], *map(float, sys.argv[2:])
def step_s(run):
    rows = [json.loads(line) for line in open(f"{out}/{run}/metrics.jsonl")]
    return statistics.median(r["step_s"] for r in rows if "step_s" in r)
seq, par = t1 - t0, t2 - t1
print(f"sequential: 2 runs one after another  {seq:7.1f} s wall, median s/step {step_s('sequential-1e-3'):.3f} and {step_s('sequential-2e-3'):.3f}")
print(f"sweep:      2 SLURM jobs at once       {par:7.1f} s wall, median s/step {step_s('sweep/0'):.3f} and {step_s('sweep/1'):.3f}")
print(f"sweep throughput / sequential throughput: {seq / par:.2f}x")
EOF
