#!/usr/bin/env bash
# `kvgate serve --device cuda` end to end, once: start it, issue an admin token, a tenant and a key, and ask
# for chat completions in `fast` and `batch_invariant`, plain and streamed, over its TLS.
#
#   scripts/gpu_serve_check.sh OUT_DIR MODEL_DIR_OR_GGUF
#
# Runs with the python3 on PATH and the repository on PYTHONPATH (`python3 -m kvgate`); the server's data
# directory is a fresh temporary one. The server's log goes to OUT_DIR/serve.log. SERVE_S bounds the
# server's life (seconds; default 130).
set -uo pipefail
out=${1:?usage: scripts/gpu_serve_check.sh OUT_DIR MODEL_DIR_OR_GGUF}
model=${2:?usage: scripts/gpu_serve_check.sh OUT_DIR MODEL_DIR_OR_GGUF}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" KVGATE_DATA_DIR
KVGATE_DATA_DIR=$(mktemp -d)
port=${PORT:-8443}
url=https://127.0.0.1:$port
timeout "${SERVE_S:-130}" python3 -m kvgate serve --model "$model" --device "${DEVICE:-cuda}" --port "$port" \
  >"$out/serve.log" 2>&1 &
for _ in $(seq 1 120); do curl -sk "$url/readyz" >/dev/null 2>&1 && break; sleep 1; done
curl -sk "$url/readyz"; echo
ca=$KVGATE_DATA_DIR/tls/ca.pem
json() { python3 -c "import json, sys; print(json.load(sys.stdin)$1)"; }
admin=$(python3 -m kvgate admin bootstrap | tail -1)
tenant=$(curl -s --cacert "$ca" "$url/admin/v1/tenants" -H "Authorization: Bearer $admin" -d '{"name":"acme"}' \
  | json '["id"]')
key=$(curl -s --cacert "$ca" "$url/admin/v1/tenants/$tenant/keys" -H "Authorization: Bearer $admin" \
  -d '{"name":"ci"}' | json '["key"]')
served=$(curl -s --cacert "$ca" "$url/v1/models" -H "Authorization: Bearer $key" | json '["data"][0]["id"]')
echo "model: $served"
for mode in fast batch_invariant; do
  curl -s --cacert "$ca" "$url/v1/chat/completions" -H "Authorization: Bearer $key" \
    -H 'content-type: application/json' -d "{\"model\": \"$served\", \"max_tokens\": 24, \"determinism\": \"$mode\",
      \"messages\": [{\"role\": \"user\", \"content\": \"hello there\"}]}"
  echo
done
curl -s -N --cacert "$ca" "$url/v1/chat/completions" -H "Authorization: Bearer $key" \
  -H 'content-type: application/json' -d "{\"model\": \"$served\", \"max_tokens\": 8, \"stream\": true,
    \"messages\": [{\"role\": \"user\", \"content\": \"count\"}]}" | tail -4
kill %1 2>/dev/null
wait
tail -20 "$out/serve.log"
