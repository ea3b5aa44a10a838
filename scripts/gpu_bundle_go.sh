#!/usr/bin/env bash
# The last call of a GPU bundle (python -m grpo.gpu_bundle): stage this call's parts beside the earlier
# calls' (in /tmp/gpu_stage), check every checksum, unpack into /tmp/gpu_site and run the given command
# with the bundle's packages first on PYTHONPATH. Everything is logged to $OUT/go.log.
#
#   bash scripts/gpu_bundle_go.sh dist/gpu_bundle/call2 python scripts/gpu_vllm_smoke.py
#
# Exit 3: a part is missing or corrupt (the machine went back between the calls: start again from call 1).
set -uo pipefail
CARRY=$1; shift
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/go.log") 2>&1
STAGE=${GPU_STAGE:-/tmp/gpu_stage}; SITE=${GPU_SITE:-/tmp/gpu_site}
CARRY=$(cd "$CARRY" && pwd)
t0=$(date +%s)
mkdir -p "$STAGE" && cp "$CARRY"/part.* "$STAGE"/
(cd "$STAGE" && sha256sum -c "$CARRY/SHA256SUMS") || { echo "STAGE LOST: a part is missing or corrupt"; exit 3; }
if [ ! -d "$SITE/site" ]; then
  mkdir -p "$SITE"
  cat "$STAGE"/part.* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='data')" "$SITE" || exit 4
fi
echo "staged and unpacked in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$SITE/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The bundle leaves flashinfer out (grpo/gpu_bundle.py LEFT_OUT); vLLM 0.26's sampler imports it unless told not to.
[ -d "$SITE/site/flashinfer" ] || export VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1  # the machine reaches nothing outside
cp "$CARRY/manifest.json" "$OUT/" 2>/dev/null
python3 -m pip list --format=freeze > "$OUT/piplist.txt" 2>&1
python3 -m pip check > "$OUT/pipcheck.txt" 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
ldd --version 2>&1 | head -1   # the image's glibc: the bundle's wheels are manylinux_2_35 at most
timeout 120 python3 -c 'import torch, vllm, vllm._C_stable_libtorch; from vllm.vllm_flash_attn import flash_attn_interface as f; print("torch", torch.__version__, "vllm", vllm.__version__, "FA3", f.FA3_AVAILABLE, getattr(f, "FA3_UNAVAILABLE_REASON", None))'
echo "== $*"
"$@"
echo "rc=$? after $(( $(date +%s) - t0 )) s"
