"""thinwire: training neural networks across workers joined by thin links.

Independent Subnetwork Training (IST), data parallelism with gradient codecs, local SGD and
DiLoCo on one per-rank byte ledger; a planner that predicts memory, bytes and step time; a theory
lab for IST on quadratics. Use it from the ``thinwire`` command or in your own training loop
(after ``torch.distributed.init_process_group``, e.g. under ``torchrun``)::

    import thinwire
    ist = thinwire.IST(model, optimizer, local_steps=10)          # cut from the model's graph
    ist = thinwire.IST(gpt, optimizer, adapter=thinwire.GPTAdapter(gpt))  # heads, FFN neurons
    with thinwire.LocalSGD(model, optimizer, sync_every=10): ...   # torchft's shape
    with thinwire.DiLoCo(model, inner, outer, sync_every=100, fragments=4): ...  # Streaming
    with thinwire.SparseLoCo(model, inner, sync_every=50): ...     # top-k 2-bit, local EF
    opt = thinwire.DeMo(model.parameters(), lr=1e-3)               # DCT top-k of momenta
    thinwire.register_codec(ddp_model, "powersgd", rank=2)         # a DDP comm hook
    ft = thinwire.FaultTolerantDP(model, opt, replica_id="3", lighthouse=ADDR)  # torchft quorum
    ist = thinwire.FaultTolerantIST(model, opt, replica_id="w3", lighthouse=ADDR, workers=4,
                                    example_input=x)              # IST that outlives a worker
    comm = thinwire.Comm(); comm.ledger.totals()                   # every byte, counted

Names are imported on first use, so ``import thinwire`` itself is light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS: dict[str, str] = {
    # Independent Subnetwork Training
    "IST": "thinwire.strategies.ist.core:IST",
    "ISTAdapter": "thinwire.models.adapter:ISTAdapter",
    "ISTPlan": "thinwire.models.adapter:ISTPlan",
    "linear_stack": "thinwire.models.adapter:linear_stack",
    "derive_adapter": "thinwire.models.graph_adapter:derive_adapter",
    "GPTAdapter": "thinwire.models.gpt:GPTAdapter",
    "ResISTAdapter": "thinwire.models.resnet:ResISTAdapter",
    "GISTAdapter": "thinwire.models.gcn:GISTAdapter",
    # local methods
    "LocalSGD": "thinwire.strategies.averaging:LocalSGD",
    "DiLoCo": "thinwire.strategies.diloco:DiLoCo",
    "SparseLoCo": "thinwire.strategies.sparseloco:SparseLoCo",
    "DeMo": "thinwire.strategies.demo:DeMo",
    # pipeline model parallelism with compressed boundaries
    "Pipeline": "thinwire.strategies.pipeline.schedule:Pipeline",
    "Boundaries": "thinwire.strategies.pipeline.schedule:Boundaries",
    # SLIDE: LSH-selected sparse training of a wide layer
    "SLIDELayer": "thinwire.strategies.slide.layer:SLIDELayer",
    "active_softmax_loss": "thinwire.strategies.slide.layer:active_softmax_loss",
    # codecs as DDP communication hooks
    "ddp_hook": "thinwire.compression:ddp_hook",
    "register_codec": "thinwire.compression:register",
    "rebuild_buckets": "thinwire.compression:rebuild_buckets",
    "build_codec": "thinwire.compression:build",
    # fault tolerance without a restart (torchft's quorum)
    "FaultTolerantDP": "thinwire.strategies.fault:FaultTolerantDP",
    "FaultTolerantIST": "thinwire.strategies.ist.fault:FaultTolerantIST",
    "Lighthouse": "thinwire.runtime.ft:Lighthouse",
    # the communication layer and its ledger
    "Comm": "thinwire.runtime.comm:Comm",
    "Ledger": "thinwire.runtime.ledger:Ledger",
    "Mesh": "thinwire.runtime.mesh:Mesh",
    # models, data and tasks of the registries
    "MODELS": "thinwire.models:MODELS",
    "DATASETS": "thinwire.data:DATASETS",
    "METHODS": "thinwire.strategies:METHODS",
    "task_for": "thinwire.data.task:task_for",
    "recalibrate_batchnorm": "thinwire.models.norms:recalibrate_batchnorm",
    # running a config
    "load_config": "thinwire.config:load",
    "run_config": "thinwire.run:run_config",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'thinwire' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
