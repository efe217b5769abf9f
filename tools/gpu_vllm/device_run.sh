#!/usr/bin/env bash
# One device call: vLLM (prepare.sh's pieces) and treadle's GPU wheels (tools/gpu_wheels.sh)
# unpacked, treadle's vLLM GPU tests, then (time left) a vLLM generation smoke; logs under $OUT.
#
#   run(command="bash tools/gpu_vllm/device_run.sh", carry=[".gpu/p1", ".cache/gpu_wheels"])
#
# With more pieces (a smaller PIECE_MB), carry them in earlier calls of this same script while the
# machine stays warm: each call stores its piece in /tmp and the one that completes the set goes on.
#   TESTS   1 (default): tools/gpu_tests.sh's vLLM tests (TREADLE_GPU_SUITE=vllm); PYTEST_ARGS adds
#           words to pytest's (e.g. --deselect packages/rollout/tests/daemon)
#   STAGES  smoke stages afterwards, in order (default "compiled"; "" for none), each smoke.py on a
#           random 0.5B / 1.5B Qwen2 shape: eager | compiled (gen phase, eager / torch.compile +
#           CUDA graphs) | all (gen, sleep, reload, ipc phases, eager) | big | bigc (1.5B)
#   SMOKE_S seconds one stage may take (default 220; a stage needs 150 left to start)
#   WHEELS  treadle's wheel folder (default .cache/gpu_wheels)
#   LIMIT   seconds the whole script may take (default 570; a call runs 600 at most)
set -uo pipefail
cd "$(dirname "$0")/../.."
KIT=tools/gpu_vllm
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
ts() { echo "[t+$(($(date +%s) - T0))s] $*"; }
left() { echo $((${LIMIT:-570} - ($(date +%s) - T0))); }

ts install
bash $KIT/install_on_device.sh .gpu > "$OUT/install.log" 2>&1
rc=$?
tail -3 "$OUT/install.log"
if [ $rc = 3 ]; then ts "pieces stored in /tmp/vllm-pieces; carry the next one"; exit 0; fi
[ $rc = 0 ] || exit 1
TREADLE_GPU_UNPACK_ONLY=1 bash tools/gpu_tests.sh "${WHEELS:-.cache/gpu_wheels}" >> "$OUT/install.log" 2>&1 ||
  { tail -5 "$OUT/install.log"; exit 1; }
# shellcheck source=tools/gpu_vllm/env.sh
source $KIT/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ "${TESTS:-1}" = 1 ]; then
  s=$(left)
  ts "vLLM GPU tests (${s}s left)"
  TREADLE_GPU_SUITE=vllm TREADLE_GPU_PYTEST_ARGS="-vv -rA --durations=15 ${PYTEST_ARGS:-}" timeout $((s - 5)) \
    bash tools/gpu_tests.sh > "$OUT/tests.log" 2>&1
  echo "rc=$?"
  grep -E "::test_.* (PASSED|FAILED|ERROR|SKIPPED)|^(FAILED|ERROR) packages|^(bf16|greedy|vllm |daemon|GPU free)|[0-9]+ (passed|failed|error)" "$OUT/tests.log" |
    cut -c1-250 | tail -60
fi
for st in ${STAGES-compiled}; do
  case $st in
    eager) a=(--phases gen) ;;
    compiled) a=(--eager 0 --phases gen) ;;
    all) a=(--phases gen,sleep,reload,ipc) ;;
    big) a=(--shape 1.5b --phases gen) ;;
    bigc) a=(--shape 1.5b --eager 0 --phases gen) ;;
    *) ts "unknown stage $st"; continue ;;
  esac
  s=$(left)
  [ "$s" -lt 150 ] && { ts "skip smoke $st: ${s}s left"; continue; }
  budget=$((${SMOKE_S:-220} < s - 30 ? ${SMOKE_S:-220} : s - 30))
  ts "smoke $st (${budget}s)"
  # its own process group, ended whole afterwards: vLLM's engine core would outlive a killed smoke
  setsid python3 $KIT/smoke.py --tag "$st" --out "$OUT" --budget-s $((budget - 30)) "${a[@]}" \
    > "$OUT/smoke_$st.log" 2>&1 &
  pid=$!
  (sleep "$budget"; kill -TERM -- -"$pid" 2>/dev/null; sleep 15; kill -KILL -- -"$pid" 2>/dev/null) &
  watchdog=$!
  wait "$pid"
  echo "rc=$?"
  kill "$watchdog" 2>/dev/null
  kill -KILL -- -"$pid" 2>/dev/null
  grep -E "^(GEN|SLEEP|RELOAD|IPC)|Using .*backend|Error|Traceback" "$OUT/smoke_$st.log" | cut -c1-300 | tail -12
done

ts end
