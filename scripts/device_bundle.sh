#!/usr/bin/env bash
# Builds .device-bundle/, the folder one device call carries (`carry: [".device-bundle"]`) for
# scripts/gpu_check.sh on the lent GPU, where nothing can be downloaded: the cp312 wheels of
# requirements/device-wheels.txt (SGLang and FlashInfer trimmed and recompressed into
# site.tar.xz by scripts/device_bundle.py, the rest as wheels) and the default model's
# tokenizer (the dummy-weight models there use it). A call carries at most 64 MiB, the working
# tree included: this prints the bytes per call and fails when they are over.
# One call, not two: everything fits beside the tree, and a second call would have to start
# within the 30 s the machine stays warm, or start (and pay for) a fresh one.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.device-bundle
CACHE=${PICRAG_DEVICE_WHEEL_CACHE:-.device-bundle-cache}  # downloads, kept between builds, not carried
LIMIT=$((64 * 1024 * 1024))
PY=${PYTHON:-.venv/bin/python}
# pip matches a manylinux tag exactly: the tags these wheels are built for (2_17 ... 2_35).
PLATFORMS=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p "$CACHE"
grep -v '^\s*#' requirements/device-wheels.txt | sed 's/#.*//; s/\s*$//' | grep . > "$CACHE/requirements.txt"
echo "[bundle] downloading $(wc -l < "$CACHE/requirements.txt") wheels for cp312 into $CACHE"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$CACHE" -r "$CACHE/requirements.txt" 2> >(grep -v "^WARNING: Location" >&2)
# Only the pinned versions travel (a cache kept across pin changes holds older ones).
mkdir -p "$CACHE/pinned"
rm -f "$CACHE"/pinned/*.whl
while IFS= read -r pin; do
  name=${pin%%==*}; version=${pin#*==}
  wheel=$(ls "$CACHE"/*.whl | grep -i -E "/${name//-/[-_]}-${version}-" | head -1)
  [ -n "$wheel" ] || { echo "[bundle] no wheel for $pin in $CACHE" >&2; exit 1; }
  ln -s "$(realpath "$wheel")" "$CACHE/pinned/"
done < "$CACHE/requirements.txt"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
"$PY" scripts/device_bundle.py pack "$CACHE/pinned" "$BUNDLE"
tokenizer_dir=$("$PY" -c "from picrag_core.model_store import ensure_model; print(ensure_model())" | tail -1)
# tokenizer.json is 3.4 MB, 0.6 MB in xz
tar -C "$tokenizer_dir" -cJf "$BUNDLE/tokenizer.tar.xz" \
  tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json

bundle_bytes=$(find "$BUNDLE" -type f -print0 | xargs -0 du -cb | awk '/total$/ {s += $1} END {print s}')
# What travels besides the carried folder: tracked files and untracked ones git does not ignore.
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s += $1} END {print s}')
call_bytes=$((bundle_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
echo "[bundle] $BUNDLE: $(mib "$bundle_bytes"); working tree: $(mib "$tree_bytes"); one call carries $(mib "$call_bytes") of $(mib "$LIMIT")"
if [ "$call_bytes" -gt "$LIMIT" ]; then
  echo "[bundle] over the 64 MiB a call carries by $(mib $((call_bytes - LIMIT)))" >&2
  exit 1
fi
