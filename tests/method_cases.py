"""Every registered method's test cases, in one table: a new method adds one entry to ``CASES``.

The registry-driven tests parametrise over ``METHODS.names()`` through :func:`params`; a method
with no entry for a kind fails ``tests/test_method_cases.py`` until it has a case or an
:class:`Exempt` saying why it has none. Kinds, and the test that runs each case:

- ``resume``: a run cut at step 10 and resumed equals the uninterrupted run bit for bit
  (``tests/test_foundation.py``; 2 workers, 20 steps, a checkpoint every 10);
- ``ledger``: a real run's ledger equals the run predictor to the byte
  (``tests/measure/test_measure_predict.py``; 2 workers, 10 steps);
- ``models``: two steps of every model, replicas equal and the ledger equal to the traffic
  formula (``tests/test_core.py``; the case's model and data keys are replaced per model);
- ``restart``: workers SIGKILLed at seeded steps restart and end bit for bit as an
  uninterrupted run (``tests/reliability/test_elastic_restart.py``): ``(overrides, kills)``;
- ``device``: the device rule of :mod:`thinwire.runtime.comm` on CPU with tensors made without a
  device put elsewhere (``tests/test_device_discipline.py``), and the same case on CUDA
  (``tests/test_gpu.py``: nccl on >= 2 devices, and 2 ranks on one device through gloo unless
  ``gloo_cuda`` exempts it);
- ``gloo_cuda``: ``True`` (run the device case through gloo with CUDA tensors) or an
  :class:`Exempt` (gloo carries CUDA tensors for all-reduce, broadcast and all-gather, not for
  point-to-point messages);
- ``gpu``: method options for the CUDA smoke test of every model (``tests/test_gpu.py``).

A kind's value is ``{variant: overrides}`` (config overrides as ``section.option``: value; the
variant names the test id), except where said above. Model and data come in the case (``MLP``,
``GPT``, ``DLRM`` below), the test adds the run's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

KINDS = ("resume", "ledger", "models", "restart", "device", "gloo_cuda", "gpu")


@dataclass(frozen=True)
class Exempt:
    """A method has no case of this kind, and this is why (said in a full sentence)."""

    why: str


def _gpt_data() -> dict[str, Any]:
    from harness import DATA

    return {"data.dir": str(DATA / "tinyshakespeare")}


MLP = {"model.name": "mlp", "data.name": "digits", "model.hidden": "32,32"}
"""A small MLP on digits: the default model of the cases."""
GPT = {"model.name": "gpt", "data.name": "tinyshakespeare", "data.seq_len": 8,
       "data.limit_train": 128, "data.limit_test": 16, "model.n_layer": 1, "model.d_model": 16,
       "model.n_head": 2}
"""A one-block GPT on tiny-shakespeare (``data.dir``, the package's copy, added by
:func:`resolve`)."""
DLRM = {"model.name": "dlrm", "data.name": "clicks", "data.tables": 3, "data.rows": 20,
        "data.train": 512, "data.test": 128, "model.dim": 4, "model.bottom": "8",
        "model.top": "8"}
"""A small DLRM on the synthetic click log."""
XMLP = {"model.name": "xmlp", "data.name": "xc-synth", "data.labels": 200, "data.features": 300,
        "data.proto": 8, "data.train": 1024, "data.test": 256, "model.hidden": 16}
"""A small extreme-classification MLP on synthetic multi-label data (SLIDE's)."""

P2P = Exempt("its calls include point-to-point messages, which gloo does not carry for CUDA "
             "tensors; its CUDA path runs in the nccl test")

CASES: dict[str, dict[str, Any]] = {
    "dp": {
        "resume": {"momentum": {**MLP, "model.norm": "none", "train.momentum": 0.9},
                   "topk-ef": {**MLP, "model.norm": "none", "method.compressor": "topk:ratio=0.05",
                               "train.momentum": 0.9},
                   "powersgd": {**MLP, "model.norm": "none",
                                "method.compressor": "powersgd:rank=2"},
                   # position-dependent codecs (a scale per bucket, draws over its positions):
                   # the resumed process must encode DDP's rebuilt buckets, not its first ones
                   "int8-batchnorm": {**MLP, "model.norm": "batch", "method.compressor": "int8"},
                   "randk": {**MLP, "model.norm": "none", "method.compressor": "randk:ratio=0.1"}},
        "ledger": {"plain": {**MLP, "model.hidden": "512,512"},
                   "topk": {**MLP, "model.hidden": "512,512", "model.norm": "layer",
                            "method.compressor": "topk:ratio=0.003"},
                   "powersgd": {**MLP, "model.hidden": "48,40", "model.norm": "none",
                                "method.compressor": "powersgd:rank=2"}},
        "models": {c: {"method.compressor": c} for c in
                   ["none", "fp16", "bf16", "topk:ratio=0.1", "randk:ratio=0.1", "qsgd", "int8",
                    "int8:exchange=scatter", "sign", "powersgd:rank=2"]},
        "restart": {"plain": ({**MLP, "model.norm": "none"}, 2)},
        "device": {"topk-ef": {**MLP, "method.compressor": "topk:ratio=0.1"},
                   "zero1": {**MLP, "memory.zero": 1, "train.optimizer": "adamw"},
                   "zero3": {**MLP, "memory.zero": 3}},
        "gloo_cuda": True,
        "gpu": {"plain": {}},
    },
    "localsgd": {
        "resume": {"adamw": {**MLP, "model.norm": "none", "method.period": 5,
                             "train.optimizer": "adamw", "train.lr": 0.01}},
        "ledger": {"plain": {**MLP, "method.period": 5, "model.norm": "none"}},
        "models": {"period2": {"method.period": 2}},
        "restart": {"plain": ({**MLP, "method.period": 5, "model.norm": "none"}, 2)},
        "device": {"plain": {**MLP, "method.period": 2}},
        "gloo_cuda": True,
        "gpu": {"plain": {"method.period": 10}},
    },
    "diloco": {
        "resume": {"adamw": {**MLP, "model.norm": "none", "method.period": 5,
                             "train.optimizer": "adamw", "train.lr": 0.01},
                   "streaming-fp4": {**MLP, "model.norm": "none", "method.period": 10,
                                     "method.fragments": 2, "method.delay": 2,
                                     "method.alpha": 0.5, "method.compressor": "fp4"},
                   "streaming-fp4-scatter": {**MLP, "model.norm": "none", "method.period": 10,
                                             "method.fragments": 2, "method.delay": 2,
                                             "method.compressor": "fp4:exchange=scatter"}},
        "ledger": {"plain": {**MLP, "method.period": 5, "model.hidden": "40,24",
                             "train.optimizer": "adamw", "train.lr": 0.001},
                   "streaming-int8": {**MLP, "method.period": 10, "model.hidden": "40,24",
                                      "method.fragments": 2, "method.delay": 1,
                                      "method.compressor": "int8"}},
        "models": {"period2": {"method.period": 2},
                   "overlap-fp4": {"method.period": 2, "method.delay": 1,
                                   "method.compressor": "fp4"},
                   "overlap-fp4-scatter": {"method.period": 2, "method.delay": 1,
                                           "method.compressor": "fp4:exchange=scatter"}},
        "restart": Exempt("its checkpoint round trip is held bit for bit by its resume case, "
                          "and the restart machinery (agent, store, rewound metrics) is the "
                          "method-independent one held by dp, localsgd and ist"),
        "device": {"plain": {**MLP, "method.period": 2, "train.optimizer": "adamw"},
                   "streaming-fp4": {**MLP, "method.period": 2, "method.fragments": 2,
                                     "method.compressor": "fp4"}},
        "gloo_cuda": True,
        "gpu": {"plain": {"method.period": 10}},
    },
    "sparseloco": {
        "resume": {"adamw": {**MLP, "model.norm": "none", "method.period": 5,
                             "method.chunk": 256, "method.topk": 8,
                             "train.optimizer": "adamw", "train.lr": 0.01}},
        "ledger": {"plain": {**MLP, "method.period": 5, "model.hidden": "40,24",
                             "method.chunk": 512, "method.topk": 16}},
        "models": {"period2": {"method.period": 2, "method.chunk": 64, "method.topk": 4}},
        "restart": Exempt("its checkpoint round trip is held bit for bit by its resume case, "
                          "and the restart machinery (agent, store, rewound metrics) is the "
                          "method-independent one held by dp, localsgd and ist"),
        "device": {"plain": {**MLP, "method.period": 2, "method.chunk": 64, "method.topk": 4}},
        "gloo_cuda": True,
        "gpu": {"plain": {"method.period": 10}},
    },
    "demo": {
        "resume": {"plain": {**MLP, "model.norm": "none", "train.lr": 0.005,
                             "method.topk": 8, "method.chunk": 8}},
        "ledger": {"plain": {**MLP, "model.hidden": "40,24", "train.lr": 0.005}},
        "models": {"k8": {"method.topk": 8, "method.chunk": 16}},
        "restart": Exempt("its checkpoint round trip (the decoupled momenta in the optimizer's "
                          "state) is held bit for bit by its resume case, and the restart "
                          "machinery is the method-independent one held by dp, localsgd and "
                          "ist"),
        "device": {"plain": {**MLP, "method.topk": 8, "method.chunk": 8}},
        "gloo_cuda": True,
        "gpu": {"plain": {"train.lr": 0.002}},
    },
    "ist": {
        "resume": {"reindex": {**MLP, "method.local_steps": 5, "model.norm": "batch",
                               "method.optimizer_state": "reindex", "train.momentum": 0.9},
                   "hybrid": {**MLP, "model.norm": "none", "method.local_steps": 5,
                              "method.period": 5, "method.switch_at": 5, "train.momentum": 0.9},
                   "auto-switch": {**MLP, "model.norm": "none", "method.local_steps": 5,
                                   "method.period": 5, "method.switch_patience": 1,
                                   "method.switch_tol": 1.0, "train.momentum": 0.9}},
        "ledger": {"central": {**MLP, "method.local_steps": 5, "model.hidden": "33,30"},
                   "sharded": {**MLP, "method.local_steps": 5, "model.hidden": "34,31",
                               "method.deployment": "sharded",
                               "method.optimizer_state": "reindex", "train.momentum": 0.9,
                               "train.seed": 3}},
        "models": Exempt("it cuts a model by its IST adapter rather than replicating it; "
                         "tests/strategies/ist/ train each model that has one"),
        "restart": {"plain": ({**MLP, "method.local_steps": 5, "model.norm": "batch"}, 2)},
        "device": {"auto-switch": {**MLP, "method.local_steps": 2, "method.period": 2,
                                   "method.switch_patience": 1, "method.switch_tol": 1.0}},
        "gloo_cuda": P2P,
        "gpu": {"plain": {"method.local_steps": 10}},
    },
    "pipeline": {
        "resume": {"aqsgd+lowrank": {**MLP, "model.norm": "layer", "parallel.pp": 2,
                                     "method.micro_batches": 2,
                                     "method.codec_fwd": "aqsgd:bits=4",
                                     "method.codec_bwd": "lowrank:rank=2",
                                     "train.optimizer": "adamw", "train.lr": 0.01}},
        "ledger": Exempt("tests/strategies/pipeline/test_pipeline_exact.py and test_pipeline_3d.py hold "
                         "every rank's ledger equal to its traffic formula over the run's "
                         "PipelinePlan, stage by stage and schedule by schedule"),
        "models": Exempt("it cuts a model's chain into stages rather than replicating it; "
                         "tests/strategies/pipeline/ train the mlp and the gpt"),
        "restart": Exempt("its checkpoint round trip is held bit for bit by its resume case "
                          "and tests/test_model_parallel_resume.py; the restart machinery is "
                          "the method-independent one held by dp, localsgd and ist"),
        "device": {"gpt-tp": {**GPT, "model.n_layer": 2, "parallel.pp": 2, "parallel.tp": 2,
                              "method.micro_batches": 2, "method.codec_bwd": "lowrank:rank=2"}},
        "gloo_cuda": P2P,
        "gpu": Exempt("it trains chains of the mlp and gpt only; its CUDA path is the device "
                      "case's nccl run"),
    },
    "tensor": {
        "resume": Exempt("tests/test_model_parallel_resume.py resumes it bit for bit with "
                         "sequence parallelism and a codec's residuals, on the GPT it needs"),
        "ledger": Exempt("tests/strategies/test_tensor.py holds every rank's ledger equal to run_traffic "
                         "(the registry's formula over its run layout) on the GPT it needs"),
        "models": Exempt("it needs a model's tensor plan (the gpt only); tests/strategies/test_tensor.py "
                         "trains it"),
        "restart": Exempt("its checkpoint round trip is held by "
                          "tests/test_model_parallel_resume.py; the restart machinery is the "
                          "method-independent one held by dp, localsgd and ist"),
        "device": {"sp-int8": {**GPT, "parallel.tp": 2, "method.sequence_parallel": True,
                               "method.codec": "int8"}},
        "gloo_cuda": Exempt("sequence parallelism's reduce-scatter and the codec's all-to-all "
                            "are not carried by gloo for CUDA tensors; its CUDA path runs in "
                            "the nccl test"),
        "gpu": Exempt("it trains the gpt only; its CUDA path is the device case's nccl run"),
    },
    "hybrid": {
        "resume": Exempt("tests/test_model_parallel_resume.py resumes it with DCT bit for bit, "
                         "on the DLRM it needs"),
        "ledger": Exempt("tests/strategies/test_hybrid.py holds its ledger equal to its traffic formula on "
                         "the DLRM it needs"),
        "models": Exempt("it splits a DLRM's tables (the only model with an embedding plan)"),
        "restart": Exempt("its checkpoint round trip is held by "
                          "tests/test_model_parallel_resume.py; the restart machinery is the "
                          "method-independent one held by dp, localsgd and ist"),
        "device": {"dct": {**DLRM, "method.dct": True, "method.every": 2}},
        "gloo_cuda": P2P,
        "gpu": Exempt("it trains the DLRM only; its CUDA path is the device case's nccl run"),
    },
    "slide": {
        "resume": Exempt("tests/strategies/slide/test_slide_method.py resumes it bit for bit, hash tables "
                         "included, on the extreme-classification model it needs"),
        "ledger": Exempt("tests/strategies/slide/test_slide_method.py holds its ledger equal to its "
                         "traffic formula on the extreme-classification model it needs"),
        "models": Exempt("it shards a wide output layer (xmlp's), not a replicated model"),
        "restart": Exempt("its checkpoint round trip is held by tests/strategies/slide/; the restart "
                          "machinery is the method-independent one held by dp, localsgd and "
                          "ist"),
        "device": {"small": {**XMLP, "method.K": 4, "method.L": 8, "method.active": 0.1,
                             "method.rebuild_first": 1}},
        "gloo_cuda": True,
        "gpu": Exempt("it trains the xmlp only; its CUDA path is the device case's runs"),
    },
}
"""method name -> kind -> {variant: case} or Exempt (module docstring)."""


def method_names() -> list[str]:
    from thinwire.strategies import METHODS

    return list(METHODS.names())


def resolve(over: dict[str, Any]) -> dict[str, Any]:
    """A case's overrides with what the machine supplies (the GPT's data directory)."""
    if over.get("data.name") == "tinyshakespeare" and "data.dir" not in over:
        return {**_gpt_data(), **over}
    return dict(over)


def workers(case: dict[str, Any]) -> int:
    """Ranks a case runs on: its pipeline x tensor degrees, at least 2."""
    return max(2, int(case.get("parallel.pp", 1)) * int(case.get("parallel.tp", 1)))


def params(kind: str) -> list[Any]:
    """``pytest.param(method, variant, case)`` for every registered method's cases of ``kind``
    (a method without a case or exemption is reported by ``tests/test_method_cases.py``)."""
    out = []
    for name in method_names():
        entry = CASES.get(name, {}).get(kind)
        if entry is None or isinstance(entry, Exempt):
            continue
        if entry is True:
            entry = CASES[name]["device"]
        for variant, case in entry.items():
            out.append(pytest.param(name, variant, case, id=f"{name}:{variant}"))
    return out


def missing() -> list[str]:
    """``method/kind`` for every registered method lacking a case or exemption of a kind."""
    return [f"{m}/{k}" for m in method_names() for k in KINDS if k not in CASES.get(m, {})]
