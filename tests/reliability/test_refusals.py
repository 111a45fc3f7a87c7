"""Wrong successes refused and misleading messages fixed: each is
one line naming what is wrong and a safe fix, before any worker starts where it can be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import one_line
from report_cases import write_report_run

from thinwire import builders
from thinwire import config as config_mod
from thinwire import run as run_mod
from thinwire.cli import main
from thinwire.compression.base import Site
from thinwire.errors import UsageError
from thinwire.report.tables import load_run
from thinwire.strategies.pipeline.codecs import bottleneck, build_boundary

TINY = {"data.name": "digits", "model.hidden": "16", "train.batch_size": "8",
        "train.steps": "4", "runtime.workers": "2"}


# --- 7. tracebacks -------------------------------------------------------------------------------
def test_plan_with_a_binary_model_file_is_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "model.toml"
    f.write_bytes(bytes(range(256)) * 4)
    assert main(["plan", "--model", str(f), "--cluster", "h100", "--devices", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not UTF-8" in err[0] and str(f) in err[0], err


# --- 8. wrong successes --------------------------------------------------------------------------
@pytest.mark.parametrize("method,key", [("dp", "pp"), ("dp", "tp"), ("ist", "pp"),
                                        ("localsgd", "tp"), ("diloco", "pp")])
def test_model_parallel_degrees_a_method_ignores_are_refused(method: str, key: str) -> None:
    with pytest.raises(UsageError) as e:
        config_mod.load(None, {**TINY, "method.name": method, f"parallel.{key}": "2",
                               "train.steps": "20"})
    msg = one_line(e)
    assert f"parallel.{key}" in msg and f"method {method}" in msg and "pipeline" in msg, msg


def test_methods_that_split_the_model_keep_their_degrees() -> None:
    cfg = config_mod.load(None, {"model.name": "gpt", "method.name": "pipeline",
                                 "parallel.pp": "2", "runtime.workers": "2"})
    assert cfg.parallel.pp == 2
    assert config_mod.load(None, {"method.name": "tensor", "model.name": "gpt",
                                  "parallel.tp": "2", "runtime.workers": "2"}).parallel.tp == 2


def test_powersgd_with_a_rank_that_compresses_nothing_is_refused() -> None:
    bad = config_mod.load(None, {**TINY, "method.compressor": "powersgd:rank=100000"})
    with pytest.raises(UsageError) as e:
        run_mod.preflight(bad)
    msg = one_line(e)
    assert "compresses none" in msg and "use rank <=" in msg, msg
    run_mod.preflight(config_mod.load(None, {**TINY, "method.compressor": "powersgd:rank=2"}))


def test_lowrank_that_cannot_compress_a_boundary_is_refused() -> None:
    x = torch.randn(4, 6, 10)  # [24, 10]: rank r compresses while r (24 + 10) < 240, r <= 7
    build_boundary("lowrank:rank=7").encode_tensor(x, Site(0, 0))
    with pytest.raises(UsageError) as e:
        build_boundary("lowrank:rank=100000").encode_tensor(x, Site(0, 0))
    assert "cannot compress" in one_line(e) and "rank <= 7" in str(e.value)


def test_a_bottleneck_as_wide_as_its_boundary_is_refused() -> None:
    bottleneck("ae:dim=15", 16, seed=0, boundary=0)
    for spec in ("ae:dim=16", "ae:dim=64", "subspace:dim=100"):
        with pytest.raises(UsageError) as e:
            bottleneck(spec, 16, seed=0, boundary=0)
        assert "cannot compress" in one_line(e) and "dim < 16" in str(e.value)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1,ratio=0.2", "powersgd:rank=2,ef=false,rank=4"])
def test_a_codec_option_given_twice_is_refused(spec: str) -> None:
    with pytest.raises(UsageError) as e:
        config_mod.load(None, {**TINY, "method.compressor": spec})
    assert "given twice" in one_line(e)


@pytest.mark.parametrize("line,key", [('steps = "10"', "steps"), ('lr = "0.1"', "lr"),
                                      ('progress = "false"', "progress")])
def test_toml_strings_for_numbers_and_booleans_are_refused(tmp_path: Path, line: str,
                                                           key: str) -> None:
    section = "run" if key == "progress" else "train"
    f = tmp_path / "c.toml"
    f.write_text(f"[{section}]\n{line}\n")
    with pytest.raises(UsageError) as e:
        config_mod.load(f)
    msg = one_line(e)
    assert f"{section}.{key}" in msg and "without quotes" in msg, msg
    f.write_text(f"[{section}]\n{line.replace(chr(34), '')}\n")
    config_mod.load(f)  # the same value unquoted is fine


@pytest.mark.parametrize("edit,needle", [
    (lambda s, r: s.update(steps=-3), "steps is -3"),
    (lambda s, r: r.clear(), "no evaluation record"),
    (lambda s, r: s.update(workers=0), "workers is 0"),
])
def test_report_inputs_that_used_to_pass(tmp_path: Path, edit, needle: str) -> None:  # type: ignore[no-untyped-def]
    run = write_report_run(tmp_path / "dp")
    s = json.loads((run / "summary.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    edit(s, records)
    (run / "summary.json").write_text(json.dumps(s))
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    with pytest.raises(UsageError) as e:
        load_run(run)
    assert needle in one_line(e)


def test_diloco_with_a_codec_does_not_resume_at_another_worker_count() -> None:
    plain = config_mod.load(None, {**TINY, "method.name": "diloco", "method.period": "2"})
    coded = config_mod.load(None, {**TINY, "method.name": "diloco", "method.period": "2",
                                   "method.compressor": "topk:ratio=0.1"})
    dp_coded = config_mod.load(None, {**TINY, "method.compressor": "topk:ratio=0.1"})
    assert builders.rescalable(plain)
    assert not builders.rescalable(coded) and not builders.rescalable(dp_coded)


# --- 9. messages ---------------------------------------------------------------------------------
def test_an_unknown_offload_names_the_choices() -> None:
    with pytest.raises(UsageError) as e:
        config_mod.load(None, {"memory.offload": "foo"})
    msg = one_line(e)
    assert "use one of none, params" in msg and "zero" not in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("key,value", [("runtime.backend", "nccl"), ("runtime.device", "cuda")])
def test_cuda_options_without_cuda_are_refused_before_workers_start(
        tmp_path: Path, key: str, value: str) -> None:
    cfg = config_mod.load(None, {**TINY, key: value, "run.out": str(tmp_path)})
    with pytest.raises(UsageError) as e:
        run_mod.run_config(cfg)
    assert key in one_line(e)
    assert list(tmp_path.iterdir()) == []  # refused before the run directory is made


GLOO_PEER = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
             "closed by peer [127.0.0.1]:20399. This is typically caused by a remote worker "
             "crashing. Check the logs of the remote worker before reporting an error.")
"""What gloo 2.x raised on rank 0 when rank 1 of 2 exited in the middle of an all-reduce."""


def test_a_communication_failure_names_the_peer() -> None:
    from thinwire.worker import comm_failure

    try:
        try:
            raise RuntimeError(GLOO_PEER)
        except RuntimeError as inner:
            raise RuntimeError("Traceback ...\n  File .../runtime/comm.py(224): done") from inner
    except RuntimeError as exc:
        msg = comm_failure(exc)
    assert "peer 127.0.0.1:20399" in msg and "\n" not in msg, msg
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                           "120000ms for recv operation to complete")
    assert "within 120 s" in comm_failure(timeout)
