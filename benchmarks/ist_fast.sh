#!/usr/bin/env bash
# IST's time to DP's converged accuracy on a thin wire (Fashion-MNIST, MLP 784-1024-1024-10
# with BatchNorm, 4 workers, batch 128, lr 0.05; configs/demo.toml).
# 1. loopback: accuracy against steps of DP, local SGD (H = 10, 30, 60) and IST variants,
#    3000 steps, evaluated every 60 (accuracy does not depend on the wire);
# 2. testbed, 100 Mbit/s (as root; serialised with other testbed users by a lock file):
#    measured wall time of the best local SGD and IST variants to the target, and DP's
#    measured time per step over a short run (its time to target is derived from it);
# 3. the tables and the figure: python benchmarks/ist_fast.py.
# About 60 min (loopback) + 18 min (testbed) on 2 shared cores.
set -euo pipefail
tw=${THINWIRE:-thinwire}
py=${PYTHON:-python}
out=${OUT:-runs/istfast}
lock=${TESTBED_LOCK:-/tmp/thinwire-testbed.lock}  # shared with other testbed users
common=(--config configs/demo.toml --train.steps 3000 --train.eval_every 60 --no-progress)
$tw compare "${common[@]}" --run.out "$out/acc" \
  --methods "dp,localsgd:period=10,localsgd:period=30,localsgd:period=60"
$tw compare "${common[@]}" --run.out "$out/accB" \
  --methods "ist:deployment=sharded,ist:deployment=sharded,switch_patience=3"
$tw compare "${common[@]}" --run.out "$out/accC" \
  --methods "ist:deployment=sharded,switch_patience=2,switch_tol=0.005,period=30,ist:deployment=sharded,switch_at=300,period=30"
# DP for 60 steps (its time per step) and local SGD (H = 30) towards the target; then the
# automatic hybrid for 1200 steps and plain IST for 600 (neither reaches the target in 3000
# steps on loopback: their times to lower targets)
tb=(--config configs/demo.toml --link 100mbit --workers 4 --train.eval_every 60 --target 0.8977)
flock "$lock" timeout 720 $tw bench "${tb[@]}" --timeout 700 --steps 2100 --out "$out/tb" \
  --methods "dp:train.steps=60,localsgd:period=30"
flock "$lock" timeout 600 $tw bench "${tb[@]}" --timeout 560 --steps 1200 --out "$out/tb2" \
  --methods "ist:deployment=sharded,switch_patience=2,switch_tol=0.005,period=30,ist:deployment=sharded,train.steps=600"
$py benchmarks/ist_fast.py --loopback "$out/acc" "$out/accB" "$out/accC" \
  --testbed "$out/tb/100mbit" "$out/tb2/100mbit"
