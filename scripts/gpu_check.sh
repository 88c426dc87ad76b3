#!/usr/bin/env bash
# The GPU check, one command on the GPU machine: installs the carried wheel bundle, runs the GPU
# tests, then the GPU benchmarks, and prints a short table last. Long logs go under $OUT (or
# /tmp/prism-gpu-check). Run from the repository root with the bundle in .whl/ (see
# ../shared/device/README.md; split models also need greenlet's wheel there: `python3 -m pip
# download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
# -d .whl "greenlet>=3"`); a carried .fiaot (compiled FlashInfer kernels of an earlier run,
# scripts/fi_kernels.sh) skips the JIT compile.
#
#   bash scripts/gpu_check.sh            # set-up transcript + tests + benchmarks
#   bash scripts/gpu_check.sh --quick    # set-up transcript + tests + pool benchmark only
#   bash scripts/gpu_check.sh --api      # set-up transcript + tests + pool and API benchmarks
#   bash scripts/gpu_check.sh --decode   # the model's GPU tests + decode A/B + engine benchmark
#   bash scripts/gpu_check.sh --tests    # every GPU test (tests/gpu, tests/kvpool), nothing else
#   bash scripts/gpu_check.sh --multi    # several GPUs: tensor-parallel test and benchmark,
#                                        # activation on every GPU at once, a move between GPUs
#
# --decode is for a change to the model's step: the tests of the kernels and of the tokens (GPU
# vs CPU, graphs), then decode TPOT of this tree beside a baseline tree in .baseline (when there
# is one: `git archive REV prism_server models kvpool scheduler scripts | tar -x -C .baseline`),
# then the engine benchmark without its HF and KV-write sections, a GEMM after an idle window with
# its weight asked of the L2 or not (bench_gpu_l2_prefetch.py), then the decode and prefill
# figures under each other kernel choice (KERNELS, default: FlashInfer's and XQA's decode
# kernels, the rope and K/V write unfused, cuBLASLt without a workspace (no split-K GEMMs, so no
# reduce kernel after o_proj and down_proj at small batches), fa3 prefill; a choice of several
# settings joins them with commas, e.g. PRISM_DECODE_BACKEND=flashinfer,PRISM_DECODE_SPLIT_PAGES=0).
# All of it takes more than a
# call's 10 minutes: PARTS picks some of "tests ab engine ttft prefetch kernels", e.g.
#   PARTS="tests kernels" KERNELS=PRISM_DECODE_BACKEND=xqa bash scripts/gpu_check.sh --decode
# PARTS=gemv (not in the default set) times batch-1 projections, cuBLAS against the GEMVs of
# models.layers.triton_gemv, alone and as a layer's chain (bench_gpu_gemv.py); PARTS=smallgemm
# times projections of 16, 8 and 4 rows, cuBLAS against models.layers.triton_small_gemm
# (bench_gpu_small_gemm.py). PARTS=attn times decode attention alone at B=1 and 16, the Triton
# kernel's settings against FlashInfer's kernel and the K/V floor (bench_gpu_decode_kernel.py).
# PARTS=host stamps a lone prompt's eager step, host against device (bench_gpu_prefill_host.py).
# PARTS=peer times a gpt-fast-style decode (torch.compile, reduce-overhead) of the same model
# at batch 1 and 16 (bench_gpu_gptfast.py), the peer Prism's TPOT is compared to.
# PARTS=choices (not in the default set) measures decode under CHOICES, PRISM_* settings only,
# beside the defaults in one process, in ROUNDS (default 2) interleaved rounds:
#   PARTS=choices CHOICES="PRISM_TRITON_PDL=1 PRISM_L2_PREFETCH=48:12:12" bash scripts/gpu_check.sh --decode
# KERNELS_ARGS adds arguments to each choice's engine benchmark (--decode-only: no prefill).
# TESTS_K selects the tests (pytest -k; default: all of them). FlashInfer's modules come compiled
# in .fiaot (`bash scripts/fi_kernels.sh build`, no GPU needed; a module a run still compiles
# comes back in $OUT/fi_aot.tgz.part*, for `bash scripts/fi_kernels.sh join`); without them,
# each of fa3's compiles for about 80 s here, and TESTS_K="not fa3" leaves their tests out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prism-gpu-check}
mkdir -p "$OUT"
quick=${1:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
python3 -c "import greenlet" 2>/dev/null \
  || echo "greenlet is in neither the machine's packages nor .whl/: split (tensor-parallel) models cannot run (its wheel: see the head of this script)"
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
aot=/tmp/site/flashinfer/data/aot
bash scripts/fi_kernels.sh unpack "$aot"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader

if [ "$quick" = "--decode" ]; then
  part() { [[ " ${PARTS:-tests ab engine ttft prefetch kernels} " == *" $1 "* ]]; }
  if part tests; then
    t0=$SECONDS
    timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=8 \
      tests/gpu/test_fused_ops_gpu.py \
      tests/gpu/test_sampling_gpu.py tests/gpu/test_launch_ahead_gpu.py tests/gpu/test_piecewise_graphs.py \
      tests/gpu/test_gpu_vs_cpu.py tests/gpu/test_cuda_graphs.py tests/gpu/test_flashinfer_attention.py \
      tests/gpu/test_upload_gpu.py tests/gpu/test_triton_ops_gpu.py \
      tests/gpu/test_l2_prefetch_gpu.py tests/gpu/test_triton_gemv_gpu.py \
      tests/gpu/test_triton_small_gemm_gpu.py -k "${TESTS_K:-}" 2>&1 | tee "$OUT/pytest.log"
    echo "tests: $((SECONDS - t0)) s"
  fi
  if part ab && [ -d .baseline ]; then
    for side in before after; do
      tree=.; [ "$side" = before ] && tree=.baseline
      timeout 150 python3 scripts/bench_decode_ab.py --tree "$tree" --label "$side" --batches 1,16,64 \
        --json "$OUT/ab-$side.json" 2>&1 | tail -4
    done
  fi
  if part engine; then
    t0=$SECONDS
    timeout 320 python3 scripts/bench_gpu_engine.py --skip-hf --skip-append --json "$OUT/engine.json" \
      2>&1 | tee "$OUT/bench.log"
    echo "engine bench: $((SECONDS - t0)) s"
  fi
  # the peer: a gpt-fast-style compiled decode of the same shape, right after Prism's (not in
  # the default set: PARTS=peer; about 100 s of compiling a batch size)
  part peer && timeout "${PEER_TIMEOUT:-400}" python3 scripts/bench_gpu_gptfast.py \
    --json "$OUT/gptfast.json" 2>&1 | tee "$OUT/gptfast.log" | grep -E "^gpt-fast|^weights|Error"
  # where a lone prompt's TTFT goes through the engine: to its first step, steps, output
  part ttft && timeout 120 python3 scripts/bench_gpu_ttft.py --json "$OUT/ttft.json" 2>&1 | tail -3
  # where a lone prompt's eager step spends its host time, and each kind of call's launch cost
  # (not in the default set: PARTS=host)
  part host && timeout 150 python3 scripts/bench_gpu_prefill_host.py --json "$OUT/host.json" \
    2>&1 | grep -v "^prism_server" | tail -60
  # a GEMM after an idle window, its weight asked of the L2 in the window or not
  part prefetch && timeout 120 python3 scripts/bench_gpu_l2_prefetch.py --json "$OUT/l2.json" 2>&1 \
    | tail -24
  # batch-1 projections: cuBLAS beside Prism's Triton GEMVs that carry the norms, activation
  # and residual adds (not in the default set: PARTS=gemv; GEMV_CONFIGS: the tilings tried)
  part gemv && timeout 200 python3 scripts/bench_gpu_gemv.py ${GEMV_CONFIGS:+--configs "$GEMV_CONFIGS"} \
    --json "$OUT/gemv.json" 2>&1 | tail -10
  # decode attention alone: the Triton kernel under several settings beside FlashInfer's and
  # the K/V floor (not in the default set: PARTS=attn; ATTN_CONFIGS: the settings,
  # splits:stages:waves:block_n[:warps])
  part attn && timeout 300 python3 scripts/bench_gpu_decode_kernel.py \
    ${ATTN_CONFIGS:+--configs "$ATTN_CONFIGS"} --json "$OUT/decode_kernel.json" 2>&1 \
    | tee "$OUT/decode_kernel.log" | grep -E "^B=|Error|error"
  # few-row projections: cuBLAS beside Prism's Triton small GEMMs, alone and as a layer's
  # chain (not in the default set: PARTS=smallgemm; SMALL_GEMM_CONFIGS: the tilings tried)
  part smallgemm && timeout 300 python3 scripts/bench_gpu_small_gemm.py \
    ${SMALL_GEMM_CONFIGS:+--configs "$SMALL_GEMM_CONFIGS"} --json "$OUT/small_gemm.json" 2>&1 \
    | tee "$OUT/small_gemm.log" | grep -E "chain|fused|best|Error|error"
  # decode under kernel choices (CHOICES: PRISM_* settings) beside the defaults, one process,
  # engines built in turn, ROUNDS rounds (ABC ABC), medians and ratios to the defaults last
  if part choices; then
    timeout "${CHOICES_TIMEOUT:-560}" python3 scripts/bench_gpu_engine.py --choices "${CHOICES:-}" \
      --rounds "${ROUNDS:-2}" --json "$OUT/choices.json" 2>&1 | tee "$OUT/choices.log" \
      | grep -E "^   \[|^   choice:|^   (default|PRISM_)|the L2|through FlashInfer|plainly|norms and act|Error"
  fi
  # the kernel choices beside the default, a process each (KERNELS="" skips them)
  if part kernels; then
    for choice in ${KERNELS-PRISM_DECODE_BACKEND=flashinfer PRISM_DECODE_BACKEND=xqa PRISM_ROPE_WRITE=0 CUBLASLT_WORKSPACE_SIZE=1 PRISM_PREFILL_BACKEND=fa3}; do
      t0=$SECONDS
      env ${choice//,/ } timeout 330 python3 scripts/bench_gpu_engine.py --speed-only ${KERNELS_ARGS:-} \
        --json "$OUT/engine-${choice//[=,]/-}.json" 2>&1 \
        | grep -E "decode B=|B=1[6]?: step|prefill|tokens: wall|the L2|through FlashInfer|plainly|norms and act" \
        | sed "s/^/$choice: /"
      echo "$choice: $((SECONDS - t0)) s"
    done
  fi
fi
if [ "$quick" = "--tests" ]; then
  t0=$SECONDS
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=12 \
    tests/gpu tests/kvpool -k "${TESTS_K:-}" 2>&1 | tee "$OUT/pytest.log"
  echo "tests: $((SECONDS - t0)) s"
fi
if [ "$quick" = "--multi" ]; then
  t0=$SECONDS
  timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
    tests/gpu/test_flashinfer_attention.py -k "not fa3" 2>&1 | tee "$OUT/pytest.log"
  echo "tests: $((SECONDS - t0)) s"
  timeout 400 python3 scripts/bench_gpu_tp.py --json "$OUT/tp.json" 2>&1 | tail -4
  timeout 400 python3 scripts/bench_gpu_multi.py --json "$OUT/multi.json" 2>&1 | tail -6
fi
# What the README's set-up does on this machine (the decision only: it has no registry access),
# then the start-up lines of a server on it (attention backend, graphs, kernels, page pool).
if [ "$quick" != "--decode" ] && [ "$quick" != "--multi" ] && [ "$quick" != "--tests" ]; then
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
timeout 60 python3 scripts/bench_gpu_pool.py --json "$OUT/pool.json" 2>&1 | tee "$OUT/bench.log"
echo "pool bench: $((SECONDS - t0)) s"
if [ -z "$quick" ]; then
  t0=$SECONDS
  timeout 250 python3 scripts/bench_gpu_engine.py --json "$OUT/engine.json" 2>&1 | tee -a "$OUT/bench.log"
  echo "engine bench: $((SECONDS - t0)) s"
  t0=$SECONDS
  timeout 420 python3 scripts/bench_gpu_lifecycle.py --json "$OUT/lifecycle.json" 2>&1 | tee -a "$OUT/bench.log"
  echo "lifecycle bench: $((SECONDS - t0)) s"
  t0=$SECONDS
  timeout 300 python3 scripts/bench_gpu_arbitrator.py --json "$OUT/arbitrator.json" 2>&1 | tee -a "$OUT/bench.log"
  echo "arbitrator bench: $((SECONDS - t0)) s"
fi
if [ -z "$quick" ] || [ "$quick" = "--api" ]; then
  t0=$SECONDS
  timeout 300 python3 scripts/bench_api.py --json "$OUT/api.json" 2>&1 | tee -a "$OUT/bench.log"
  echo "api bench (prefix cache TTFT, structured-output TPOT): $((SECONDS - t0)) s"
fi
fi  # not --decode

# Keep the FlashInfer modules, those compiled now too, for the next run: back here, join the
# parts with `bash scripts/fi_kernels.sh join FILES_AT` (-> .fiaot/fi_aot.tar.xz, carried).
bash scripts/fi_kernels.sh pack "$aot" "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" "$OUT"

echo
python3 scripts/gpu_report.py "$OUT/pool.json" "$OUT/engine.json" "$OUT/pytest.log" \
  "$OUT/gptfast.json" | tee "$OUT/table.txt"

# A device call returns at most 8 files: the logs and figures travel in one archive, beside the
# kernel parts.
(cd "$OUT" && tar -czf results.tgz --exclude='fi_aot.tgz.part*' --exclude=results.tgz . \
  && find . -mindepth 1 -maxdepth 1 ! -name 'fi_aot.tgz.part*' ! -name results.tgz -exec rm -rf {} +)
ls -la "$OUT"
