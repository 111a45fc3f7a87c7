"""The run layer's method specs (compare and bench), run names, data shards as the trainer
reads them, the schedules, and device/backend selection."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import run_workers
from hypothesis import given
from hypothesis import strategies as st

from thinwire.config import load
from thinwire.errors import UsageError
from thinwire.run import method_configs, method_overrides, run_name, split_methods
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import lr_at


def test_split_methods_keeps_each_methods_options_together() -> None:
    """Guards ``--methods "dp,ist:local_steps=20,train.lr=0.1,topk"``: the options after a colon
    stay with their method, a new name starts a new method."""
    assert split_methods("dp,ist:local_steps=20,train.lr=0.1,topk") == [
        "dp", "ist:local_steps=20,train.lr=0.1", "topk"]
    assert split_methods(" dp , localsgd:period=5 ,") == ["dp", "localsgd:period=5"]
    assert split_methods("topk:ratio=0.1,ef=false,ist") == ["topk:ratio=0.1,ef=false", "ist"]


def test_a_parenthesised_value_keeps_its_commas() -> None:
    """Guards a codec spec with two options given to a method inside ``--methods``: the commas
    in parentheses neither start a method nor an option, the parentheses are removed, and an
    unbalanced one is a one-line usage error."""
    specs = split_methods("dp,pipeline:codec_fwd=(topk:ratio=0.1,ef=true),train.lr=0.1,ist")
    assert specs == ["dp", "pipeline:codec_fwd=(topk:ratio=0.1,ef=true),train.lr=0.1", "ist"]
    assert method_overrides(specs[1]) == {"method.name": "pipeline", "train.lr": "0.1",
                                          "method.codec_fwd": "topk:ratio=0.1,ef=true"}
    cfg = method_configs([specs[1]], None, {"model.name": "gpt", "parallel.pp": "2"})[0]
    assert cfg.method.options.codec_fwd == "topk:ratio=0.1,ef=true"
    # only a pair enclosing the whole value is removed
    assert method_overrides("ist:train.lr=(0.1)")["train.lr"] == "0.1"
    assert method_overrides("ist:run.name=(a)(b)")["run.name"] == "(a)(b)"
    for bad, why in (("dp:compressor=(topk", "never closed"), ("dp,ist)", "closes nothing")):
        with pytest.raises(UsageError, match=why):
            method_configs(split_methods(bad), None, {})


def test_method_overrides_route_options_to_their_sections() -> None:
    assert method_overrides("ist:local_steps=20,train.lr=0.1") == {
        "method.name": "ist", "method.local_steps": "20", "train.lr": "0.1"}
    assert method_overrides("topk:ratio=0.05") == {"method.name": "dp",
                                                   "method.compressor": "topk:ratio=0.05"}
    with pytest.raises(UsageError, match="unknown method 'warp'"):
        method_overrides("warp")
    with pytest.raises(UsageError, match="not KEY=VALUE"):
        method_overrides("ist:local_steps")


def test_method_configs_validate_everything_first_and_name_runs_plainly() -> None:
    cfgs = method_configs(split_methods("dp,ist:local_steps=20,train.lr=0.1,topk"), None,
                          {"data.name": "digits"})
    assert [c.run_name for c in cfgs] == ["dp", "ist_local_steps20_train.lr0.1", "topk"]
    assert cfgs[1].method.options.local_steps == 20 and cfgs[1].train.lr == 0.1
    assert cfgs[2].method.options.compressor == "topk"
    with pytest.raises(UsageError, match="appears twice"):
        method_configs(["dp", "dp"], None, {})
    with pytest.raises(UsageError, match="at least one method"):
        method_configs(split_methods(""), None, {})
    with pytest.raises(UsageError, match="not of dp"):  # an ist option on dp
        method_configs(split_methods("dp:local_steps=3"), None, {})


@given(st.text(min_size=1, max_size=60))
def test_run_names_are_always_plain(spec: str) -> None:
    name = run_name(spec)
    assert name and "/" not in name and name not in (".", "..") and len(name) <= 120
    assert load(None, {"run.name": name}).run.name == name


def test_cosine_schedule_values() -> None:
    cfg = load(None, {"train.schedule": "cosine", "train.lr": 0.2, "train.steps": 100})
    assert lr_at(cfg.train, 0) == pytest.approx(0.2)
    assert lr_at(cfg.train, 50) == pytest.approx(0.1)
    assert lr_at(cfg.train, 25) == pytest.approx(0.1 * (1 + math.cos(math.pi / 4)))
    assert lr_at(cfg.train, 100) == pytest.approx(0.0, abs=1e-12)
    const = load(None, {"train.lr": 0.2})
    assert {lr_at(const.train, s) for s in (0, 99, 1000)} == {0.2}


def _epoch_indices(comm: Comm, cfg, run_dir: str) -> list[int]:
    from thinwire.trainer import Trainer

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    tr = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir))
    s = tr.stream
    return np.concatenate([s.batch_indices(i) for i in range(s.steps_per_epoch)]).tolist()


@pytest.mark.parametrize("shard", ["iid", "skew"])
def test_ranks_read_disjoint_shards_that_cover_the_epoch(shard: str, tmp_path: Path) -> None:
    """Guards the trainer handing every rank the same shard: over one epoch the ranks' batch
    indices are disjoint and cover the training set (up to the last incomplete batch)."""
    n = 4
    over = {"data.name": "digits", "runtime.workers": n, "train.batch_size": 16,
            "data.shard": shard}
    if shard == "skew":
        over["data.skew"] = 0.5
    cfg = load(None, over)
    out = run_workers(_epoch_indices, n, cfg, str(tmp_path))
    seen = [set(o) for o in out]
    for a in range(n):
        assert len(seen[a]) == len(out[a])  # no repeats within an epoch
        for b in range(a + 1, n):
            assert not seen[a] & seen[b], (a, b)
    total = set().union(*seen)
    assert len(total) >= 1438 - n * 16  # every example but the dropped incomplete batches


def test_backend_and_device_selection_fail_in_one_line() -> None:
    from thinwire.runtime import dist as rt

    cpu = load(None, {"runtime.backend": "nccl", "runtime.device": "cpu"}).runtime
    with pytest.raises(UsageError, match="nccl needs CUDA"):
        rt.pick_backend(cpu, torch.device("cpu"))
    assert rt.pick_backend(load(None, {}).runtime, torch.device("cpu")) == "gloo"
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device"):
            rt.pick_device(load(None, {"runtime.device": "cuda"}).runtime, 0)
        assert rt.pick_device(load(None, {}).runtime, 0) == torch.device("cpu")
