#!/usr/bin/env bash
# The GPU check, one command on the GPU machine: installs the carried wheel bundle, runs the GPU
# tests and the GPU benchmarks, and prints a short table last. Long logs go under $OUT (or
# /tmp/prism-gpu-check), packed into $OUT/results.tgz. Run from the repository root with the
# bundle in .whl/ (split models also need greenlet's wheel there: `python3 -m pip download
# --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
# "greenlet>=3"`); a carried .fiaot (FlashInfer's compiled modules, scripts/fi_kernels.sh) skips
# their JIT compile (each of fa3's takes about 80 s; TESTS_K="not fa3" leaves their tests out).
#
#   bash scripts/gpu_check.sh            # set-up transcript + tests + benchmarks + table
#   bash scripts/gpu_check.sh --quick    # set-up transcript + tests + pool benchmark
#   bash scripts/gpu_check.sh --api      # set-up transcript + tests + pool and API benchmarks
#   bash scripts/gpu_check.sh --tests    # every GPU test (tests/gpu, tests/kvpool), nothing else
#   bash scripts/gpu_check.sh --multi    # several GPUs: tensor-parallel test and benchmark,
#                                        # activation on every GPU at once, a move between GPUs
#   bash scripts/gpu_check.sh --decode   # the PARTS below (a change to the model's step)
#   bash scripts/gpu_check.sh --sweep POLICY SCALES   # the multi-model bench (below)
#   bash scripts/gpu_check.sh --capacity POLICIES     # models per GPU at 99% (below)
#   bash scripts/gpu_check.sh --collect WAIT_S        # a detached sweep's results
#
# --decode runs the PARTS named (default "tests engine ttft"); one call has 10 minutes, so
# name a few at a time:
#   tests     the kernel and token tests (GPU vs CPU, graphs); TESTS_K selects (pytest -k)
#   ab        this tree against the baseline tree in .baseline, alternating on this GPU: decode
#             TPOT at batch 1/16/64, prefill 1k and 8k, 8B activation, 10 GiB grow/shrink. Each
#             side runs its own tree's scripts (.baseline/scripts under their old names). Make
#             the baseline with `mkdir .baseline && git archive REV prism_server models kvpool
#             scheduler scripts | tar -x -C .baseline` and carry it. AB picks the measures
#             (default "decode engine activation pool"; about 13 minutes in all, so split them,
#             e.g. AB="decode engine" then AB="activation pool" on the same warm machine),
#             AB_ROUNDS the alternations (default 1: before, after); the ratios come last.
#   abbench   the multi-model bench (BENCH, default docs/bench/fleet24; SLO_FILE) under prism at
#             one scale (AB_SCALE, default 0.5), .baseline's tree then this one, in one lease
#   engine    the engine benchmark without its HF and K/V-write sections
#   ttft      where a lone prompt's TTFT goes
#   host      a lone prompt's eager step, host against device
#   peer      the gpt-fast-style decode of the same model at batch 1 and 16 (bench_peer.py)
#   fp8       the 8B shape with FP8 weights beside bf16 (bench_engine.py fp8): activation, decode
#             TPOT at batch 1 and 16, prefill 1k and 8k, each against its floor or matmul rate
#             (FP8_SIDES: of "bf16 fp8 fp8-swap", the last FP8 with its small steps' GEMMs swapped)
#   gemv, smallgemm, attn   the kernel benchmark's parts (GEMV_CONFIGS, SMALL_GEMM_CONFIGS,
#             ATTN_CONFIGS: the tilings tried; GEMV_CHAIN: tilings to run the whole GEMV chain
#             under; KERNELS_FP8=1: gemv and smallgemm over FP8 weights)
#   loraops   the LoRA kernels alone: a decode step's shrinks and expands, 1/8/32 adapters at
#             batch 32, where the time goes and other tilings (LORAOPS_ARGS adds arguments,
#             lists with commas: "--distinct=1,32 --block-n=128,256")
#   kernels   decode and prefill under each kernel table of KERNELS (JSON files of the kernel
#             config form, docs/CONFIG.md; a process each, PRISM_KERNEL_CONFIG=FILE), beside the
#             GPU's own table; default: prefill through fa3, and batch 1 without the GEMVs.
#             KERNELS_ARGS adds arguments (--decode-only: no prefill)
#   choices   decode under the kernel tables of CHOICES in one process, beside the GPU's own
#             table, in ROUNDS (default 2) interleaved rounds, medians and ratios last
#   lora      the LoRA benchmark (bench_lora.py): an 8B base's decode TPOT at batch 32 with 1, 8
#             and 32 distinct rank-16 adapters against the base alone, an adapter's activation
#             against the H2D copy of its bytes, 500 adapters registered; LORA_ARGS adds
#             arguments (e.g. "--register 100 --distinct 1,32"); its table follows the last one
#
# --sweep POLICY SCALES: the multi-model bench on one GPU (docs/bench/h200: twelve dummy models, a
# ServeGen workload), one policy per call (a call's limit), e.g.
#   bash scripts/gpu_check.sh --sweep prism "1,2,4,8,16"
#   STOP_EARLY=1 bash scripts/gpu_check.sh --sweep static,swap "0.0625"
# Results go to $OUT/sweep (sweep.json, sweep.md, plots, server logs, each server's step trace
# in steps-POLICY.jsonl; STEP_TRACE=0: none). A sweep.json in the bench directory is the start:
# its SLOs (measured standalone by the first call) are reused, the new runs merged in. BENCH
# picks the set-up (default docs/bench/h200; its prism.toml, workload.csv, sweep.json);
# SLO_FILE gives the SLOs instead (model -> {ttft_s, tpot_s}, e.g. docs/bench/fleet24/slos.json);
# BUDGET_S (default 520) bounds the time; STOP_EARLY=1 ends a run once it cannot keep 99%.
# STATIC_SUBSET=auto: static serves the busiest models that fit its pool (a fleet larger than
# the pool). --capacity POLICIES: `bench capacity` on BENCH (default docs/bench/fleet24), with
# SCALE, CAP_START, CAP_STEP (default 1, 4, 4), SLO_FILE, STOP_EARLY, BUDGET_S as above.
# CONFIG and WORKLOAD name another config and workload of the set-up (e.g. docs/bench/lora100's
# merged.toml and workload-merged.csv); a set-up's adapters.args makes its LoRA adapters first.
# DETACH=1 starts the sweep (or capacity) in its own session (it outlives the command while the
# machine stays warm); `--collect WAIT_S` in a later command waits for it and leaves
# $OUT/sweep.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prism-gpu-check}
mkdir -p "$OUT"
mode=${1:-}
detached=/tmp/prism-gpu-sweep-detached

