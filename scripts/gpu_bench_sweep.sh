#!/usr/bin/env bash
# The multi-model sweep on one GPU (docs/bench/h200: twelve dummy models, a ServeGen workload),
# one policy per call so that each fits the device's limit per command:
#
#   bash scripts/gpu_bench_sweep.sh prism "1,2,4,8,16"
#   bash scripts/gpu_bench_sweep.sh static "0.25,0.5,1,2,4"
#   STOP_EARLY=1 bash scripts/gpu_bench_sweep.sh static,swap "0.0625"
#
# Results go to $OUT/sweep (sweep.json, sweep.md, plots, server logs). A sweep.json already in
# docs/bench/h200 is the starting point: its SLOs (measured standalone by the first call) are
# reused and the new policy's runs are merged in. BUDGET_S (default 520) bounds the sweep's time.
# The server's step trace (PRISM_STEP_TRACE) goes to $OUT/sweep/steps-POLICY.jsonl.DEVICE.
# BENCH=docs/bench/h200-pressure runs another set-up (its prism.toml, workload.csv, sweep.json).
# STOP_EARLY=1 ends a run as soon as it can no longer keep 99% (its attainment is then a bound).
#
# A run longer than one device command (a low scale of a long workload): DETACH=1 starts the
# sweep in its own session (it outlives the command while the machine stays warm) and returns;
# then `bash scripts/gpu_bench_sweep.sh --collect WAIT_S`, in the next command, waits up to
# WAIT_S for it to end and leaves its directory as $OUT/sweep.tgz (call it again if it is not
# done: each call keeps the machine warm).
set -euo pipefail
cd "$(dirname "$0")/.."
detached=/tmp/prism-gpu-sweep-detached
if [ "${1:-}" = "--collect" ]; then
  wait_s=${2:-540}
  for _ in $(seq "$wait_s"); do
    [ -f "$detached/done" ] && break
    sleep 1
  done
  [ -f "$detached/done" ] && echo "the detached sweep ended: $(cat "$detached/done")" \
    || echo "the detached sweep is still running"
  tail -3 "$detached/sweep/sweep-"*.log 2>/dev/null || true
  tar -czf "${OUT:-/tmp}/sweep.tgz" -C "$detached" sweep detached.log || echo "no sweep directory yet"
  exit 0
fi
if [ "${DETACH:-}" = 1 ]; then
  rm -rf "$detached" && mkdir -p "$detached"
  OUT=$detached DETACH= setsid nohup bash -c \
    "bash scripts/gpu_bench_sweep.sh '$1' '$2'; echo \"rc \$?\" > $detached/done" \
    > "$detached/detached.log" 2>&1 < /dev/null &
  echo "detached sweep started (pid $!); collect with: bash scripts/gpu_bench_sweep.sh --collect"
  exit 0
fi
policy=$1
scales=$2
OUT=${OUT:-/tmp/prism-gpu-sweep}
out=$OUT/sweep
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
aot=/tmp/site/flashinfer/data/aot
bash scripts/fi_kernels.sh unpack "$aot"
bench=${BENCH:-docs/bench/h200}
[ -f "$bench/sweep.json" ] && cp "$bench/sweep.json" "$out/"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# policies in turn (comma-separated), each on its own server, merged into one sweep.json;
# every step each server runs goes to steps-POLICY.jsonl (PRISM_STEP_TRACE= empty: none)
for p in ${policy//,/ }; do
  PRISM_STEP_TRACE=${PRISM_STEP_TRACE-$out/steps-$p.jsonl} python3 -m prism_server bench sweep \
    --workload "$bench/workload.csv" --config "$bench/prism.toml" --out "$out" \
    --policies "$p" --scales "$scales" --refine 1 --standalone-requests 5 \
    --sample-interval 0.5 --budget-s "${BUDGET_S:-520}" --startup-timeout 300 \
    ${STOP_EARLY:+--stop-early} 2>&1 | tee "$out/sweep-$p.log"
  tail -5 "$out/server-$p.log"
done
