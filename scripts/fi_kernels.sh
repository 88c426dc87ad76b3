#!/usr/bin/env bash
# FlashInfer's compiled kernels, carried from one GPU call to the next in .fiaot/ (git-ignored),
# so that a fresh machine skips their JIT compile (minutes for fa3 and XQA).
#
#   bash scripts/fi_kernels.sh unpack AOT_DIR        # on the GPU: .fiaot/fi_aot.* into FlashInfer's
#                                                    # AOT directory
#   bash scripts/fi_kernels.sh pack AOT_DIR JIT_DIR OUT
#                                                    # on the GPU: those modules and the ones compiled
#                                                    # now under JIT_DIR -> OUT/fi_aot.tgz.partNN, parts
#                                                    # of 15 MiB (the most a call returns per file)
#   bash scripts/fi_kernels.sh join DIR              # here: the parts a call returned in DIR ->
#                                                    # .fiaot/fi_aot.tar.xz (about 60% of gzip's size)
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
    find "$jit" -path '*cached_ops*' -name '*.so' 2>/dev/null | while read -r so; do
      name=$(basename "$so" .so); mkdir -p "$stage/$name"; cp "$so" "$stage/$name/"
    done
    [ -n "$(ls -A "$stage")" ] || exit 0
    tar -czf - -C "$stage" . | split -b 15m -d - "$out/fi_aot.tgz.part"
    ls -la "$out"/fi_aot.tgz.part*
    ;;
  join)
    mkdir -p .fiaot
    cat "$2"/fi_aot.tgz.part* | gzip -dc | xz -9e -T2 > .fiaot/fi_aot.tar.xz.new
    mv .fiaot/fi_aot.tar.xz.new .fiaot/fi_aot.tar.xz
    rm -f .fiaot/fi_aot.tgz
    ls -la .fiaot
    ;;
  *)
    sed -n 2,12p "$0"; exit 2
    ;;
esac