if [ "$mode" = "--collect" ]; then
  for _ in $(seq "${2:-540}"); do
    [ -f "$detached/done" ] && break
    sleep 1
  done
  [ -f "$detached/done" ] && echo "the detached sweep ended: $(cat "$detached/done")" \
    || echo "the detached sweep is still running"
  tail -3 "$detached/sweep/sweep-"*.log 2>/dev/null || true
  tar -czf "$OUT/sweep.tgz" -C "$detached" sweep detached.log || echo "no sweep directory yet"
  exit 0
fi
if { [ "$mode" = "--sweep" ] || [ "$mode" = "--capacity" ]; } && [ "${DETACH:-}" = 1 ]; then
  rm -rf "$detached" && mkdir -p "$detached"
  OUT=$detached DETACH= setsid nohup bash -c \
    "bash scripts/gpu_check.sh $mode '$2' '${3:-}'; echo \"rc \$?\" > $detached/done" \
    > "$detached/detached.log" 2>&1 < /dev/null &
  echo "detached sweep started (pid $!); collect with: bash scripts/gpu_check.sh --collect"
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
python3 -c "import greenlet" 2>/dev/null \
  || echo "greenlet is in neither the machine's packages nor .whl/: split (tensor-parallel) models cannot run (its wheel: see the head of this script)"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
aot=/tmp/site/flashinfer/data/aot
bash scripts/fi_kernels.sh unpack "$aot"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader

