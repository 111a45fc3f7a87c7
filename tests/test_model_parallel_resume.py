"""Resume of the model-parallel methods: a run cut at step 2 and resumed ends in exactly the
state of the uninterrupted run (bit for bit): tensor parallelism with sequence parallelism and an
error-feedback codec on the activations (residuals per call site), pipeline stages whose blocks
are tensor-parallel (2 stages x 2 tensor slices: each rank's slices, its optimizer, the
low-rank codec's lazy error and the int8 residuals of the tensor-parallel sums), and hybrid
DLRM training with DCT (thresholds and the DP residual)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  # before the ranks fork: each would import it at its first optimizer
from harness import DATA, assert_same_state, flat_state, run_workers

from thinwire.config import load
from thinwire.runtime.comm import Comm
from thinwire.trainer import Trainer


def _gpt() -> dict[str, Any]:
    return {"model.name": "gpt", "data.name": "tinyshakespeare",
            "data.dir": str(DATA / "tinyshakespeare"), "data.seq_len": 8,
            "data.limit_train": 128, "data.limit_test": 16, "model.n_layer": 1,
            "model.d_model": 16, "model.n_head": 2, "method.name": "tensor", "parallel.tp": 2,
            "method.sequence_parallel": True, "method.codec": "int8", "train.momentum": 0.9}


def _stages() -> dict[str, Any]:
    return {**_gpt(), "model.n_layer": 2, "method.name": "pipeline", "parallel.pp": 2,
            "method.sequence_parallel": None, "method.codec": None, "method.micro_batches": 2,
            "method.codec_bwd": "lowrank:rank=2", "method.tp_codec": "int8"}


CONFIGS = {
    "tensor+sp+int8": _gpt,
    "pipeline+tp+codecs": _stages,
    "hybrid+dct": lambda: {"model.name": "dlrm", "method.name": "hybrid", "method.dct": True,
                           "method.every": 3, "data.tables": 3, "data.rows": 20,
                           "data.train": 512, "data.test": 128, "model.dim": 4,
                           "model.bottom": "8", "model.top": "8", "train.momentum": 0.9},
}


def _train(comm: Comm, over: dict[str, Any], run_dir: str) -> dict[str, Any]:
    cfg = load(None, {**over, "runtime.workers": comm.world_size})
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    tr = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir))
    summary = tr.run()
    return {"final": summary["final"], "state": flat_state(tr.strategy.state_dict())}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_parallel_resume_equals_uninterrupted(name: str, tmp_path: Path) -> None:
    over = {k: v for k, v in CONFIGS[name]().items() if v is not None}
    base = {**over, "train.batch_size": 8, "train.steps": 4, "train.eval_every": 2,
            "run.checkpoint_every": 2, "run.out": str(tmp_path), "run.progress": False}
    n = over.get("parallel.pp", 1) * 2
    full = run_workers(_train, n, base, str(tmp_path / "full"))
    run_workers(_train, n, {**base, "train.steps": 2}, str(tmp_path / "cut"))
    res = run_workers(_train, n, {**base, "run.resume": True}, str(tmp_path / "cut"))
    for r in range(n):
        a, b = full[r]["state"], res[r]["state"]
        _, tensors = assert_same_state(a, b, r)
        assert tensors > 3
        assert any("residual" in k for k in a)  # the codec / DCT state is part of it
    assert full[0]["final"] == res[0]["final"]
