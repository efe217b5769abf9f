#!/bin/bash
# The GPU test suite (tests marked `gpu`) on a CUDA machine with 2 GPUs, in one command:
#
#     bash tools/gpu_tests.sh [WHEEL_DIR ...]
#
# The GPU machine has torch, transformers and CUDA but lacks some of treadle's dependencies
# (DeepSpeed, pyzmq, msgspec, tyro, ...) and reaches no package index: wheels for them, fetched
# elsewhere with `pip download`, are unpacked into a scratch folder put on PYTHONPATH, together
# with the packages' sources (nothing is installed into the machine's Python). A DeepSpeed wheel
# is unpacked as a zip (pure Python; its CUDA ops are JIT-built when used).
# Runs: the trainer's packed-attention equality per kernel, the ring's cuda_flash tiles against its
# math tiles, ZeRO-3 -> HF daemon weight sync over
# NCCL and CUDA IPC (bit-identical; NCCL gathers and peer reads; two senders taking turns on one
# daemon), ring attention equality over NCCL, the engine's NCCL receive.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${TREADLE_GPU_SITE:-/tmp/treadle_gpu_site}
mkdir -p "$SITE"
for dir in "$@"; do
  for whl in "$dir"/*.whl; do
    case "$whl" in
      *deepspeed-*) python3 -m zipfile -e "$whl" "$SITE" ;;
      *) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$whl" ;;
    esac
  done
done
SRC=$PWD/packages/common/src:$PWD/packages/rollout/src:$PWD/packages/rewards/src:$PWD/packages/trainer/src:$PWD/tools/testing
export PYTHONPATH=$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off on shared hosts; tool caches stay out of the home folder.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 \
  TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/treadle_torch_ext} TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
exec python3 -m pytest -q -m gpu -p no:cacheprovider -p no:randomly \
  packages/trainer/tests/test_gpu.py packages/trainer/tests/test_gpu_weights.py packages/trainer/tests/test_ring.py \
  packages/rollout/tests/test_gpu.py ${TREADLE_GPU_PYTEST_ARGS:-}
