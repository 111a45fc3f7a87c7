#!/usr/bin/env bash
# IST's accuracy ceiling on Fashion-MNIST (MLP 784-1024-1024-10, 4 workers, 2400 steps):
# where plain IST plateaus against DP and local SGD, and what closes the gap.
# Prints three tables (thinwire compare); `thinwire report DIR...` re-prints any of them.
set -euo pipefail
tw=${THINWIRE:-thinwire}
common=(--config configs/demo.toml --train.steps 2400 --train.eval_every 120 --no-progress)
# 1. the plateau, and remedies within IST: cosine schedule, more local steps, a hybrid switch
$tw compare "${common[@]}" --run.out runs/ceil1 \
  --methods "dp,localsgd,ist,ist:train.schedule=cosine,ist:local_steps=20,ist:switch_at=1200"
# 2. more remedies: a larger learning rate, an earlier switch; and the same net without
#    BatchNorm (IST with inverted-dropout scaling, sharded) against DP without BatchNorm
$tw compare "${common[@]}" --run.out runs/ceil2 \
  --methods "ist:train.lr=0.2,ist:train.lr=0.2,train.schedule=cosine,ist:switch_at=600,ist:deployment=sharded,model.norm=none,scale=dropout,dp:model.norm=none"
# 3. one hidden layer (no hidden-to-hidden matrix left idle by the partition)
$tw compare --config configs/demo.toml --model.hidden 1024 --train.steps 2400 \
  --train.eval_every 240 --no-progress --run.out runs/ceil3 --methods "dp,ist"
