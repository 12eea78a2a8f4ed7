#!/usr/bin/env bash
# Batch QA over the shared HotpotQA dev rows with their own passages, scored with EM/F1.
#   examples/batch_qa.sh [URL] [N]          (default http://127.0.0.1:8000, 5 questions)
# Answers go to $OUT (default answers.hotpotqa.jsonl); run it again and answered ids are skipped.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
URL="${1:-http://127.0.0.1:8000}"
N="${2:-5}"
QA="${QA_DIR:-$HERE/../../shared/data/qa}"
PICRAG="${PICRAG:-$HERE/../.venv/bin/picrag}"

# Only the supporting passages (2 a row) keep prompts short on a CPU; drop --supporting-only
# to give the model all 10 passages of each row, as the papers do.
"$PICRAG" ask --questions "$QA/hotpotqa.dev.jsonl" --limit "$N" --supporting-only \
  --url "$URL" --out "${OUT:-answers.hotpotqa.jsonl}"
