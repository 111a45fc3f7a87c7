#!/usr/bin/env bash
# Tensor-parallel GPT (tp = 4, with and without a codec on its sums) and the DLRM hybrid (with
# and without DCT) on the thin-wire testbed at 100 Mbit/s and 1 Gbit/s, each against DP of the
# same model. As root from the repository root (without namespaces `thinwire bench` says why and
# runs in modelled mode). Tables: runs/tb_tensor/bench.md, runs/tb_dlrm/bench.md.
set -euo pipefail
tw=${THINWIRE:-.venv/bin/thinwire}
uptime
$tw bench --link 100mbit,1gbit --workers 4 --model gpt --data.dir ../shared/data/tinyshakespeare \
  --model.n_layer 2 --model.d_model 128 --model.n_head 4 --parallel.tp 4 \
  --methods "tensor,tensor:codec=int8,tensor:codec=topk:ratio=0.1,dp:parallel.tp=1" \
  --steps 40 --train.eval_every 20 --train.batch_size 16 --timeout 560 \
  --out runs/tb_tensor --overwrite --no-progress
uptime
$tw bench --link 100mbit,1gbit --workers 4 --model dlrm --data clicks \
  --methods "hybrid,hybrid:dct=true,dp" --steps 200 --train.eval_every 50 \
  --train.batch_size 128 --train.optimizer adamw --train.lr 0.003 --timeout 400 \
  --out runs/tb_dlrm --overwrite --no-progress
uptime
