#!/usr/bin/env bash
# Every check that needs a CUDA device, in one bounded run (about 10 minutes on one GPU):
#   1. every gpu-marked test (tests/test_gpu.py and the models', pipeline's and tensor method's
#      GPU tests): the device rule under nccl, 2 ranks on one device through gloo, codecs and
#      memory options on CUDA; the nccl test of >= 2 devices skips, saying so, on one;
#   2. the codec throughput benchmark on the device (1M and 16M floats);
#   3. one GPT size's step time and peak memory against `thinwire plan` (h200 preset unless
#      CLUSTER says otherwise).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default runs/gpu_check; PY=... for another python)
# Each part's output goes to OUT_DIR/*.txt and the terminal; the exit status is non-zero when
# any part failed. docs/benchmarks/gpu.md ("Checks on a CUDA device") records what it printed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CLUSTER=${CLUSTER:-h200}
out=${1:-runs/gpu_check}
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
status=0

part() {  # part NAME SECONDS COMMAND...: run with a deadline, keep its output, note failure
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S) UTC, limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" = 0 ] || status=1
}

{
  date -u
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count())"
  cat /proc/loadavg
} | tee "$out/device.txt"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible: nothing to check here" | tee -a "$out/device.txt"
  exit 2
fi

part gpu_tests 420 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gpu.py \
  tests/strategies/test_tensor_gpu.py tests/strategies/pipeline/test_pipeline_gpu.py tests/models/test_gpt.py \
  tests/models/test_resnet.py tests/models/test_gcn.py
part codecs 150 "$PY" benchmarks/compress_throughput.py --device cuda --sizes 1M,16M --repeats 5
part gpt_vs_plan 90 "$PY" benchmarks/gpt_step_vs_plan.py --device cuda --cluster "$CLUSTER"
echo "gpu_check: $([ $status = 0 ] && echo all parts passed || echo some part failed); outputs in $out"
exit $status
