"""The planner: memory, bytes and step time of a training plan, as pure functions of specs.

Models the parallel strategies of Megatron-LM (Narayanan et al. 2021; Korthikanti et al. 2022), ZeRO
(Rajbhandari et al. 2020) and the methods thinwire trains in one alpha-beta cost model, their
bytes from the methods' own traffic functions (:mod:`thinwire.planner.methods`); validated
against published runs by ``thinwire plan --validate`` (docs/PLANNER.md). No process group, no
torch at import time. Predicting thinwire's own runs on this machine is
:mod:`thinwire.measure`'s.

    from thinwire.planner import load_model, load_cluster, StrategySpec, predict
    pred = predict(load_model("gpt3-175b"), load_cluster("a100-80gb", nodes=8),
                   StrategySpec(tp=8, pp=8, micro_batches=1536, sequence_parallel=True,
                                recompute="selective", interleave=3))
    pred.step_time, pred.memory.total, pred.breakdown.as_dict()

A model of one's own, with IST priced from the plan derived from its graph
(:func:`~thinwire.planner.usermodel.model_spec_from_example`):

    spec = model_spec_from_example(MyNet(), torch.randn(8, 1, 28, 28), min_units=4)
    predict(spec, load_cluster("cpu-1gbe", nodes=4), StrategySpec(method="ist"))
"""

from thinwire.planner.insight import crossover_bandwidth, knee, scaling
from thinwire.planner.memory import MemoryBreakdown, memory_breakdown
from thinwire.planner.methods import per_step, resolve, worker_params
from thinwire.planner.presets import list_presets, load_cluster, load_model, model_spec_from_module
from thinwire.planner.search import search
from thinwire.planner.specs import ClusterSpec, CountedSpec, MLPSpec, ModelSpec, TransformerSpec
from thinwire.planner.step import Prediction, StepBreakdown, predict
from thinwire.planner.strategy import StrategySpec, check_strategy
from thinwire.planner.usermodel import model_spec_from_example

__all__ = [
    "ClusterSpec",
    "CountedSpec",
    "MLPSpec",
    "MemoryBreakdown",
    "ModelSpec",
    "Prediction",
    "StepBreakdown",
    "StrategySpec",
    "TransformerSpec",
    "check_strategy",
    "crossover_bandwidth",
    "knee",
    "list_presets",
    "load_cluster",
    "load_model",
    "memory_breakdown",
    "model_spec_from_example",
    "model_spec_from_module",
    "per_step",
    "predict",
    "resolve",
    "scaling",
    "search",
    "worker_params",
]
