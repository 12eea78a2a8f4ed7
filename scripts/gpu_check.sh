#!/usr/bin/env bash
# The GPU half of the link-step checks: the LegoLink / CacheBlend equivalence tests against a
# server on CUDA, whose default attention backend is picrag_flashinfer. Needs a machine where
# `make setup` installed sglang 0.5.23, flashinfer-python and sglang-kernel for its GPU.
# FlashInfer computes in fp16/bf16, not fp32: a logprob tolerance failure here means precision,
# a different greedy token or a failed start means a bug.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/picrag-gpu-check}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
export PICRAG_TEST_SERVER_ARGS="--device cuda --dtype float16"
.venv/bin/python -m pytest -q -p no:cacheprovider --junitxml "$out/junit.xml" \
    tests/test_attention_backend.py tests/test_sglang_seams.py \
    tests/test_legolink.py tests/test_cacheblend.py tests/test_chunk_cache.py 2>&1 | tee "$out/pytest.txt"
