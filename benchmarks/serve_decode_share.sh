#!/bin/bash
# localinfer serve at three --decode-share values beside llama-server, all four up at once; each load goes to
# every server in turn, the order rotated each round (a shared host's slow minutes fall on all alike).
#
#   benchmarks/serve_decode_share.sh LLAMA_SERVER [MODEL]
#
# Environment: SHARES (default "0 0.05 0.1"), ROUNDS (2), and the scenario: CTX, C (concurrency) and LOAD
# (serve_load.py's flags); the defaults are serve_peers.py's shared-prefix scenario (8192 cells, concurrency 4,
# 16 requests of 1,300 tokens whose first 1,000 are shared, 128 out).  Prints one line per load; the JSON of
# each goes to OUT (default a temporary folder).
set -euo pipefail
LS=$(realpath "${1:?usage: serve_decode_share.sh LLAMA_SERVER [MODEL]}")
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.."
M=${2:-$(python -c "from localinfer.model.sources import resolve_model; print(resolve_model(None))")}
SHARES=(${SHARES:-0 0.05 0.1}); ROUNDS=${ROUNDS:-2}; CTX=${CTX:-8192}; C=${C:-4}
LOAD=${LOAD:-"--requests 16 --prompt-tokens 1300 --shared-prefix 1000 --output-tokens 128"}
pids=(); ports=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' EXIT
for i in "${!SHARES[@]}"; do
  port=$((18510 + i)); ports+=($port)
  python -m localinfer serve "$M" --port $port --parallel 8 --ctx $CTX -t 2 -fa on --max-queue 1024 \
    --decode-share "${SHARES[$i]}" 2>"$OUT/serve_$port.err" & pids+=($!)
done
"$LS" -m "$M" --host 127.0.0.1 --port 18599 -c $CTX -np 8 --kv-unified --no-webui -t 2 -tb 2 -fa on \
  >"$OUT/llama-server.err" 2>&1 & pids+=($!); ports+=(18599)
for port in "${ports[@]}"; do
  for _ in $(seq 400); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.25; done
  curl -sf http://127.0.0.1:$port/health >/dev/null ||
    { echo "error: the server on port $port did not start (logs in $OUT)" >&2; exit 1; }
done
n=${#ports[@]}
for rnd in $(seq "$ROUNDS"); do
  for k in $(seq 0 $((n - 1))); do
    idx=$(( (k + rnd) % n )); port=${ports[$idx]}
    name=$([ $port = 18599 ] && echo llama-server || echo "localinfer --decode-share ${SHARES[$idx]}")
    python benchmarks/serve_load.py --url http://127.0.0.1:$port/v1 --concurrency $C $LOAD \
      --seed $((rnd * 100 + C + 7000)) --out "$OUT/${port}_$rnd.json" >/dev/null 2>&1
    python - "$OUT/${port}_$rnd.json" "round $rnd  $name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
keys = ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms")
print(f"{sys.argv[2]}: ok {r['ok']}/{r['requests']},", ", ".join(f"{k} {r[k] or 0:.1f}" for k in keys))
PY
  done
done
