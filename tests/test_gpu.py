"""GPU smoke tests (marker ``gpu``): the same strategies on CUDA with nccl.

Skipped where no CUDA device is visible. With one device a single worker runs (nccl needs one
device per rank); with two or more, two workers run and must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from thinwire.commands.common import run_config
from thinwire.config import load

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["dp", "localsgd", "ist"])
def test_strategy_trains_on_cuda_with_nccl(method: str, tmp_path: Path) -> None:
    workers = min(2, torch.cuda.device_count())
    cfg = load(None, {"method.name": method, "data.name": "digits", "model.hidden": "64,64",
                      "train.steps": "40", "train.eval_every": "20", "train.batch_size": "32",
                      "runtime.workers": str(workers), "runtime.device": "cuda",
                      "run.out": str(tmp_path), "run.progress": "false"})
    summary = run_config(cfg)
    assert summary["final"]["accuracy"] > 0.5
    if workers > 1:
        assert summary["bytes"]["sent_per_worker_max"] > 0