# a set-up of LoRA adapters (docs/bench/lora100) names their making in adapters.args: written
# once a machine (make-adapters keeps those already there)
make_adapters() {
  if [ -f "$1/adapters.args" ]; then
    # shellcheck disable=SC2046  # (the file's words are the arguments; its braces stay literal)
    python3 -m prism_server make-adapters $(cat "$1/adapters.args")
  fi
}

if [ "$mode" = "--sweep" ]; then
  out=$OUT/sweep
  mkdir -p "$out"
  bench=${BENCH:-docs/bench/h200}
  [ -f "$bench/sweep.json" ] && cp "$bench/sweep.json" "$out/"
  make_adapters "$bench"
  # policies in turn (comma-separated), each on its own server, merged into one sweep.json; the
  # server's config is the set-up's, with the step trace on (the [engine] table's step_trace)
  for p in ${2//,/ }; do
    config=$bench/${CONFIG:-prism.toml}
    if [ "${STEP_TRACE:-1}" != 0 ]; then
      config=$out/prism-$p.toml
      sed "/^\[engine\]/a step_trace = \"$out/steps-$p.jsonl\"" "$bench/${CONFIG:-prism.toml}" > "$config"
    fi
    python3 -m prism_server bench sweep \
      --workload "$bench/${WORKLOAD:-workload.csv}" --config "$config" --out "$out" \
      --policies "$p" --scales "$3" --refine 1 --standalone-requests 5 \
      --sample-interval 0.5 --budget-s "${BUDGET_S:-520}" --startup-timeout 300 \
      ${STOP_EARLY:+--stop-early} ${SLO_FILE:+--slo-file "$SLO_FILE"} \
      ${STATIC_SUBSET:+--static-subset "$STATIC_SUBSET"} 2>&1 | tee "$out/sweep-$p.log"
    tail -5 "$out/server-$p.log"
  done
  exit 0
fi
if [ "$mode" = "--capacity" ]; then
  # models per GPU: the set-up's first n models (config order) with their own streams, n from
  # CAP_START by CAP_STEP, one run each at SCALE, per policy; merged into capacity.json
  out=$OUT/sweep
  mkdir -p "$out"
  bench=${BENCH:-docs/bench/fleet24}
  [ -f "$bench/capacity.json" ] && cp "$bench/capacity.json" "$out/"
  make_adapters "$bench"
  python3 -m prism_server bench capacity \
    --workload "$bench/${WORKLOAD:-workload.csv}" --config "$bench/${CONFIG:-prism.toml}" --out "$out" \
    --policies "$2" --scale "${SCALE:-1}" --start "${CAP_START:-4}" --step "${CAP_STEP:-4}" \
    --sample-interval 0.5 --budget-s "${BUDGET_S:-520}" --startup-timeout 300 \
    ${STOP_EARLY:+--stop-early} ${SLO_FILE:+--slo-file "$SLO_FILE"} 2>&1 \
    | tee "$out/capacity-${2//,/-}.log"
  exit 0
fi

if [ "$mode" = "--decode" ]; then
  part() { [[ " ${PARTS:-tests engine ttft} " == *" $1 "* ]]; }
  if part tests; then
    t0=$SECONDS
    # the model's GPU tests that exist in this tree
    files=
    for f in fused_ops_gpu sampling_gpu launch_ahead_gpu piecewise_graphs gpu_vs_cpu cuda_graphs \
      flashinfer_attention upload_gpu triton_ops_gpu triton_gemv_gpu triton_small_gemm_gpu \
      fp8_gpu fp8_accuracy_gpu lora_gpu; do
      [ -f "tests/gpu/test_$f.py" ] && files="$files tests/gpu/test_$f.py"
    done
    timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=8 \
      $files -k "${TESTS_K:-}" 2>&1 | tee "$OUT/pytest.log"
    echo "tests: $((SECONDS - t0)) s"
  fi
  if part ab; then
    [ -d .baseline/scripts ] || { echo "ab: no baseline tree in .baseline (see the head)"; exit 1; }
    # side -> its tree's command for a measure (the baseline's scripts under their old names)
    ab_cmd() {
      local side=$1 what=$2 json=$3
      if [ "$side" = before ]; then
        case "$what" in
          decode) echo ".baseline/scripts/bench_decode_ab.py --tree .baseline --label before --batches 1,16,64 --json $json" ;;
          engine) echo ".baseline/scripts/bench_gpu_engine.py --speed-only --json $json" ;;
          activation) echo ".baseline/scripts/bench_gpu_lifecycle.py --only activation --json $json" ;;
          pool) echo ".baseline/scripts/bench_gpu_pool.py --gib 10 --json $json" ;;
        esac
      else
        case "$what" in
          decode) echo "scripts/bench_engine.py ab --tree . --label after --batches 1,16,64 --json $json" ;;
          engine) echo "scripts/bench_engine.py speed --speed-only --json $json" ;;
          activation) echo "scripts/bench_lifecycle.py models --only activation --json $json" ;;
          pool) echo "scripts/bench_lifecycle.py pool --gib 10 --json $json" ;;
        esac
      fi
    }
    for round in $(seq "${AB_ROUNDS:-1}"); do
      for what in ${AB:-decode engine activation pool}; do
        for side in before after; do
          tree=.; [ "$side" = before ] && tree=.baseline
          t0=$SECONDS
          # shellcheck disable=SC2046
          PYTHONPATH=$tree:/tmp/site timeout "${AB_TIMEOUT:-330}" python3 \
            $(ab_cmd "$side" "$what" "$OUT/ab-$side-$what-$round.json") \
            > "$OUT/ab-$side-$what-$round.log" 2>&1
          echo "ab $what $side (round $round): rc $?, $((SECONDS - t0)) s"
          grep -E "TPOT B=|prefill [0-9]+: |activate median|^pool: .*64 MiB" \
            "$OUT/ab-$side-$what-$round.log" | head -8 | sed "s/^/   /"
        done
      done
    done
    python3 scripts/bench_engine.py report-ab "$OUT" | tee "$OUT/ab.txt"
  fi
  if part abbench; then
    # the multi-model bench under prism at one scale, this tree against .baseline's, in one
    # lease: each side's own bench and server (run from its tree, so `-m prism_server` is it)
    [ -d .baseline/prism_server ] || { echo "abbench: no baseline tree in .baseline"; exit 1; }
    bench=$PWD/${BENCH:-docs/bench/fleet24}
    slo=${SLO_FILE:+$PWD/$SLO_FILE}
    for side in ${AB_SIDES:-before after}; do
      tree=$PWD; [ "$side" = before ] && tree=$PWD/.baseline
      t0=$SECONDS
      (cd "$tree" && PYTHONPATH=$tree:/tmp/site timeout "${AB_TIMEOUT:-330}" python3 -m prism_server \
        bench sweep --workload "$bench/workload.csv" --config "$bench/prism.toml" \
        --out "$OUT/abbench-$side" --policies prism --scales "${AB_SCALE:-0.5}" \
        ${slo:+--slo-file "$slo"} --sample-interval 0.5 --startup-timeout 300 --no-plots \
        > "$OUT/abbench-$side.log" 2>&1)
      echo "abbench $side: rc $?, $((SECONDS - t0)) s"
      tail -3 "$OUT/abbench-$side/server-prism.log" 2>/dev/null | cut -c1-200
    done
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for side in ("before", "after"):
    try:
        sweep = json.loads((Path(sys.argv[1]) / f"abbench-{side}" / "sweep.json").read_text())
        run = sweep["policies"]["prism"]["runs"][0]
    except (OSError, KeyError, IndexError, ValueError) as e:
        print(f"abbench {side}: no run ({e})")
        continue
    o = run["report"]["overall"]
    met = round(o["attainment"] * o["requests"])
    print(f"abbench {side}: x{run['scale']:g} attainment {100 * o['attainment']:.1f}% "
          f"({met} of {o['requests']} met), activations {run['activations']}, "
          f"evictions {run['evictions']}")
