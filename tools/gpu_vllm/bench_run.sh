#!/usr/bin/env bash
# One device call for the GPU benchmarks: install (vLLM pieces + treadle's wheels + EXTRA wheel folders), then PHASES:
#   liger: bench_gpu_trainer 1.35B tuned / tuned_eager / eager_liger (1 GPU)
#   sync: bench_grpo_vs_trl --which both (benchmark 3, synchronous)
#   async: bench_grpo_vs_trl --staleness 1 --which both
#   vllmsuite: the vLLM backend's GPU tests (TREADLE_GPU_SUITE=vllm bash tools/gpu_tests.sh)
#   ipc1: benchmark 2, the cuda_ipc sync into a vLLM daemon against a raw IPC copy (TREADLE_GPU_BENCH=ipc1)
#   pytest: `pytest -m gpu $PYTEST_ARGS -k "$PYTEST_K"`, e.g. the Liger GPU test:
#     PYTEST_ARGS=packages/trainer/tests/test_gpu.py PYTEST_K=liger
# Results under $OUT/r, tarred to $OUT/r.tgz (a call brings back few files).
# EXTRA: wheel folders beside .cache/gpu_wheels, e.g. liger-kernel 0.8.5 and trl 1.16.0 fetched with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` (device README); carry them too:
#   run(command="EXTRA='.cache/liger .cache/trl' PHASES='liger async' bash tools/gpu_vllm/bench_run.sh",
#       carry=[".gpu/p1", ".cache/gpu_wheels", ".cache/liger", ".cache/trl"])
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r"
T0=$(date +%s); left() { echo $((${LIMIT:-580} - ($(date +%s) - T0))); }
ts() { echo "[t+$(($(date +%s) - T0))s] $*"; }
finish() { tar czf "$OUT/r.tgz" -C "$OUT" r; ts end; }
trap finish EXIT
if [ ! -f /tmp/treadle_gpu_site/.ok ]; then
  ts install
  TESTS=0 STAGES="" OUT=$OUT/r/inst LIMIT=200 bash tools/gpu_vllm/device_run.sh > "$OUT/r/install.log" 2>&1 || { tail -20 "$OUT/r/install.log"; exit 1; }
  TREADLE_GPU_UNPACK_ONLY=1 bash tools/gpu_tests.sh ${EXTRA:-} >> "$OUT/r/install.log" 2>&1 || { tail -5 "$OUT/r/install.log"; exit 1; }
  touch /tmp/treadle_gpu_site/.ok
fi
SITE=/tmp/treadle_gpu_site
SRC=$PWD/packages/common/src:$PWD/packages/rollout/src:$PWD/packages/rewards/src:$PWD/packages/trainer/src:$PWD/packages/agents/src:$PWD/tools/testing
export PYTHONPATH=$SRC:$SITE
source tools/gpu_vllm/env.sh
export TORCH_EXTENSIONS_DIR=/tmp/treadle_torch_ext TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4 PATH=$SITE/bin:$PATH
ts "installed; python $(python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)')"
for ph in ${PHASES:-liger}; do
  case $ph in
    vllmsuite)
      ts "vllm suite ($(left) s left)"
      TREADLE_GPU_SUITE=vllm TREADLE_GPU_PYTEST_ARGS=-rA timeout $(( $(left) - 15 )) bash tools/gpu_tests.sh > "$OUT/r/vllm_suite.log" 2>&1
      echo "rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/r/vllm_suite.log" | tail -40 ;;
    ipc1)
      ts "ipc1 bench, vllm ($(left) s left)"
      TREADLE_GPU_BENCH=ipc1 TREADLE_GPU_OUT=$OUT/r/ipc1 TREADLE_GPU_BENCH_ARGS="--repeats ${REPEATS:-3} --backend vllm" \
        timeout $(( $(left) - 15 )) bash tools/gpu_tests.sh > "$OUT/r/ipc1.log" 2>&1
      echo "rc=$?"; tail -25 "$OUT/r/ipc1.log" ;;
    pytest)
      ts "pytest $PYTEST_ARGS ($(left) s left)"
      export TRITON_F32_DEFAULT=ieee  # as gpu_tests.sh: the fp32 tests need IEEE matmuls in vLLM's Triton kernels
      # shellcheck disable=SC2086 # pytest words
      timeout $(( $(left) - 15 )) python3 -m pytest -q -m gpu -p no:randomly -p no:cacheprovider -rA $PYTEST_ARGS ${PYTEST_K:+-k "$PYTEST_K"} \
        > "$OUT/r/pytest.log" 2>&1
      echo "rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" "$OUT/r/pytest.log" | tail -30 ;;
    liger)
      ts "liger sweep ($(left) s left)"
      timeout $(( $(left) - 15 )) python3 tools/bench/bench_gpu_trainer.py --nproc 1 \
        --sweep "${SWEEP:-1.35b:tuned,1.35b:tuned_eager,1.35b:eager_liger}" \
        --deadline-s $(( $(left) - 25 )) --json "$OUT/r/liger.json" --log "$OUT/r/liger.log" 2>&1 | tail -30 ;;
    sync)
      ts "sync bench ($(left) s left)"
      timeout $(( $(left) - 15 )) python3 tools/bench/bench_grpo_vs_trl.py --device cuda --preset qwen0.5b \
        --prompts-per-step 32 --group-size 8 --max-new-tokens 256 --micro-batch 32 --steps 4 --warmup-steps 1 \
        --which ${WHICH:-both} --json "$OUT/r/sync.json" > "$OUT/r/sync.log" 2>&1
      echo "rc=$?"; grep -v "^\s*$" "$OUT/r/sync.log" | tail -40 ;;
    async)
      ts "async bench ($(left) s left)"
      timeout $(( $(left) - 15 )) python3 tools/bench/bench_grpo_vs_trl.py --device cuda --preset qwen0.5b \
        --prompts-per-step 32 --group-size 8 --max-new-tokens 256 --micro-batch 32 --steps 4 --warmup-steps 1 \
        --staleness 1 --which ${WHICH:-both} --json "$OUT/r/async.json" > "$OUT/r/async.log" 2>&1
      echo "rc=$?"; grep -v "^\s*$" "$OUT/r/async.log" | tail -40 ;;
  esac
done
