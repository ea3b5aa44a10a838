#!/usr/bin/env bash
# The project's first GPU run (rollout=hf, no vLLM), in one command: install from the wheelhouse,
# versions, REVIEW Part 4's SDPA probes (a)-(c), the short-run matrix, grpo.verify, the doctor's
# hf rows, the gpu tier's hf tests and, if time is left, the default 600-step run. Results in
# docs/results/gpu_first_run.md.
#
# On the GPU machine (from the checkout, with the wheelhouse beside it as dist/wheels):
#   OUT=<folder> bash scripts/gpu_first_run.sh
# Built here with:
#   make wheelhouse WHEELHOUSE=dist/wheels PY_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64 PROFILE=trainer \
#     TORCH_VERSION=2.11.0 SKIP="datasets math-verify submitit hydra-submitit-launcher"
# Without a GPU (to check the script): no install (the checkout's .venv), the CUDA-only probe skipped,
# the matrix one run at a time, no 600-step run.
#
# Everything lands in $OUT as at most 8 files: log.txt (all output), steps.tsv (each step's exit
# status and seconds), sdpa_probes.json, matrix.md (the runs' table), runs.tgz (every run's
# metrics.jsonl, summary.json, config.yaml and log).
# Knobs: BUDGET_S (seconds after which optional steps are skipped; default 420), PAR (runs at a time),
# RUN_TIMEOUT (seconds per matrix run, default 75), TREES ("label=dir ...": code trees to run the
# matrix and grpo.verify from, default "head=."; e.g. "base=dist/base head=." with dist/base a
# `git archive` of another commit's grpo conf tests setup.cfg pyproject.toml), ONLY (a regex of
# matrix names), PARTS (default "probes matrix verify default"), GRPO_CACHE (default dist/grpo_cache:
# carry the tiny models' cache to skip their warm starts).

set -u -o pipefail
OUT=${OUT:-$PWD/gpu_first_run_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
BUDGET_S=${BUDGET_S:-420}
WORK=${WORK:-/tmp/gpu_first_run}
rm -rf "$WORK"; mkdir -p "$WORK/runs" "$WORK/logs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export GRPO_CACHE=${GRPO_CACHE:-$PWD/dist/grpo_cache}
printf 'step\trc\tseconds\n' > "$OUT/steps.tsv"

if nvidia-smi -L >/dev/null 2>&1; then GPU=1; else GPU=0; fi
PAR=${PAR:-$([ "$GPU" = 1 ] && echo 4 || echo 1)}
echo "== $(date -u +%FT%TZ) gpu=$GPU par=$PAR budget=${BUDGET_S}s commit $(git rev-parse HEAD 2>/dev/null || cat dist/commit.txt 2>/dev/null || echo "?") GRPO_CACHE=$GRPO_CACHE"

# step NAME TIMEOUT CMD...: run under `timeout`, log rc and seconds; skipped when the budget is spent
step() {
    local name=$1 limit=$2; shift 2
    if (( SECONDS + 20 > BUDGET_S )); then
        echo "== SKIP $name: ${SECONDS}s of ${BUDGET_S}s used"; printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"; return 0
    fi
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s, at ${SECONDS}s): $*"
    timeout -k 5 "$limit" "$@"; rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/steps.tsv"
    return 0
}

# --- install -------------------------------------------------------------------------------------
if [ "$GPU" = 1 ]; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    echo "machine python: $(command -v python3) $(python3 --version 2>&1); make: $(command -v make || echo none)"
    python3 -c 'import sys, torch; print("machine torch", torch.__version__, "prefix", sys.prefix, "base", sys.base_prefix)'
    # the project's own path: a venv with --system-site-packages over the machine's torch, from the wheelhouse
    step setup 180 make setup WHEELHOUSE=dist/wheels PYTHON=python3
    if ! .venv/bin/python -c 'import torch, grpo' 2>/dev/null; then
        # python3 there is itself a venv (/opt/torch/.venv): a venv made from it sees the base Python's
        # site-packages, not that venv's torch. Point the new venv at them, then `make setup` again
        # (an existing venv is used as it is).
        echo "== .venv sees no torch: adding the machine's torch folder to it with a .pth file"
        site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
        vsite=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "$site" > "$vsite/zz_machine_torch.pth"
        step setup-again 180 make setup WHEELHOUSE=dist/wheels PYTHON=python3
    fi
    PY=$PWD/.venv/bin/python
    $PY -m pip check 2>&1 | head -20
