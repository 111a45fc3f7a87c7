"""GPU smoke tests (marker ``gpu``): the same strategies and every codec on CUDA with nccl.

Skipped where no CUDA device is visible. With one device a single worker runs (nccl needs one
device per rank); with two or more, two workers run and must agree. The methods and their
options come from tests/method_cases.py (kinds ``gpu``, ``device`` and ``gloo_cuda``), so every
registered method has its CUDA case or says why not. Two of the tests run every method's
``device`` case through the launcher, with the device rule on: 2 ranks sharing one CUDA device
through gloo with CUDA tensors (the multi-rank CUDA paths on a one-GPU machine), and one rank a
device through nccl (skipped, saying so, where fewer devices are visible than the case needs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from method_cases import params, resolve, workers

from thinwire.config import load
from thinwire.run import run_config

pytestmark = pytest.mark.gpu


GPU_MODELS = {
    "mlp": {"data.name": "digits", "model.hidden": "64,64"},
    "resnet": {"data.name": "digits", "model.widths": "8,16", "model.blocks": "2,2"},
    "gpt": {"data.name": "tinyshakespeare", "data.seq_len": "32", "data.limit_train": "2048",
            "data.limit_test": "64", "model.n_layer": "2", "model.d_model": "64"},
    "gcn": {"data.name": "cora", "model.hidden": "64"},
}


def _shared_dir(model: str) -> dict[str, str]:
    from harness import DATA

    sub = {"gpt": "tinyshakespeare", "gcn": "cora"}.get(model)
    if sub is None:
        return {}
    return {"data.dir": str(DATA / sub)}


@pytest.mark.parametrize("model", sorted(GPU_MODELS))
@pytest.mark.parametrize("method,variant,case", params("gpu"))
def test_every_model_trains_on_cuda_with_nccl(model: str, method: str, variant: str,
                                              case: dict[str, Any], tmp_path: Path) -> None:
    """Each model with dp, local SGD and IST (where the model has IST units) on CUDA through
    nccl: it learns (beats chance clearly), and every rank's ledger equals the method's pure
    traffic formula to the byte (the bytes cannot depend on the device)."""
    from thinwire.builders import build_model, load_data
    from thinwire.models import MODELS
    from thinwire.strategies import METHODS
    from thinwire.strategies.traffic import Layout

    if method == "ist" and MODELS.get(model).ist is None:
        pytest.skip(f"{model} has no IST adapter")
    workers = min(2, torch.cuda.device_count())
    over = {"model.name": model, "method.name": method, **GPU_MODELS[model], **_shared_dir(model),
            "train.steps": "40", "train.eval_every": "20", "train.batch_size": "32",
            "runtime.workers": str(workers), "runtime.device": "cuda",
            "run.out": str(tmp_path), "run.progress": "false", **case}
    cfg = load(None, over)
    summary = run_config(cfg)
    final = summary["final"]
    if summary["metric"] == "accuracy":
        assert final["accuracy"] > 0.3
    else:
        assert final["perplexity"] < 40  # chance over 65 characters is 65
    ds = load_data(cfg)
    net = build_model(cfg, ds)
    entry = METHODS.get(method)
    plan = MODELS.get(model).ist(net).plan if method == "ist" else None
    layout = Layout.of_model(net, ds.x_train[:4], ist=plan)
    want = entry.traffic(layout, cfg.method.options, workers, cfg.train.steps, cfg.train.seed, 0)
    for r in range(workers):
        got = json.loads((cfg.run_dir / f"ledger.rank{r}.json").read_text())["totals"]
        assert got["sent_bytes"] == want.sent[r], r


# --- every method's device case on CUDA: gloo on one device, nccl on several ---------------------
DEVICE_RUN = {"train.steps": 4, "train.eval_every": 2, "run.checkpoint_every": 2,
              "train.batch_size": 8, "run.progress": "false", "runtime.device": "cuda",
              "runtime.timeout_s": 120}


def _device_run(method: str, case: dict[str, Any], backend: str, workers: int,
                tmp_path: Path) -> list[list[str]]:
    """The case through the launcher on CUDA with ``backend``: 4 steps, evaluations and
    checkpoints at 2 and 4; returns each rank's ledger devices (``ledger.rank{r}.json``)."""
    cfg = load(None, {**resolve(case), "method.name": method, **DEVICE_RUN,
                      "runtime.backend": backend, "runtime.workers": str(workers),
                      "run.out": str(tmp_path)})
    summary = run_config(cfg)
    assert summary["final"], summary
    return [json.loads((cfg.run_dir / f"ledger.rank{r}.json").read_text())["devices"]
            for r in range(workers)]


