#!/usr/bin/env bash
# Distributed SLIDE against dense model parallelism (dense-mp: the same sharded layer with every
# neuron active, the paper's Horovod-style baseline) and dense data parallelism (dp) on xmlp,
# on the thin-wire testbed at 100 Mbit/s and 1 Gbit/s. As root from the repository root, under
# the testbed lock (without namespaces `thinwire bench` says why and runs in modelled mode).
# WIDTH (default 10000) is the output width; WORKERS (default 2); STEPS (default 100); EVAL
# (evaluate every EVAL steps, default STEPS: time to a precision is read at evaluations);
# METHODS (default slide,slide:lower=replicate,dense-mp,dp); LINKS (default 100mbit,1gbit);
# ZIPF (xc-synth's popularity exponent, default 0.6: the generator's); LR (AdamW, default
# 0.001); OUT (default runs/tb_slide_$WIDTH); RUN_TIMEOUT (seconds the bench may take, default
# 580). Table: $OUT/bench.md.
set -euo pipefail
tw=${THINWIRE:-.venv/bin/thinwire}
width=${WIDTH:-10000}
steps=${STEPS:-100}
cat /proc/loadavg
$tw bench --link "${LINKS:-100mbit,1gbit}" --workers "${WORKERS:-2}" --model xmlp --data xc-synth \
  --data.labels "$width" --data.zipf "${ZIPF:-0.6}" \
  --methods "${METHODS:-slide,slide:lower=replicate,dense-mp,dp}" \
  --steps "$steps" --train.eval_every "${EVAL:-$steps}" --train.optimizer adamw \
  --train.lr "${LR:-0.001}" --timeout "${RUN_TIMEOUT:-580}" --out "${OUT:-runs/tb_slide_$width}" \
  --overwrite --no-progress
cat /proc/loadavg
