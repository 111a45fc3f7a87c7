#!/usr/bin/env bash
# Distributed SLIDE against dense model parallelism (dense-mp: the same sharded layer with every
# neuron active, the paper's Horovod-style baseline) and dense data parallelism (dp) on xmlp,
# on the thin-wire testbed at 100 Mbit/s and 1 Gbit/s. As root from the repository root, under
# the testbed lock (without namespaces `thinwire bench` says why and runs in modelled mode).
# WIDTH (default 10000) is the output width; WORKERS (default 2); STEPS (default 100); LINKS
# (default 100mbit,1gbit); RUN_TIMEOUT (seconds a run may take, default 580).
# Table: runs/tb_slide_$WIDTH/bench.md.
set -euo pipefail
tw=${THINWIRE:-.venv/bin/thinwire}
width=${WIDTH:-10000}
cat /proc/loadavg
$tw bench --link "${LINKS:-100mbit,1gbit}" --workers "${WORKERS:-2}" --model xmlp --data xc-synth \
  --data.labels "$width" --methods "slide,slide:lower=replicate,dense-mp,dp" \
  --steps "${STEPS:-100}" --train.eval_every "${STEPS:-100}" --train.optimizer adamw \
  --train.lr 0.001 --timeout "${RUN_TIMEOUT:-580}" --out "runs/tb_slide_$width" --overwrite --no-progress
cat /proc/loadavg
