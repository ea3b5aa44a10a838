#!/usr/bin/env bash
# Issue 49 item 3, the last bundle call's command (after gpu_bundle_go.sh staged vLLM 0.26.0):
#   bash scripts/gpu_bundle_go.sh dist/gpu_bundle/call2 bash scripts/gpu_vllm_run.sh
# In order of value (attempt 3, 2026-12-04, passed 1-4 and the tier's colocated fp32, bf16, sleep and bf16 LoRA
# runs: docs/results/gpu_vllm.md), each step under its own timeout and skipped once BUDGET_S is spent:
#   1. the design-card command, python -m grpo.train parallel=zero3 rollout=colocated (tiny model in fp32, STEPS);
#      if it fails, again on vLLM's Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0), and the later steps on it;
#   2. the `gpu` tier's short runs that have never run with vLLM: colocated zero2 and zero3 in bf16, hf zero3, remote
#      against a grpo.serve as a test (the two-GPU ones skip themselves on one GPU);
#   3. grpo.verify of the card in bf16 (the parity rows judge the mean there since session 16: CPU only so far);
#   4. grpo.verify with the card's overrides (attempt 3: every row passed, sync 7.6e-6);
#   5. grpo.doctor's remote and weight-sync rows (attempt 3: both passed);
#   6. the card with CUDA graphs (attempt 3: 14 syncs at 8e-6 before the budget cut it); 7. the rest of the tier;
#   8. colocated with sleep mode under training; 9. vLLM alone (scripts/gpu_vllm_smoke.py: bf16 and fp32, eager and
#      CUDA graphs, sleep and wake; all passed in attempt 2); 10. the doctor's other rows.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_out}; SITE=${GPU_SITE:-/tmp/gpu_site}; WORK=${WORK:-/tmp/gpu_vllm_run}
BUDGET_S=${BUDGET_S:-400}; STEPS=${STEPS:-40}
rm -rf "$WORK"; mkdir -p "$WORK/logs" "$WORK/runs" "$WORK/smoke" /tmp/trainer_site
# without them (hydra, omegaconf, deepspeed, peft: not in the image) every step below fails: stop at once
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trainer_site "$SITE"/trainer_wheels/*.whl \
    || { echo "trainer wheels: install failed (the bundle needs --add dist/trainer_wheels)"; exit 3; }
# grpo's entry points, as make setup installs them: vLLM's engine process loads the grpo_gloo weight transfer from an
# installed vllm.general_plugins entry point only. The dist-info alone: the code stays the checkout's.
rm -rf /tmp/grpo_dist && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/grpo_dist . \
    && rm -rf /tmp/grpo_dist/grpo build || echo "grpo entry points: install failed"
export PYTHONPATH=$PYTHONPATH:/tmp/trainer_site:$PWD:/tmp/grpo_dist GRPO_CACHE=$SITE/grpo_cache PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
printf 'step\trc\tseconds\n' > "$OUT/steps.tsv"
python3 -c 'import transformers, deepspeed, hydra; from grpo.rollout import vllm_api; print("transformers", transformers.__version__, "deepspeed", deepspeed.__version__, "hydra", hydra.__version__, "api", vllm_api.installed())' 2>&1 | tail -3

pack() { tar -czf "$OUT/runs.tgz.tmp" -C "$WORK" . && mv "$OUT/runs.tgz.tmp" "$OUT/runs.tgz"; }
step() {  # step NAME LIMIT CMD...: its output in logs/NAME.log, its tail here
    local name=$1 limit=$2; shift 2
    if (( SECONDS + 30 > BUDGET_S )); then echo "== SKIP $name at ${SECONDS}s"; printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"; return; fi
    (( SECONDS + limit > BUDGET_S )) && limit=$(( BUDGET_S - SECONDS ))
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s, at ${SECONDS}s): $*"
    timeout -s ABRT -k 10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1; rc=$?  # ABRT: every Python in the group dumps its stacks
    tail -n 15 "$WORK/logs/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/steps.tsv"
    pack
}
failed() { awk -v n="$1" '$1 == n && $2 != "0" {f=1} END {exit !f}' "$OUT/steps.tsv"; }
CARD="parallel=zero3 rollout=colocated"
step card 150 python3 -m grpo.train $CARD steps=$STEPS run_dir="$WORK/runs/card"
if failed card; then
    step card_v1 150 env VLLM_USE_V2_MODEL_RUNNER=0 python3 -m grpo.train $CARD steps=$STEPS run_dir="$WORK/runs/card_v1"
    failed card_v1 || export VLLM_USE_V2_MODEL_RUNNER=0  # the later steps on the runner that worked
fi
# the tier without its doctor test (the doctor's rows are steps of their own); no -x: one failure stops no other test
TIER="python3 -m pytest -q -rfE --durations=0 -p no:cacheprovider -m gpu tests/test_gpu.py"
step gpu_tier_new 300 $TIER -k "zero2 or zero3 or remote"
step verify_bf16 150 python3 -m grpo.verify $CARD model.dtype=bfloat16
step verify 180 python3 -m grpo.verify $CARD
step doctor_remote 150 python3 -m grpo.doctor --only remote,weight-sync
step card_graphs 120 python3 -m grpo.train $CARD rollout.vllm.enforce_eager=false steps=20 run_dir="$WORK/runs/card_graphs"
step gpu_tier_rest 300 $TIER -k "not doctor and not zero2 and not zero3 and not remote"
step sleep 90 python3 -m grpo.train $CARD rollout.vllm.sleep=true steps=10 run_dir="$WORK/runs/sleep"
step smoke 180 env OUT="$WORK/smoke" python3 scripts/gpu_vllm_smoke.py
step doctor 150 python3 -m grpo.doctor --only versions,device,peak,all-reduce,hf,colocated,dedicated
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$WORK/logs/nvidia_end.txt" 2>&1; pack
echo "== done at ${SECONDS}s"