@pytest.mark.parametrize("method,variant,case", params("gloo_cuda"))
def test_two_ranks_share_one_cuda_device_through_gloo(method: str, variant: str,
                                                      case: dict[str, Any],
                                                      tmp_path: Path) -> None:
    """2 ranks on cuda:0 through gloo, which carries CUDA tensors for its collectives: the
    CUDA tensor paths of a multi-rank run (DDP's hooks, metric gathers, the IST-free methods'
    averages) execute where one GPU is all there is, under the device rule."""
    devices = _device_run(method, case, "gloo", 2, tmp_path)
    assert devices == [["cuda:0"], ["cuda:0"]], devices


@pytest.mark.parametrize("method,variant,case", params("device"))
def test_every_method_runs_on_cuda_devices_through_nccl(method: str, variant: str,
                                                        case: dict[str, Any],
                                                        tmp_path: Path) -> None:
    """Every method's device case with one rank a CUDA device through nccl (which refuses a
    CPU tensor): trains, evaluates and checkpoints, every call on its rank's device."""
    n, have = workers(case), torch.cuda.device_count()
    if have < n:
        pytest.skip(f"nccl needs one CUDA device per rank: {method}:{variant} runs {n} ranks, "
                    f"{have} device(s) visible")
    devices = _device_run(method, case, "nccl", n, tmp_path)
    assert devices == [[f"cuda:{r}"] for r in range(n)], devices


# --- codecs on CUDA ------------------------------------------------------------------------------

CODECS_ON_GPU = ["none", "fp16", "bf16", "topk:ratio=0.1", "randk:ratio=0.1",
                 "randk:ratio=0.1,ef=false", "qsgd", "int8", "fp8", "fp8:format=e5m2", "sign",
                 "powersgd:rank=2"]
# codecs whose payload is a function of x alone with elementwise IEEE arithmetic: the GPU's bytes
# are the CPU's (Top-k's tie rule, Rand-k's indices computed by integer hashes on the device, and
# fp8's codes by torch's one float -> float8 conversion on both)
BITWISE = {"none", "fp16", "bf16", "topk", "randk", "int8", "fp8"}