PY
  fi
  if part engine; then
    t0=$SECONDS
    timeout 320 python3 scripts/bench_engine.py speed --skip-hf --skip-append --json "$OUT/engine.json" \
      2>&1 | tee "$OUT/bench.log"
    echo "engine bench: $((SECONDS - t0)) s"
  fi
  part peer && timeout "${PEER_TIMEOUT:-400}" python3 scripts/bench_peer.py \
    --json "$OUT/gptfast.json" 2>&1 | tee "$OUT/gptfast.log" | grep -E "^gpt-fast|^weights|Error"
  part ttft && timeout 120 python3 scripts/bench_engine.py ttft --json "$OUT/ttft.json" 2>&1 | tail -3
  part host && timeout 150 python3 scripts/bench_engine.py host --json "$OUT/host.json" \
    2>&1 | grep -v "^prism_server" | tail -60
  part fp8 && timeout "${FP8_TIMEOUT:-560}" python3 scripts/bench_engine.py fp8 \
    ${FP8_SIDES:+--sides "$FP8_SIDES"} --json "$OUT/fp8.json" 2>&1 | tee "$OUT/fp8.log" | grep -E "^== |^   |\||Error"
  part gemv && timeout 200 python3 scripts/bench_kernels.py gemv ${KERNELS_FP8:+--fp8} \
    ${GEMV_CONFIGS:+--configs "$GEMV_CONFIGS"} ${GEMV_CHAIN:+--chain-configs "$GEMV_CHAIN"} \
    --json "$OUT/gemv.json" 2>&1 | tail -16
  part attn && timeout 300 python3 scripts/bench_kernels.py attn \
    ${ATTN_CONFIGS:+--configs "$ATTN_CONFIGS"} --json "$OUT/decode_kernel.json" 2>&1 \
    | tee "$OUT/decode_kernel.log" | grep -E "^B=|Error|error"
  part loraops && timeout 300 python3 scripts/bench_kernels.py lora ${LORAOPS_ARGS:-} \
    --json "$OUT/lora_ops.json" 2>&1 | tee "$OUT/lora_ops.log" | grep -E "^B=|Error|error"
  part smallgemm && timeout 300 python3 scripts/bench_kernels.py smallgemm ${KERNELS_FP8:+--fp8} \
    ${SMALL_GEMM_CONFIGS:+--configs "$SMALL_GEMM_CONFIGS"} --json "$OUT/small_gemm.json" 2>&1 \
    | tee "$OUT/small_gemm.log" | grep -E "chain|fused|best|Error|error"
  if part choices; then
    timeout "${CHOICES_TIMEOUT:-560}" python3 scripts/bench_engine.py speed --choices "${CHOICES:-}" \
      --rounds "${ROUNDS:-2}" --json "$OUT/choices.json" 2>&1 | tee "$OUT/choices.log" \
      | grep -E "^   \[|^   choice:|^   (default|/)|through FlashInfer|plainly|norms and act|Error"
  fi
  part lora && timeout "${LORA_TIMEOUT:-560}" python3 scripts/bench_lora.py ${LORA_ARGS:-} \
    --json "$OUT/lora.json" 2>&1 | tee "$OUT/lora.log" | grep -E "^==|^   |Error"
  if part kernels; then
    if [ -z "${KERNELS+x}" ]; then  # the default tables: a setting each, beside the GPU's
      mkdir -p "$OUT/kernels"
      echo '{"prefill_backend": {"value": "fa3"}}' > "$OUT/kernels/prefill-fa3.json"
      echo '{"gemv": {"value": null}}' > "$OUT/kernels/no-gemv.json"
      KERNELS="$OUT/kernels/prefill-fa3.json $OUT/kernels/no-gemv.json"
    fi
    for table in $KERNELS; do
      t0=$SECONDS
      name=$(basename "$table" .json)
      PRISM_KERNEL_CONFIG=$table timeout 330 python3 scripts/bench_engine.py speed --speed-only \
        ${KERNELS_ARGS:-} --json "$OUT/engine-$name.json" 2>&1 \
        | grep -E "decode B=|B=1[6]?: step|prefill|tokens: wall|through FlashInfer|plainly|norms and act" \
        | sed "s/^/$name: /"
      echo "$name: $((SECONDS - t0)) s"
    done
  fi
