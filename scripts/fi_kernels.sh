#!/usr/bin/env bash
# FlashInfer's compiled kernels, carried from one GPU call to the next in .fiaot/ (git-ignored),
# so that a fresh machine skips their JIT compile (minutes for fa3).
#
#   bash scripts/fi_kernels.sh unpack AOT_DIR        # on the GPU: .fiaot/fi_aot.* into FlashInfer's
#                                                    # AOT directory
#   bash scripts/fi_kernels.sh pack AOT_DIR JIT_DIR OUT
#                                                    # on the GPU: those modules and the ones compiled
#                                                    # now under JIT_DIR -> OUT/fi_aot.tgz.partNN, parts
#                                                    # of 15 MiB (the most a call returns per file);
#                                                    # nothing when none is new
#   bash scripts/fi_kernels.sh join DIR              # here: the parts a call returned in DIR, added
#                                                    # to .fiaot/fi_aot.tar.xz (xz: about 60% of
#                                                    # gzip's size)
#   bash scripts/fi_kernels.sh build [SHAPE ...]     # here, no GPU needed: prefill, decode and fused-
#                                                    # kernel modules (those Prism uses, by default)
#                                                    # compiled with nvcc of the GPU machine's
#                                                    # CUDA release, added to .fiaot/fi_aot.tar.xz
#                                                    # (bench_kernels.py prebuild; toolchain in .fibuild/)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  unpack)
    aot=$2
    mkdir -p "$aot"
    for f in .fiaot/fi_aot.tar.xz .fiaot/fi_aot.tgz; do
      [ -f "$f" ] || continue
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
        "$f" "$aot"
    done
    echo "FlashInfer kernels from .fiaot: $(ls "$aot" | wc -l) modules"
    ;;
  pack)
    aot=$2 jit=$3 out=$4
    stage=$(mktemp -d)
    [ -d "$aot" ] && cp -r "$aot"/. "$stage"/
    new=0
    while read -r so; do
      name=$(basename "$so" .so)
      [ -e "$stage/$name" ] && continue
      mkdir -p "$stage/$name"; cp "$so" "$stage/$name/"; new=$((new + 1))
    done < <(find "$jit" -path '*cached_ops*' -name '*.so' 2>/dev/null)
    # a call returns few files: the parts only when this run compiled a module not carried
    if [ "$new" = 0 ]; then
      echo "FlashInfer: no module compiled that .fiaot lacks; nothing to carry back"
      exit 0
    fi
    echo "FlashInfer: $new modules compiled that .fiaot lacks"
    tar -czf - -C "$stage" . | split -b 15m -d - "$out/fi_aot.tgz.part"
    ls -la "$out"/fi_aot.tgz.part*
    ;;
  build)
    shift
    cuda=${FI_CUDA_RELEASE:-13.0}  # the GPU machine's nvcc (../shared/device/README.md)
    site=$PWD/.fibuild/site
    wheel=$(ls .whl/flashinfer_python-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no FlashInfer wheel in .whl/ (../shared/device/fetch_wheels.sh .whl)"; exit 1; }
    [ -x .venv/bin/python ] || { echo "no .venv: bash scripts/install.sh first"; exit 1; }
    if [ ! -x "$site/nvidia/cu13/bin/nvcc" ]; then
      .venv/bin/python -m pip install -q --target "$site" --no-deps "$wheel"
      .venv/bin/python -m pip install -q --target "$site" nvidia-ml-py ninja einops tabulate \
        "nvidia-cuda-nvcc==$cuda.*" "nvidia-cuda-crt==$cuda.*" "nvidia-nvvm==$cuda.*" \
        "nvidia-cuda-runtime==$cuda.*" "nvidia-cuda-cccl==$cuda.*" "nvidia-curand<10.5"
      # the layout FlashInfer's link line expects: lib64/, an unversioned libcudart, and a libcuda
      # to link against (no driver here; the module resolves it where it runs)
      cu=$site/nvidia/cu13
      ln -sfn lib "$cu/lib64"
      ln -sf libcudart.so.13 "$cu/lib/libcudart.so"
      mkdir -p "$cu/lib/stubs"
      echo "" | gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -x c -o "$cu/lib/stubs/libcuda.so" -
    fi
    if [ ! -f "$site/nvidia/cu13/include/cublasLt.h" ]; then
      # the fused kernels' modules include cuBLASLt's headers (nothing of it is linked): the
      # headers alone, out of its wheel
      tmp=$(mktemp -d)
      .venv/bin/python -m pip download -q --no-deps -d "$tmp" "nvidia-cublas==$cuda.*"
      unzip -q -o "$tmp"/nvidia_cublas-*.whl 'nvidia/cu13/include/*' -d "$site"
      rm -rf "$tmp"
    fi
    CUDA_HOME=$site/nvidia/cu13 PATH=$site/bin:$site/nvidia/cu13/bin:$PATH PYTHONPATH=$site \
      LD_LIBRARY_PATH=$site/nvidia/cu13/lib FLASHINFER_CUDA_ARCH_LIST=9.0a \
      FLASHINFER_WORKSPACE_BASE=$PWD/.fibuild MAX_JOBS=${MAX_JOBS:-$(nproc)} \
      .venv/bin/python scripts/bench_kernels.py prebuild "$@"
    ;;
  join)
    # the bundle's modules and the parts' together (a module in both: the parts' copy)
    mkdir -p .fiaot
    stage=$(mktemp -d)
    [ -f .fiaot/fi_aot.tar.xz ] && tar -xJf .fiaot/fi_aot.tar.xz -C "$stage"
    cat "$2"/fi_aot.tgz.part* | tar -xzf - -C "$stage"
    tar -cf - -C "$stage" . | xz -9e -T2 > .fiaot/fi_aot.tar.xz.new
    mv .fiaot/fi_aot.tar.xz.new .fiaot/fi_aot.tar.xz
    rm -rf "$stage" .fiaot/fi_aot.tgz
    echo ".fiaot/fi_aot.tar.xz: $(tar -tJf .fiaot/fi_aot.tar.xz | grep -c '^\./[^/]*/$') modules"
    ;;
  *)
    sed -n 2,16p "$0"; exit 2
    ;;
esac