else
    PY=${PY:-$PWD/.venv/bin/python}
fi
$PY scripts/gpu_probes.py env

PARTS=${PARTS:-probes matrix verify default}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }

# --- probes (a), (b), (c) ------------------------------------------------------------------------
has probes && step probes 120 $PY scripts/gpu_probes.py sdpa "$OUT/sdpa_probes.json"

# --- the matrix: 4 steps of rollout=hf per configuration, per code tree ---------------------------
# TREES: "label=dir ..." (default the checkout, "head=."): each tree's grpo/ and conf/ run from its
# own folder (python -m takes the package from the working directory before the editable install).
TREES=${TREES:-head=.}
COMMON="rollout=hf steps=4 algo.batch_size=32 algo.group_size=8 algo.warmup_steps=0 eval_every=0 logger.log_every=1 logger.sample_every=0 checkpoint_every=0 export_model=false"
printf '%s\n' \
    "fp32 parallel=single" \
    "fp32_padded parallel=single algo.packing=false" \
    "fp32_shared parallel=single algo.shared_prompt=true" \
    "bf16 parallel=single model.dtype=bfloat16" \
    "bf16_padded parallel=single model.dtype=bfloat16 algo.packing=false" \
    "bf16_shared parallel=single model.dtype=bfloat16 algo.shared_prompt=true" \
    "bf16_lora8 parallel=single model.dtype=bfloat16 model.lora.rank=8" \
    "zero2_bf16 parallel=zero2 model.dtype=bfloat16" \
    "zero3_bf16 parallel=zero3 model.dtype=bfloat16" \
    "zero3_bf16_beta parallel=zero3 model.dtype=bfloat16 algo.beta=0.04 algo.zero_std_groups=keep" \
    "zero3_offload_bf16 parallel=zero3_offload model.dtype=bfloat16" \
    "zero3_fp32 parallel=zero3" > "$WORK/configs.txt"
[ -n "${ONLY:-}" ] && grep -wE "^($ONLY)" "$WORK/configs.txt" > "$WORK/c" && mv "$WORK/c" "$WORK/configs.txt"
: > "$WORK/matrix.txt"
for t in $TREES; do
    label=${t%%=*}; dir=$(cd "${t#*=}" && pwd)
    echo "tree $label: $dir, commit $(cat "$dir/commit.txt" 2>/dev/null || git -C "$dir" rev-parse HEAD 2>/dev/null)"
    # warm the tiny model's cache once per tree (a carried GRPO_CACHE makes this a load), so parallel runs do not race to build it
    has matrix && step "warm_$label" 120 bash -c "cd '$dir' && exec $PY -m grpo.train $COMMON steps=1 run_dir='$WORK/runs/warm_$label' > '$WORK/logs/warm_$label.log' 2>&1"
    has matrix && grep -E 'warm start|eval accuracy|Error' "$WORK/logs/warm_$label.log" | tail -3
    sed "s|^|$label $dir |" "$WORK/configs.txt" >> "$WORK/matrix.txt"
done
T_END=$(( $(date +%s) + BUDGET_S - SECONDS ))  # the budget's end, for the runs xargs starts (their SECONDS start at 0)
one_run() {  # LABEL DIR NAME OVERRIDES...
    local label=$1 dir=$2 name=$3; shift 3
    local t0=$SECONDS left=$(( T_END - $(date +%s) ))
    if (( left < 30 )); then echo "${label}_$name skipped: budget spent"; return 0; fi
    (cd "$dir" && timeout -k 5 $(( left - 10 < RUN_TIMEOUT ? left - 10 : RUN_TIMEOUT )) $PY -m grpo.train $COMMON "$@" run_dir="$WORK/runs/${label}_$name" > "$WORK/logs/${label}_$name.log" 2>&1)
    echo "${label}_$name rc=$? $((SECONDS - t0))s: $(grep -E 'eval accuracy|Error|error:' "$WORK/logs/${label}_$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"
}
RUN_TIMEOUT=${RUN_TIMEOUT:-75}
export -f one_run; export PY COMMON WORK T_END RUN_TIMEOUT
if has matrix && (( SECONDS + 60 < BUDGET_S )); then
    t0=$SECONDS
    xargs -P "$PAR" -L 1 bash -c 'one_run "$@"' _ < "$WORK/matrix.txt"
    printf 'matrix\t-\t%s\n' "$((SECONDS - t0))" >> "$OUT/steps.tsv"
