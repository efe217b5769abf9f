#!/usr/bin/env bash
# Build the vLLM 0.26.0 payload for the lent GPU machine (H200, no network) and split it into
# pieces that fit one `run` call each:
#
#     bash tools/gpu_vllm/prepare.sh        (from the repo root; needs pip reaching PyPI, xz, strip)
#
# The pieces land in .gpu/ (git-ignored): .gpu/p1/core.txz.aa (+ .ab ... in p2 ... with a smaller
# PIECE_MB). The core is ~40 MiB, FlashAttention-3 included (vLLM 0.26's Qwen2 module imports
# vllm_flash_attn, which refuses to import without an FA2 or FA3 extension; FA3's 141 MiB
# compress to ~7.5 MiB). With treadle's own wheels (tools/gpu_wheels.sh .cache/gpu_wheels,
# ~17 MiB) and the tracked files (~3 MiB) it travels in one call:
# carry=[".gpu/p1", ".cache/gpu_wheels"].
#
# Env knobs:
#   PIECE_MB   size of one piece in MiB (default 44)
#   OUT_DIR    where the pieces go (default .gpu; must be git-ignored)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PIECE_MB=${PIECE_MB:-44}
OUT_DIR=${OUT_DIR:-.gpu}
WORK=${WORK:-/tmp/vllm-prep}
PY=${PY:-python3}
PIPFLAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64)

mkdir -p "$WORK/wheels"
mapfile -t REQS < <(grep -v '^#' "$HERE/wheels.txt" | awk 'NF{print $1}')
echo "== download ${#REQS[@]} wheels"
PIP_CONSTRAINT= $PY -m pip download -q "${PIPFLAGS[@]}" -d "$WORK/wheels" "${REQS[@]}"
ls -l "$WORK/wheels"

echo "== install into $WORK/site (no deps, no bytecode)"
rm -rf "$WORK/site"
PIP_CONSTRAINT= $PY -m pip install -q "${PIPFLAGS[@]}" --no-compile --target "$WORK/site" "$WORK"/wheels/*.whl
V="$WORK/site/vllm"

echo "== trim vllm"
# Not needed for dense bf16 models on an H200 (all optional imports in vllm):
#   FA2 (sm80 attention), MoE kernels, the Rust frontend binary, FlashMLA,
#   QuTLASS, DeepGEMM + SM100 FMHA sources/headers, tool-parser and spinloop
#   extensions, the fs KV-offload extension.
rm -f "$V"/vllm_flash_attn/_vllm_fa2_C.abi3.so "$V"/_moe_C_stable_libtorch.abi3.so \
  "$V"/vllm-rs "$V"/_flashmla_C.abi3.so "$V"/_flashmla_extension_C.abi3.so \
  "$V"/_qutlass_C.abi3.so "$V"/_rust_tool_parser.abi3.so "$V"/spinloop.abi3.so \
  "$V"/fs_io_C.abi3.so
rm -rf "$V"/third_party/deep_gemm "$V"/third_party/fmha_sm100
# Drop the static symbol tables (the dynamic ones stay) and keep only the
# sm_90 device code of the main kernel library (FA3 is sm_90a only already).
strip --strip-unneeded "$V"/_C_stable_libtorch.abi3.so "$V"/vllm_flash_attn/_vllm_fa3_C.abi3.so
$PY "$HERE/prune_fatbin.py" "$V"/_C_stable_libtorch.abi3.so "$V"/_C_stable_libtorch.abi3.so 90
find "$WORK/site" -name __pycache__ -prune -exec rm -rf {} +
du -sb "$WORK/site"

echo "== pack"
tar -C "$WORK" -cf - site | xz -9 -T0 > "$WORK/core.txz"
ls -l "$WORK/core.txz"
rm -rf "$OUT_DIR"/p[0-9]* "$OUT_DIR"/fa3 "$OUT_DIR"/split
mkdir -p "$OUT_DIR/split"
split -b "${PIECE_MB}M" -a 2 "$WORK/core.txz" "$OUT_DIR/split/core.txz."
(cd "$WORK" && sha256sum core.txz) > "$WORK/SHA256SUMS.core"
{ echo "# pieces install_on_device.sh waits for"; (cd "$OUT_DIR/split" && ls core.txz.*); } > "$WORK/MANIFEST"
i=0
for f in "$OUT_DIR"/split/core.txz.*; do
  i=$((i+1)); mkdir -p "$OUT_DIR/p$i"; mv "$f" "$OUT_DIR/p$i/"
  cp "$WORK/MANIFEST" "$WORK/SHA256SUMS.core" "$OUT_DIR/p$i/"
done
rmdir "$OUT_DIR/split"
echo "== pieces (carry each folder once, in calls while the machine stays warm):"
du -ab "$OUT_DIR" | sort -k2
cat "$WORK/MANIFEST"
