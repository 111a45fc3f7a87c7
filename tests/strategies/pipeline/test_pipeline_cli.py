"""``thinwire train --method pipeline`` end to end: a GPT in two stages, each stage's blocks
tensor-parallel over two ranks, with compressed boundaries and int8 on the tensor-parallel sums,
trains, evaluates on its last stage, and every rank's ledger holds the predicted bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness import DATA

from thinwire.builders import load_data
from thinwire.config import load
from thinwire.measure.predict import run_layout, run_traffic


def test_train_gpt_in_two_tensor_parallel_stages_from_the_command_line(tmp_path: Path) -> None:
    args = ["train", "--model", "gpt", "--model.n_layer", "2", "--model.d_model", "16",
            "--model.n_head", "2", "--data.name", "tinyshakespeare",
            "--data.dir", str(DATA / "tinyshakespeare"), "--data.limit_train", "4096",
            "--data.limit_test", "256", "--method", "pipeline", "--parallel.pp", "2",
            "--parallel.tp", "2", "--workers", "4", "--method.schedule", "1f1b",
            "--method.micro_batches", "2",
            "--method.codec_fwd", "int8", "--method.codec_bwd", "lowrank:rank=4",
            "--method.tp_codec", "int8",
            "--train.steps", "4", "--train.eval_every", "4", "--train.batch_size", "8",
            "--out", str(tmp_path), "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "pipeline"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["label"].startswith(
        "gpt:pipeline(1f1b,M=2,fwd=int8,bwd=lowrank:rank=4,tp=int8)")
    assert 1 < summary["final"]["perplexity"] < 200  # a finite model, evaluated whole
    cfg = load(run / "config.toml")
    ds = load_data(cfg)
    want = run_traffic(cfg, run_layout(cfg, ds))  # the run's prediction from its config
    assert summary["bytes"]["per_rank_sent"] == list(want.sent)
    for rank in range(4):
        totals = json.loads((run / f"ledger.rank{rank}.json").read_text())["totals"]
        assert totals["payload_bytes"] == want.payload[rank]


def test_compare_specs_keep_codec_specs_whole() -> None:
    """``thinwire compare --methods`` across codecs: a codec spec with a colon stays the value
    of its method option; each spec becomes one validated config with its own run name."""
    from thinwire.run import method_configs, split_methods

    specs = split_methods("pipeline,pipeline:codec_fwd=int8,pipeline:codec_fwd=int4,"
                          "codec_bwd=lowrank:rank=8,pipeline:codec_fwd=ae:dim=16,dp,train.lr=0.1")
    assert specs == ["pipeline", "pipeline:codec_fwd=int8",
                     "pipeline:codec_fwd=int4,codec_bwd=lowrank:rank=8",
                     "pipeline:codec_fwd=ae:dim=16", "dp,train.lr=0.1"]
    cfgs = method_configs(specs[:4], None, {"model.name": "gpt", "data.name": "tinyshakespeare",
                                            "parallel.pp": "4", "runtime.workers": "4"})
    o = cfgs[2].method.options
    assert (o.codec_fwd, o.codec_bwd) == ("int4", "lowrank:rank=8")
    assert len({c.run_name for c in cfgs}) == 4
