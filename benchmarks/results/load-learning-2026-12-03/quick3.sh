#!/bin/bash
# usage: quick3.sh NAME PORT SPEC LEVELS NREQ DATASET ROUND
# Environment: REPO (the checkout whose .venv serves), SNAP (a clone for the client), OUT (where logs and JSON go;
# default the current folder). MODEL: the default model, wherever `vllm-entmtp prepare` put it.
# It stops its server with `pkill -f "port $PORT"`.
OUT=$(cd "${OUT:-.}" && pwd)
NAME=$1; PORT=$2; SPEC=$3; LV=$4; N=$5; DS=$6; R=$7
MODEL=$("$REPO/.venv/bin/vllm-entmtp" prepare --json | "$REPO/.venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["model"])')
ARGS=(--port $PORT --dtype bfloat16 --served-model-name m)
[ "$SPEC" != none ] && ARGS+=(--speculative-config "$SPEC")
VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 setsid $REPO/.venv/bin/vllm serve $MODEL "${ARGS[@]}" > $OUT/server-$NAME-r$R.log 2>&1 &
for i in $(seq 80); do sleep 5; curl -s localhost:$PORT/health >/dev/null && break; done
cd $SNAP
$REPO/.venv/bin/python benchmarks/throughput.py --base-url http://127.0.0.1:$PORT --dataset $DS --concurrency $LV --num-requests $N --max-tokens 48 --no-progress --warmup-requests 2 --result-json $OUT/$NAME-$DS-r$R.json 2>&1 | grep "conc " | sed "s/^/r$R $NAME $DS /"
pkill -f "port $PORT" ; sleep 6
