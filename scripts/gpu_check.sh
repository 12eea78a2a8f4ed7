#!/usr/bin/env bash
# picrag's CUDA path, checked in one device call on the lent GPU (an H200 whose image has
# python 3.12, torch 2.11, triton, transformers and nvcc, and no SGLang, FlashInfer or
# sglang-kernel; nothing can be downloaded there). Build the carried folder here first:
#     bash scripts/device_bundle.sh
# then, in one device call that carries it (carry: [".device-bundle"], timeout_s 540):
#     bash scripts/gpu_check.sh
# It installs the bundle into /tmp, runs scripts/gpu_check.py (exactness on 2-layer models of
# Llama-3.1-8B's and Qwen2.5-7B's shapes, then TTFT and throughput per policy at concurrency 1
# and 16 on the whole shapes with dummy weights, and stock SGLang on the same prompts), and
# leaves $OUT/gpu_check.json, gpu_check.md and gpu_check.log. It stops itself before the call's
# limit: no step starts that the deadline does not leave time for, and the driver is killed at
# the deadline. `--device cpu` rehearses the same on a tiny model with the .venv
# (tests/test_gpu_check_rehearsal.py).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
device=cuda
[ "${1:-}" = "--device" ] && device=${2:?--device cuda|cpu}
out="${OUT:-/tmp/picrag-gpu-check}"
# About 8 minutes: a device call is at most 600 s (run it with timeout_s 540).
budget_s=${PICRAG_GPU_CHECK_BUDGET_S:-480}
mkdir -p "$out"

if [ "$device" = cuda ]; then
  site=/tmp/picrag-site
  bundle=.device-bundle
  [ -f "$bundle/site.tar.xz" ] || { echo "gpu_check: no $bundle (run scripts/device_bundle.sh and carry it)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$bundle"/wheels/*.whl
  python3 - "$bundle" "$site" <<'EOF'
import sys, tarfile
from pathlib import Path
bundle, site = Path(sys.argv[1]), Path(sys.argv[2])
with tarfile.open(bundle / "site.tar.xz") as tar:
    tar.extractall(site, filter="data")
with tarfile.open(bundle / "tokenizer.tar.xz") as tar:
    tar.extractall(site / "picrag-tokenizer", filter="data")
# SGLang finds plugins by entry point: picrag runs from the tree (its pyproject pins python < 3.12
# for the CPU stack), so only its entry point is installed, as pip would write it.
info = site / "picrag-0.1.0.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: picrag\nVersion: 0.1.0\n")
(info / "entry_points.txt").write_text("[sglang.srt.plugins]\npicrag = sglang_patches.plugin:register\n")
EOF
  # The bundle first (over the image's copies), the tree, then picrag's pure-torch sgl_kernel:
  # the sglang-kernel wheel is built against torch 2.14 and does not load against 2.11.
  export PYTHONPATH="$site:$PWD:$PWD/sglang_patches/kernel_fallback${PYTHONPATH:+:$PYTHONPATH}"
  # SGLang's fused ops (RMSNorm, SiluAndMul, RoPE) on their torch paths, not sgl_kernel's or JIT builds.
  export SGLANG_FORCE_FUSED_OP_BACKEND=native
  # SGLang refuses to start on CUDA unless sglang-kernel's package metadata says >= 0.4.9.
  export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
  export MAX_JOBS=${MAX_JOBS:-16}  # FlashInfer's JIT builds its attention kernels with ninja
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # the H200 alone: one build per kernel, FA3 included
  PY=python3
  tokenizer="$site/picrag-tokenizer"
else
  PY=.venv/bin/python
  tokenizer=$("$PY" -c "from picrag_core.model_store import ensure_model; print(ensure_model())" | tail -1)
fi
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
left=$((budget_s - ($(date +%s) - started)))
echo "[gpu_check] installed in $(( $(date +%s) - started )) s; ${left} s left for the checks"
set +e
# Steps start only within --deadline-s; the kill 25 s later catches one that overran it.
timeout --kill-after=5 $((left - 10)) "$PY" scripts/gpu_check.py --device "$device" --out "$out" \
  --tokenizer "$tokenizer" --deadline-s $((left - 35)) "${@:3}" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
echo "[gpu_check] done in $(( $(date +%s) - started )) s, status $status"
exit "$status"
