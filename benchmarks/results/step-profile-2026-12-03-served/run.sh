#!/bin/bash
# The script as run (2026-12-03): ./run.sh plain "" ; ./run.sh entmtp '{"method": "entmtp"}'
# SNAP: a clone of the repository at the measured commit (as run: a /tmp clone at 522d25a); py-spy was pip-installed into
# /tmp/pyspy-inst; outputs go to /tmp/prof. The last line kills every vLLM process on the machine: run it alone.
# (The "MARK" lines it appends never reached the server log, which the server writes from its own offset.)
set -u
SNAP=${SNAP:?set SNAP to a clone of the repository at the measured commit}
VENV=${VENV:-$SNAP/.venv}  # as run: the main checkout's .venv
NAME=$1; SPEC=$2
cd "$SNAP"
M=$HOME/.cache/vllm-entmtp/models/SmolLM2-135M-Instruct
ARGS=(serve $M --served-model-name SmolLM2-135M-Instruct --dtype bfloat16 --port 8300 --enable-logging-iteration-details)
[ -n "$SPEC" ] && ARGS+=(--speculative-config "$SPEC")
VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH="$SNAP" $VENV/bin/vllm "${ARGS[@]}" > /tmp/prof/$NAME.server.log 2>&1 &
SP=$!
for i in $(seq 600); do curl -sf localhost:8300/health >/dev/null && break; sleep 1; done
PY=$VENV/bin/python
PYTHONPATH="$SNAP" $PY benchmarks/throughput.py --base-url http://127.0.0.1:8300 --no-progress --dataset gsm8k --num-prompts 16 --concurrency 16 --max-tokens 32 > /dev/null 2>&1  # warm-up
EC=$(pgrep -f "VLLM::EngineCore" | head -1); WK=$(pgrep -f "VLLM::Worker" | head -1)
for LVL in 16 1; do
/tmp/pyspy-inst/bin/py-spy record --pid $EC -r 50 -d 40 -f raw -o /tmp/prof/$NAME.c$LVL.ec.txt --nonblocking >/dev/null 2>&1 &
/tmp/pyspy-inst/bin/py-spy record --pid $WK -r 50 -d 40 -f raw -o /tmp/prof/$NAME.c$LVL.wk.txt --nonblocking >/dev/null 2>&1 &
echo "MARK level $LVL" >> /tmp/prof/$NAME.server.log
PYTHONPATH="$SNAP" timeout 40 $PY benchmarks/throughput.py --base-url http://127.0.0.1:8300 --no-progress --dataset gsm8k --num-prompts 64 --concurrency $LVL --max-tokens 64 --max-seconds 30 2>&1 | tail -3
wait $(jobs -p | grep -v $SP) 2>/dev/null
done
kill $SP; wait $SP 2>/dev/null
pkill -f "VLLM::" ; sleep 3
