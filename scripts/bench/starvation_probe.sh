#!/usr/bin/env bash
# Starvation probe: does a long prompt admitted into a busy decode batch make progress?
#
#   scripts/bench/starvation_probe.sh [ARM]      # ARM: policy name or spec path (baseline)
#
# Starts `fairtick serve` on 127.0.0.1 with the arm's policy, starts STREAMS long decode
# streams (curl), admits one ~PROMPT_TOKENS-token prompt after ADMIT_AFTER_S seconds, then
# samples /metrics every INTERVAL_S seconds and prints one row per sample: seconds since the
# streams started, prefill chunks, prefill grants (beside decoding streams), mixed steps,
# decode steps, and whether the prompt has its first token. Under `baseline` the chunk count
# stays flat while decode steps climb: the defect. The server and every curl are stopped on
# every exit path; every wait is bounded.
#
# Environment (defaults): PORT (a free port), MODEL (built-in model), PARALLEL (STREAMS+1),
# CHUNK (512), SAMPLES (12), INTERVAL_S (5), PROMPT_TOKENS (10000), STREAMS (4),
# STREAM_TOKENS (20000), ADMIT_AFTER_S (3), EXTRA_FLAGS (more serve flags, e.g. policy
# parameters: EXTRA_FLAGS='--grant-interval 4'), PYTHON (.venv/bin/python), TRACE_PNG (if set,
# the server's trace is drawn there with `fairtick trace --png` before it stops).
set -euo pipefail

ARM=${1:-baseline}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
CHUNK=${CHUNK:-512}
SAMPLES=${SAMPLES:-12}
INTERVAL_S=${INTERVAL_S:-5}
PROMPT_TOKENS=${PROMPT_TOKENS:-10000}
STREAMS=${STREAMS:-4}
STREAM_TOKENS=${STREAM_TOKENS:-20000}
ADMIT_AFTER_S=${ADMIT_AFTER_S:-3}
PARALLEL=${PARALLEL:-$((STREAMS + 1))}
EXTRA_FLAGS=${EXTRA_FLAGS:-}
START_TIMEOUT_S=60
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
URL="http://127.0.0.1:$PORT"
# Every curl ends by itself at the latest when the probe would have ended.
MAX_TIME_S=$((ADMIT_AFTER_S + SAMPLES * INTERVAL_S + 30))

WORK=$(mktemp -d "${TMPDIR:-/tmp}/starvation_probe.XXXXXX")
SERVER_PID=""
CURL_PIDS=()

cleanup() {
    local pid
    for pid in "${CURL_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

model_flags=()
[[ -n ${MODEL:-} ]] && model_flags=(--model "$MODEL")
# shellcheck disable=SC2206  # EXTRA_FLAGS is split into words on purpose
extra=($EXTRA_FLAGS)
(cd "$REPO" && exec "$PYTHON" -c 'import sys; from server.cli import main; sys.exit(main())' \
    serve --host 127.0.0.1 --port "$PORT" --policy "$ARM" --parallel "$PARALLEL" \
    --prefill-chunk-size "$CHUNK" "${model_flags[@]}" "${extra[@]}") >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!

for ((i = 0; i < START_TIMEOUT_S * 5; i++)); do
    curl -sf --max-time 2 "$URL/health" >/dev/null 2>&1 && break
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "starvation_probe: fairtick serve exited:" >&2; tail -20 "$WORK/serve.log" >&2; exit 1
    fi
    sleep 0.2
done
if ! curl -sf --max-time 2 "$URL/health" >/dev/null 2>&1; then
    echo "starvation_probe: no answer from $URL within ${START_TIMEOUT_S} s" >&2
    tail -20 "$WORK/serve.log" >&2
    exit 1
fi

complete() {  # complete BODY_FILE OUT_FILE: a streamed completion in the background
    curl -sN --max-time "$MAX_TIME_S" -H 'Content-Type: application/json' \
        --data-binary "@$1" "$URL/v1/completions" >"$2" 2>/dev/null &
    CURL_PIDS+=($!)
}

for ((i = 0; i < STREAMS; i++)); do
    printf '{"prompt": "stream %d: ", "max_tokens": %d, "stream": true}' "$i" "$STREAM_TOKENS" \
        >"$WORK/stream$i.json"
    complete "$WORK/stream$i.json" "$WORK/stream$i.out"
done
START_S=$(date +%s.%N)
prompt=$(head -c "$((PROMPT_TOKENS - 1))" /dev/zero | tr '\0' 'p')
printf '{"prompt": "%s", "max_tokens": 1, "stream": true}' "$prompt" >"$WORK/prompt.json"

counter() {  # counter NAME: its value in the last /metrics sample
    awk -v name="$1" '$1 == name { printf "%d", $2; found = 1 } END { if (!found) printf "-" }' \
        "$WORK/metrics"
}

echo "# $ARM: $STREAMS streams of $STREAM_TOKENS tokens; a $PROMPT_TOKENS-token prompt" \
    "admitted at ${ADMIT_AFTER_S} s; chunk $CHUNK; $PARALLEL slots; $URL ${EXTRA_FLAGS}"
printf '%8s %14s %14s %12s %12s %12s\n' elapsed_s prefill_chunks prefill_grants mixed_steps \
    decode_steps first_token
sleep "$ADMIT_AFTER_S"
complete "$WORK/prompt.json" "$WORK/prompt.out"
for ((n = 1; n <= SAMPLES; n++)); do
    sleep "$INTERVAL_S"
    curl -sf --max-time 10 "$URL/metrics" >"$WORK/metrics" || : >"$WORK/metrics"
    first=no
    grep -q '"text":"[^"]' "$WORK/prompt.out" 2>/dev/null && first=yes
    elapsed=$(awk -v s="$START_S" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
    printf '%8s %14s %14s %12s %12s %12s\n' "$elapsed" \
        "$(counter fairtick_prefill_chunks_total)" "$(counter fairtick_prefill_grants_total)" \
        "$(counter fairtick_mixed_steps_total)" "$(counter fairtick_decode_steps_total)" "$first"
done
if [[ -n ${TRACE_PNG:-} ]]; then
    (cd "$REPO" && "$PYTHON" -c 'import sys; from server.cli import main; sys.exit(main())' \
        trace --url "$URL" --png "$TRACE_PNG") || echo "starvation_probe: no trace picture" >&2
fi
