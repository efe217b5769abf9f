#!/bin/bash
# Fetch the wheels the GPU machine lacks (it reaches no package index) into DIR, for
# `bash tools/gpu_tests.sh DIR...` there:
#
#     bash tools/gpu_wheels.sh DIR [--fa4]
#
# The GPU machine (Python 3.12, torch 2.11 CUDA 13, transformers, numpy, msgpack, pyyaml, psutil,
# ninja, peft, pandas, pyarrow, ...) lacks treadle-common's msgspec, pyzmq, tyro and uvloop, DeepSpeed with
# its pure-Python needs, and datasets (the trainers' data files) with its own. Versions are those
# of this checkout's .venv (`make venv`), so both machines
# run the same code; DeepSpeed is built here as a pure-Python wheel (its CUDA ops JIT-build there).
#
# --fa4: also FlashAttention-4 (flash-attn-4, treadle_varlen's fastest kernel on Hopper) and the
# CUTLASS DSL it compiles with, into DIR/fa4 (10 MB) and DIR_big (64 MB, beside DIR): the DSL's
# CUDA 13 libraries are 237 MB unpacked, so its two large files travel xz-compressed, named by
# where they go (`--` for `/`), and the rest of that wheel as a plain zip. DIR_big is as much as
# one device call carries: carry it alone first (a call that only unpacks it, `tools/gpu_tests.sh`
# does), then DIR in the next call while the machine is warm (docs/benchmarks.md, session 10).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: bash tools/gpu_wheels.sh DIR [--fa4]}
DIR=$(mkdir -p "$DIR" && cd "$DIR" && pwd)
PY=${PY:-$PWD/.venv/bin/python}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pinned() {  # NAME==VERSION as installed in .venv
  "$PY" -c "import importlib.metadata as m, sys; print(*(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" "$@"
}
fetch() {  # DEST REQUIREMENT...
  local dest=$1
  shift
  "$PY" -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dest" "$@"
}
# shellcheck disable=SC2046 # one word per requirement
fetch "$DIR" $(pinned msgspec pyzmq tyro docstring-parser typeguard typing-extensions hjson pydantic \
  pydantic-core annotated-types typing-inspection py-cpuinfo einops datasets dill multiprocess xxhash fsspec uvloop)
ls "$DIR"/deepspeed-*.whl >/dev/null 2>&1 ||
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$(pinned deepspeed)"
if [ "${2:-}" = "--fa4" ]; then
  CUTLASS=4.8.1
  mkdir -p "$DIR/fa4" "${DIR}_big"
  fetch "$DIR/fa4" flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
    torch-c-dlpack-ext==0.1.5 nvidia-cutlass-dsl==$CUTLASS nvidia-cutlass-dsl-libs-base==$CUTLASS \
    nvidia-cutlass-dsl-libs-core==$CUTLASS
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  fetch "$tmp" nvidia-cutlass-dsl-libs-cu13==$CUTLASS
  (cd "$tmp" && "$PY" -m zipfile -e nvidia_cutlass_dsl_libs_cu13-*.whl unpacked)
  for big in $(cd "$tmp/unpacked" && find . -type f -size +10M | sed 's|^\./||'); do
    xz -9e -T2 -c "$tmp/unpacked/$big" > "${DIR}_big/${big//\//--}.xz"
    rm "$tmp/unpacked/$big"
  done
  (cd "$tmp/unpacked" && "$PY" -m zipfile -c "$DIR/fa4/nvidia_cutlass_dsl_libs_cu13-$CUTLASS-rest.zip" .)
fi
du -sh "$DIR" "$DIR"/fa4 "${DIR}_big" 2>/dev/null || true
