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
# daemon), ring attention equality over NCCL, the engine's NCCL receive, and PPO with an hf engine
# on the trainer's GPU (weights over CUDA IPC and over gloo; one GPU is enough for these).
# With vLLM carried (tools/gpu_vllm: .gpu/p1, or already unpacked in /tmp/site) also the vLLM
# backend on CUDA: the rollout conformance suite, bf16 logprobs against the HF model, sleep levels,
# a daemon of vllm engines. TREADLE_GPU_SUITE=vllm runs only those (one GPU is enough).
set -euo pipefail
cd "$(dirname "$0")/.."
# `tools/gpu_wheels.sh DIR --fa4` adds FlashAttention-4: pass DIR/fa4 and DIR_big too (a zip is
# unpacked as is; FILE.xz is decompressed to the path its name gives, `--` for `/`). DIR_big fills
# a device call alone: `TREADLE_GPU_UNPACK_ONLY=1 bash tools/gpu_tests.sh DIR_big` unpacks it into
# the site folder and stops; the next call (same machine, still warm) passes the others.
SITE=${TREADLE_GPU_SITE:-/tmp/treadle_gpu_site}
mkdir -p "$SITE"
shopt -s nullglob
for dir in "$@"; do
  for f in "$dir"/*.whl "$dir"/*.zip "$dir"/*.xz; do
    case "$f" in
      # plain unpacks: DeepSpeed (pure Python, JIT ops); the CUTLASS DSL's wheels share one folder,
      # which pip --target would not merge
      *deepspeed-*|*nvidia_cutlass_dsl*.whl|*.zip) python3 -m zipfile -e "$f" "$SITE" ;;
      *.xz) to=$SITE/$(basename "$f" .xz); to=${to//--//}; mkdir -p "$(dirname "$to")"; xz -d -c "$f" > "$to" ;;
      *) python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$f" ;;
    esac
  done
done
[ -n "${TREADLE_GPU_UNPACK_ONLY:-}" ] && exit 0
SRC=$PWD/packages/common/src:$PWD/packages/rollout/src:$PWD/packages/rewards/src:$PWD/packages/trainer/src:$PWD/packages/agents/src:$PWD/tools/testing
# the CUTLASS DSL's .pth (which --target does not run) puts its dsl_packages on the path
export PYTHONPATH=$SRC:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off on shared hosts; tool caches stay out of the home folder.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 \
  TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/treadle_torch_ext} TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
VLLM_TESTS=()
if [ -d "${TREADLE_GPU_VLLM:-.gpu}/p1" ] || [ -f /tmp/site/.vllm-ok ]; then
  bash tools/gpu_vllm/install_on_device.sh "${TREADLE_GPU_VLLM:-.gpu}"
  # shellcheck source=tools/gpu_vllm/env.sh
  source tools/gpu_vllm/env.sh
  # vLLM's Triton attention multiplies fp32 in TF32 unless told otherwise: the fp32 tests need IEEE
  export TRITON_F32_DEFAULT=ieee
  VLLM_TESTS=(packages/rollout/tests/test_gpu_vllm.py packages/rollout/tests/daemon/test_gpu_daemon_vllm.py)
fi
if [ "${TREADLE_GPU_SUITE:-}" = vllm ]; then
  [ ${#VLLM_TESTS[@]} -gt 0 ] || { echo "TREADLE_GPU_SUITE=vllm: no vLLM here (carry .gpu/p1, tools/gpu_vllm)" >&2; exit 2; }
  # shellcheck disable=SC2086 # extra pytest words
  exec python3 -m pytest -q -m gpu -p no:cacheprovider -p no:randomly "${VLLM_TESTS[@]}" ${TREADLE_GPU_PYTEST_ARGS:-} ${TREADLE_GPU_K:+-k "$TREADLE_GPU_K"}
fi
# TREADLE_GPU_K="expr" selects tests as pytest's -k does (TREADLE_GPU_PYTEST_ARGS splits on spaces).
# TREADLE_GPU_BENCH=sync|ipc1|trainer runs issue 10's benchmarks instead of the tests (each fits one
# device call), writing into TREADLE_GPU_OUT (default: the device's $OUT, else bench_out/):
#   sync: the weight-sync bench on 2 GPUs, after 50 ms idle (as after training) and back to back;
#   trainer: the 1.35B SFT / PPO steps on every GPU, defaults / tuned / tuned_fa2, then defaults
#   on rows of changing lengths (--varied).
dest=${TREADLE_GPU_OUT:-${OUT:-bench_out}}
case "${TREADLE_GPU_BENCH:-}" in
  sync)
    mkdir -p "$dest"
    for idle in 50 0; do
      rc=0; timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tools/bench/bench_gpu_weight_sync.py \
        --repeats 7 --idle-ms $idle --json "$dest/weight_sync_idle$idle.json" > "$dest/weight_sync_idle$idle.log" 2>&1 || rc=$?
      echo "weight sync, idle $idle ms: rc=$rc"; grep -E "^(correctness|[a-z_]+/|[a-z_]+ +[0-9]|[a-z_]+: end-to-end)" \
        "$dest/weight_sync_idle$idle.log" | tail -30 || true
    done
    exit 0 ;;
  ipc1)
    # one GPU: the cuda_ipc sync from a 1-rank ZeRO-3 trainer against a raw IPC copy (nothing
    # crosses NVLink); TREADLE_GPU_BENCH_ARGS adds flags (--profile DIR, --host-profile DIR, ...)
    mkdir -p "$dest"
    rc=0; timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node 1 tools/bench/bench_gpu_weight_sync.py \
      --repeats 7 --json "$dest/weight_sync_1gpu.json" ${TREADLE_GPU_BENCH_ARGS:-} > "$dest/weight_sync_1gpu.log" 2>&1 || rc=$?
    echo "weight sync, 1 GPU: rc=$rc"; grep -E "^(correctness|[a-z_]+/|[a-z_]+ +[0-9]|[a-z_]+: end-to-end)" \
      "$dest/weight_sync_1gpu.log" | tail -30 || true
    exit $rc ;;
  trainer)
    mkdir -p "$dest"
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    # each bench runs even when the one before failed; the script's status is the worse of the two
    rc=0
    python3 tools/bench/bench_gpu_trainer.py --nproc "$gpus" --deadline-s 400 \
      --sweep 1.35b:defaults:24,1.35b:tuned:24,1.35b:tuned_fa2:24 --json "$dest/trainer.json" --log "$dest/trainer.log" || rc=$?
    python3 tools/bench/bench_gpu_trainer.py --nproc "$gpus" --deadline-s 150 --varied --steps 8 \
      --sweep 1.35b:defaults:24 --json "$dest/trainer_varied.json" --log "$dest/trainer_varied.log" || rc=$?
    exit $rc ;;
  "") ;;
  *) echo "TREADLE_GPU_BENCH must be sync, ipc1 or trainer, got ${TREADLE_GPU_BENCH}" >&2; exit 2 ;;
esac
exec python3 -m pytest -q -m gpu -p no:cacheprovider -p no:randomly \
  packages/trainer/tests/test_gpu.py packages/trainer/tests/test_gpu_weights.py packages/trainer/tests/test_ring.py \
  packages/trainer/tests/test_ppo.py packages/rollout/tests/test_gpu.py "${VLLM_TESTS[@]}" ${TREADLE_GPU_PYTEST_ARGS:-} \
  ${TREADLE_GPU_K:+-k "$TREADLE_GPU_K"}