fi
if has matrix; then
    $PY scripts/gpu_probes.py summarize $(awk -v w="$WORK" '{print w "/runs/" $1 "_" $3}' "$WORK/matrix.txt") > "$OUT/matrix.md" 2>&1
    cat "$OUT/matrix.md"
fi
for f in "$WORK"/logs/*.log; do
    n=$(grep -cE '\b(nan|NaN|inf)\b|Traceback' "$f"); [ "$n" -gt 0 ] && echo "!! $(basename "$f"): $n lines with nan/inf/Traceback: $(grep -E '\b(nan|NaN|inf)\b|Traceback|Error' "$f" | tail -3 | tr '\n' ' ' | cut -c1-400)"
done

# --- grpo.verify (fp32, bf16 per tree; zero3 bf16 on the first), the doctor's hf rows and the gpu
# tier's hf tests (on the last tree): side by side ---------------------------------------------------
if has verify && (( SECONDS + 60 < BUDGET_S )); then
    t0=$SECONDS
    first=""; last=""; pids=""
    for t in $TREES; do
        label=${t%%=*}; dir=$(cd "${t#*=}" && pwd); [ -z "$first" ] && first=$label:$dir; last=$label:$dir
        ( cd "$dir"; timeout -k 5 180 $PY -m grpo.verify rollout=hf > "$WORK/logs/verify_${label}_fp32.log" 2>&1; echo "verify_${label}_fp32 rc=$?" ) & pids="$pids $!"
        ( cd "$dir"; timeout -k 5 180 $PY -m grpo.verify rollout=hf model.dtype=bfloat16 > "$WORK/logs/verify_${label}_bf16.log" 2>&1; echo "verify_${label}_bf16 rc=$?" ) & pids="$pids $!"
    done
    ( cd "${first#*:}"; timeout -k 5 180 $PY -m grpo.verify rollout=hf parallel=zero3 model.dtype=bfloat16 > "$WORK/logs/verify_${first%%:*}_zero3_bf16.log" 2>&1; echo "verify_${first%%:*}_zero3_bf16 rc=$?" ) & pids="$pids $!"
    ( cd "${last#*:}"; timeout -k 5 180 $PY -m grpo.doctor --only versions,device,all-reduce,hf > "$WORK/logs/doctor_${last%%:*}.log" 2>&1; echo "doctor_${last%%:*} rc=$?" ) & pids="$pids $!"
    if [ "$GPU" = 1 ]; then
        ( cd "${last#*:}"; timeout -k 5 180 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "one_gpu and hf" > "$WORK/logs/pytest_gpu_hf_${last%%:*}.log" 2>&1; echo "pytest_gpu_hf_${last%%:*} rc=$?" ) & pids="$pids $!"
    fi
    wait $pids  # not a bare `wait`: bash >= 5.1 would wait for the >(tee) of this script's output too, forever
    printf 'verify+doctor+pytest\t-\t%s\n' "$((SECONDS - t0))" >> "$OUT/steps.tsv"
    for f in "$WORK"/logs/verify_*.log "$WORK"/logs/doctor_*.log "$WORK"/logs/pytest_*.log; do
        [ -f "$f" ] && { echo "---- $(basename "$f")"; grep -vE '^\[20|WARNING|warn' "$f" | tail -22; }
    done
fi

# --- the default run (600 steps, conf/config.yaml) alone, for held-out accuracy and s/step -----------
if has default && [ "$GPU" = 1 ] && (( SECONDS + 100 < BUDGET_S )); then
    last=""; for t in $TREES; do last=${t#*=}; done
    step default_600 $((BUDGET_S - SECONDS - 10)) bash -c "cd '$last' && exec $PY -m grpo.train rollout=hf export_model=false checkpoint_every=0 run_dir='$WORK/runs/default_600' > '$WORK/logs/default_600.log' 2>&1"
    grep -E 'eval|step +(100|300|600)/' "$WORK/logs/default_600.log" | tail -8
    $PY scripts/gpu_probes.py summarize "$WORK/runs/default_600" | tail -1 >> "$OUT/matrix.md"
fi

nvidia-smi --query-gpu=memory.used,temperature.gpu --format=csv 2>/dev/null
tar -czf "$OUT/runs.tgz" -C "$WORK" --exclude='*/model' --exclude='*/checkpoints' runs logs 2>/dev/null
ls -la "$OUT"
echo "== done in ${SECONDS}s"