@pytest.mark.parametrize("spec", CODECS_ON_GPU)
def test_codec_round_trip_on_cuda_matches_cpu(spec: str) -> None:
    """Guards device-following: every payload tensor, generator draw, table and residual of a
    codec lives on the input's CUDA device, and the results equal the CPU's where the math
    allows (bitwise for the elementwise codecs, the sign bits exactly and the scale to rounding,
    PowerSGD to matmul rounding; QSGD draws its private rounding on the device, so there it is
    checked against its definition: each level is floor(r) or floor(r) + 1). Three steps, so
    error-feedback residuals and warm starts live on the device too."""
    from thinwire.compression import build

    d, name = 70_001, spec.partition(":")[0]
    dev = torch.device("cuda")
    cpu, gpu = build(spec, seed=3), build(spec, seed=3)
    for step in range(3):  # error feedback and warm starts carry state across steps
        x = torch.randn(d, generator=torch.Generator().manual_seed(step))
        p_cpu, p_gpu = cpu.encode(x, step, key=1), gpu.encode(x.to(dev), step, key=1)
        assert all(t.device.type == "cuda" for t in p_gpu), spec
        assert [(t.numel(), t.dtype) for t in p_gpu] == \
            [(p.numel, p.dtype) for p in gpu.spec(d)], spec
        out = torch.full((d,), float("nan"), device=dev)
        got = gpu.decode(p_gpu, d, step, key=1, out=out)
        assert got is out and bool(torch.isfinite(out).all()), spec
        want = cpu.decode(p_cpu, d, step, key=1)
        if name in BITWISE:
            assert all(torch.equal(a.cpu(), b) for a, b in zip(p_gpu, p_cpu)), spec
            assert torch.equal(out.cpu(), want), spec
        elif name == "sign":  # the scales differ by summation order, so (through error
            # feedback) may the signs of elements within a rounding of zero after step 0
            flips = (p_gpu[1].cpu() ^ p_cpu[1]).count_nonzero()
            assert int(flips) == 0 if step == 0 else int(flips) <= 4, (step, int(flips))
            assert float(p_gpu[0]) == pytest.approx(float(p_cpu[0]), rel=1e-5)
        elif name == "powersgd":
            assert torch.allclose(out.cpu(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        else:  # qsgd
            norm, q = p_gpu
            r = x.double().abs() * gpu.levels / float(norm)
            lv = q.cpu().double().abs()
            assert torch.all((lv == r.floor()) | (lv == r.floor() + 1))
        acc = torch.zeros(d, device=dev)
        gpu.decode_add(p_gpu, acc, step, key=1)
        assert torch.equal(acc, out), spec


def _nccl_rank(rank: int, world: int, store: str, specs: list[str], queue: Any) -> None:
    """One nccl rank: a small MLP on cuda:rank through DDP with each codec's hook."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thinwire.compression import register
    from thinwire.models import build_mlp
    from thinwire.runtime.comm import Comm

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        dev = torch.device("cuda", rank)
        comm = Comm()
        out = {}
        for spec in specs:
            model = build_mlp(8, (64, 64), 4, norm="none", seed=0).to(dev)
            ddp = DDP(model, device_ids=[rank])
            state = register(ddp, spec, comm=comm, seed=2)
            mark = comm.ledger.mark()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * rank + step)
                x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x.to(dev)), y.to(dev)).backward()
                opt.step()
            torch.cuda.synchronize()
            out[spec] = {
                "params": torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]),
                "shapes": [tuple(p.shape) for p in model.parameters()],
                "entries": [(e.op, e.payload) for e in comm.ledger.entries[mark:]],
                "encoded": state.encoded_bytes}
            del ddp
        dist.destroy_process_group()
        queue.put((rank, pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, pickle.dumps(RuntimeError(f"rank {rank}: {exc!r}"))))


def test_ddp_hooks_through_nccl() -> None:
    """Guards the hooks on GPUs: every codec's hook runs through nccl on cuda tensors (two ranks
    where two GPUs exist, else one), the ranks agree, the weights move, and the ledger holds the
    collectives ``collectives`` predicts for the bucket."""
    import multiprocessing as mp
    import pickle

    from thinwire.compression import build
    from thinwire.models import build_mlp
    from thinwire.runtime.spawn import rendezvous_dir

    world = min(2, torch.cuda.device_count())
    ctx = mp.get_context("spawn")  # CUDA cannot follow a fork
    queue = ctx.Queue()
    store = f"{rendezvous_dir()}/store"
    procs = [ctx.Process(target=_nccl_rank, args=(r, world, store, CODECS_ON_GPU, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results: dict[int, Any] = {}
        for _ in range(world):
            rank, blob = queue.get(timeout=240)
            value = pickle.loads(blob)
            if isinstance(value, BaseException):
                raise AssertionError(str(value))
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    start = torch.cat([p.detach().reshape(-1)
                       for p in build_mlp(8, (64, 64), 4, norm="none", seed=0).parameters()])
    for spec in CODECS_ON_GPU:
        got = results[0][spec]
        assert float((got["params"] - start).abs().max()) > 1e-4, spec  # it trained
        want = build(spec).collectives(got["params"].numel(), got["shapes"]) * 3
        assert sorted(got["entries"]) == (sorted(want) if world > 1 else []), spec
        assert got["encoded"] == sum(b for _, b in want), spec
        for r in range(1, world):
            assert torch.equal(results[r][spec]["params"], got["params"]), (spec, r)


# --- memory options on CUDA ----------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    {"memory.recompute": "block"},
    {"memory.zero": "1"},
    {"memory.zero": "2"},
    {"memory.zero": "3", "memory.offload": "params", "memory.recompute": "selective"},
], ids=["block", "zero1", "zero2", "zero3-offload-selective"])
def test_memory_options_on_cuda_match_the_planner(extra: dict[str, str], tmp_path: Path) -> None:
    """The GPT with each memory option on CUDA through nccl: parameter, gradient and optimizer
    bytes on the device equal the planner's (offload: all of them on the host instead), the
    saved activations are within 5% of the prediction (the CUDA attention kernels keep a few
    bytes more or less per row than the CPU one), and the allocator's peak covers the measured
    sum."""
    from thinwire.builders import build_model, load_data
    from thinwire.planner.runs import predict_dp_run

    workers = min(2, torch.cuda.device_count())
    if workers < 2 and "memory.zero" in extra:
        pytest.skip("ZeRO shards over 2 ranks; one CUDA device visible")
    over = {"model.name": "gpt", **GPU_MODELS["gpt"], **_shared_dir("gpt"), **extra,
            "train.steps": "4", "train.eval_every": "4", "train.batch_size": "16",
            "train.optimizer": "adamw", "runtime.workers": str(workers),
            "runtime.device": "cuda", "run.out": str(tmp_path), "run.progress": "false"}
    cfg = load(None, over)
    mem = run_config(cfg)["memory"]
    ds = load_data(cfg)
    want, _ = predict_dp_run(cfg, ds, build_model(cfg, ds))
    states = mem["params_bytes_max"] + mem["grads_bytes_max"] + mem["optimizer_bytes_max"]
    if cfg.memory.offload == "params":
        assert mem["host_bytes_max"] == states
    assert mem["params_bytes_max"] == want.params
    assert mem["optimizer_bytes_max"] == want.optimizer
    assert mem["activations_bytes_max"] == pytest.approx(want.activations, rel=0.05)
    assert mem["device_peak_bytes_max"] >= mem["activations_bytes_max"]
