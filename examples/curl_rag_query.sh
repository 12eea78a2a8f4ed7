#!/usr/bin/env bash
# /rag/query with curl: two passages given inline, answered once whole and once streamed.
#   examples/curl_rag_query.sh [URL]        (default http://127.0.0.1:8000)
set -euo pipefail
URL="${1:-http://127.0.0.1:8000}"
DOCUMENTS='[
  {"title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."},
  {"title": "Big Ben", "text": "Big Ben is the nickname for the Great Bell of the clock at the Palace of Westminster in London."}
]'

curl -sS --fail-with-body "$URL/rag/query" -H 'content-type: application/json' -d "{
  \"question\": \"Where is the Eiffel Tower?\", \"documents\": $DOCUMENTS, \"max_tokens\": 16
}"
echo

# Server-sent events: {"type": "token", ...} lines, then {"type": "done", ...} with sources and timings.
curl -sS -N --fail-with-body "$URL/rag/query" -H 'content-type: application/json' -d "{
  \"question\": \"Where is Big Ben?\", \"documents\": $DOCUMENTS, \"max_tokens\": 16, \"stream\": true
}"
