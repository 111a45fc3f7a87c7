"""GPU smoke tests (marker ``gpu``) of tensor and hybrid parallelism on CUDA with nccl.

Skipped where no CUDA device is visible. nccl needs one device per rank, so the tensor-parallel
degree and the hybrid's workers are the number of devices, capped at 2 (with one device both run
one worker: the sharding code on CUDA tensors, without messages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from thinwire.config import load
from thinwire.run import run_config

pytestmark = pytest.mark.gpu


def test_tensor_parallel_gpt_learns_on_cuda(tmp_path: Path) -> None:
    from harness import DATA

    workers = min(2, torch.cuda.device_count())
    cfg = load(None, {"model.name": "gpt", "method.name": "tensor", "parallel.tp": workers,
                      "method.sequence_parallel": "true", "data.name": "tinyshakespeare",
                      "data.dir": str(DATA / "tinyshakespeare"), "data.seq_len": "32",
                      "data.limit_test": "64", "model.n_layer": "2", "model.d_model": "64",
                      "train.steps": "40", "train.eval_every": "40", "train.batch_size": "16",
                      "train.optimizer": "adamw", "train.lr": "0.003",
                      "runtime.workers": str(workers), "runtime.device": "cuda",
                      "run.out": str(tmp_path), "run.progress": "false"})
    summary = run_config(cfg)
    assert summary["final"]["perplexity"] < 30  # uniform over 65 characters: 65


def test_hybrid_dlrm_with_dct_beats_majority_on_cuda(tmp_path: Path) -> None:
    workers = min(2, torch.cuda.device_count())
    cfg = load(None, {"model.name": "dlrm", "method.name": "hybrid", "method.dct": "true",
                      "method.every": "20", "data.train": "8192", "train.steps": "60",
                      "train.eval_every": "60", "train.batch_size": "128",
                      "train.optimizer": "adamw", "train.lr": "0.003",
                      "runtime.workers": str(workers), "runtime.device": "cuda",
                      "run.out": str(tmp_path), "run.progress": "false"})
    summary = run_config(cfg)
    assert summary["final"]["auc"] > 0.6  # majority class: 0.5