fi
if [ "$mode" = "--tests" ]; then
  t0=$SECONDS
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=12 \
    tests/gpu tests/kvpool -k "${TESTS_K:-}" 2>&1 | tee "$OUT/pytest.log"
  echo "tests: $((SECONDS - t0)) s"
fi
if [ "$mode" = "--multi" ]; then
  t0=$SECONDS
  timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    tests/gpu/test_flashinfer_attention.py -k "not fa3" 2>&1 | tee "$OUT/pytest.log"
  echo "tests: $((SECONDS - t0)) s"
  timeout 400 python3 scripts/bench_lifecycle.py tp --json "$OUT/tp.json" 2>&1 | tail -4
  timeout 400 python3 scripts/bench_lifecycle.py multi --json "$OUT/multi.json" 2>&1 | tail -6
fi
# What the README's set-up does on this machine (the decision only: it has no registry access),
# then the start-up lines of a server on it (attention backend, graphs, kernels, page pool).
if [ -z "$mode" ] || [ "$mode" = "--quick" ] || [ "$mode" = "--api" ]; then
  t0=$SECONDS
  {
    echo "\$ bash scripts/install.sh --dry-run"; bash scripts/install.sh --dry-run
    echo "\$ python3 -m prism_server --model m=dummy:llama-3.2-1b --port 8765"
    python3 -m prism_server --model m=dummy:llama-3.2-1b --port 8765 > "$OUT/startup.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do
      curl -sf http://127.0.0.1:8765/health >/dev/null 2>&1 && break
      kill -0 $pid 2>/dev/null || break; sleep 0.5
    done
    curl -s http://127.0.0.1:8765/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}'; echo
    kill -TERM $pid 2>/dev/null; wait $pid
    cat "$OUT/startup.log"
  } 2>&1 | tee "$OUT/setup.txt"
  echo "set-up transcript: $((SECONDS - t0)) s"

  t0=$SECONDS
  timeout 330 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu tests/kvpool 2>&1 | tee "$OUT/pytest.log"
  echo "tests: $((SECONDS - t0)) s"

  t0=$SECONDS
  timeout 60 python3 scripts/bench_lifecycle.py pool --json "$OUT/pool.json" 2>&1 | tee "$OUT/bench.log"
  echo "pool bench: $((SECONDS - t0)) s"
  if [ -z "$mode" ]; then
    t0=$SECONDS
    timeout 250 python3 scripts/bench_engine.py speed --json "$OUT/engine.json" 2>&1 | tee -a "$OUT/bench.log"
    echo "engine bench: $((SECONDS - t0)) s"
    t0=$SECONDS
    timeout 420 python3 scripts/bench_lifecycle.py models --json "$OUT/lifecycle.json" 2>&1 | tee -a "$OUT/bench.log"
    echo "lifecycle bench: $((SECONDS - t0)) s"
    t0=$SECONDS
    timeout 300 python3 scripts/bench_lifecycle.py arbitrator --json "$OUT/arbitrator.json" 2>&1 | tee -a "$OUT/bench.log"
    echo "arbitrator bench: $((SECONDS - t0)) s"
  fi
  if [ "$mode" != "--quick" ]; then
    t0=$SECONDS
    timeout 300 python3 scripts/bench_engine.py api --json "$OUT/api.json" 2>&1 | tee -a "$OUT/bench.log"
    echo "api bench (prefix cache TTFT, structured-output TPOT): $((SECONDS - t0)) s"
  fi
fi

# Keep the FlashInfer modules, those compiled now too, for the next run: back here, join the
# parts with `bash scripts/fi_kernels.sh join FILES_AT` (-> .fiaot/fi_aot.tar.xz, carried).
bash scripts/fi_kernels.sh pack "$aot" "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" "$OUT"

echo
python3 scripts/bench_engine.py report "$OUT/pool.json" "$OUT/engine.json" "$OUT/pytest.log" \
  "$OUT/gptfast.json" | tee "$OUT/table.txt"
[ -f "$OUT/lora.json" ] && python3 scripts/bench_lora.py report "$OUT/lora.json" | tee -a "$OUT/table.txt"

# A device call returns few files: the logs and figures travel in one archive, beside the
# kernel parts.
(cd "$OUT" && tar -czf results.tgz --exclude='fi_aot.tgz.part*' --exclude=results.tgz . \
  && find . -mindepth 1 -maxdepth 1 ! -name 'fi_aot.tgz.part*' ! -name results.tgz -exec rm -rf {} +)
ls -la "$OUT"
