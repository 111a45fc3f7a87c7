"""A user's own torch model as a planner spec, with the IST plan derived from its graph.

IST (Yuan et al. 2022, "Distributed Learning of Fully Connected Neural Networks using Independent
Subnet Training"; ResIST, Dun et al. 2022, for residual networks) trains disjoint subnets of one
model; what it sends is fixed by which tensors its plan cuts and which it shares. For a model
the user wrote, that plan comes from the model's graph
(:func:`thinwire.models.graph_adapter.derive_adapter`), exactly the plan ``thinwire.IST(model,
opt, example_input=x)`` trains with. :func:`model_spec_from_example` turns a module and one
example input into a :class:`~thinwire.planner.specs.CountedSpec` carrying that plan, without
training anything:

1. derive the IST plan from the traced forward on the example (one line for a model the tracer
   cannot follow, or one with nothing to cut);
2. count trainable parameters, and training FLOPs per sample as 3 x the forward's FLOPs on the
   example (forward 1, backward 2: convolutions, matmuls and attention all counted) over its
   batch size;
3. return the CountedSpec; every planner function (``predict``, ``--crossover``, ``--scaling``)
   then prices IST from the plan with the ``ist`` method's own traffic formula, and data
   parallelism and the other methods from the same parameter layout.

:func:`load_module` builds ``ClassName()`` from ``FILE.py`` (``thinwire plan --model
FILE.py:ClassName``) and :func:`example_input` makes the input from a shape. torch is imported on
use only.

    from thinwire.planner import load_cluster, predict, StrategySpec
    from thinwire.planner.usermodel import model_spec_from_example
    spec = model_spec_from_example(MyCNN(), torch.randn(8, 1, 28, 28), min_units=4)
    pred = predict(spec, load_cluster("cpu-1gbe", nodes=4), StrategySpec(method="ist"))
    pred.traffic.dp, pred.step_time
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.planner.specs import CountedSpec

MODULE_REF = re.compile(r"(?P<path>.+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
"""``FILE.py:ClassName``, the form ``--model`` takes for a user's module."""


def is_module_ref(ref: str) -> bool:
    """Whether ``ref`` names a class in a Python file (``FILE.py:ClassName``) or a Hugging
    Face ``transformers`` config (a ``config.json``, or a folder holding one)."""
    return MODULE_REF.fullmatch(ref) is not None or _transformers_config(ref) is not None


def _transformers_config(ref: str) -> Path | None:
    """The ``config.json`` that ``ref`` names (the file, or a folder with one) when it is a
    ``transformers`` config (it has a ``model_type``); None otherwise."""
    import json

    path = Path(ref)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return path if isinstance(data, dict) and "model_type" in data else None


def load_transformers(path: Path) -> Any:
    """The model a ``transformers`` config describes, with fresh weights (``from_config``:
    nothing is downloaded): the config's first ``architectures`` class (``GPT2LMHeadModel``),
    else ``AutoModel``. One-line :class:`UsageError` when transformers is missing or the
    config does not build."""
    from thinwire.models.torchvision_ops import define_missing_torchvision_ops

    define_missing_torchvision_ops()  # transformers' model classes probe torchvision
    try:
        import transformers
    except ImportError:
        raise UsageError(f"--model {path}: a transformers config needs the transformers "
                         "package; pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(path.parent), local_files_only=True)
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        return cls(config) if cls is not None else transformers.AutoModel.from_config(config)
    except Exception as exc:  # the user's config: reported in one line
        raise UsageError(f"--model {path}: transformers could not build it "
                         f"({_first_line(exc)}); give a config.json transformers can load") \
            from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_module(ref: str) -> Any:
    """``ClassName()`` from ``FILE.py`` (``ref`` = ``FILE.py:ClassName``), built with its
    constructor's defaults, or a ``transformers`` config's model (:func:`load_transformers`). The file is executed as a module named after it, its folder on
    ``sys.path`` for its own imports. One-line :class:`UsageError` for a missing file, a file
    that fails to import, no such class, or a class that is not an ``nn.Module`` or needs
    arguments."""
    from torch import nn

    config = _transformers_config(ref)
    if config is not None:
        return load_transformers(config)
    m = MODULE_REF.fullmatch(ref)
    if m is None:
        raise UsageError(f"--model {ref!r}: write FILE.py:ClassName for a model of your own")
    path, name = Path(m.group("path")), m.group("name")
    if not path.is_file():
        raise UsageError(f"--model {ref}: no such file {path}; give an existing FILE.py")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"_thinwire_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"--model {ref}: {path} cannot be loaded as Python; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any error is theirs, reported in one line
        sys.modules.pop(spec.name, None)
        raise UsageError(f"--model {ref}: importing {path} failed ({_first_line(exc)}); fix the "
                         "file") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        classes = sorted(k for k, v in vars(module).items()
                         if isinstance(v, type) and issubclass(v, nn.Module)
                         and v.__module__ == module.__name__)
        raise UsageError(f"--model {ref}: {path} defines no nn.Module class {name}; its modules: "
                         + (", ".join(classes) or "none"))
    try:
        return cls()
    except Exception as exc:
        raise UsageError(f"--model {ref}: {name}() failed ({_first_line(exc)}); the planner "
                         "builds the model with its constructor's defaults: give every argument "
                         "a default") from None


MAX_EXAMPLE = 2**27
"""Most elements of ``--input``'s example (512 MiB of floats): it is run through the model."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``8x1x28x28`` -> (8, 1, 28, 28): the example input's shape, batch first."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--input {text!r}: write sizes joined by x, batch first, e.g. "
                         "8x1x28x28") from None
    if min(shape) < 1:
        raise UsageError(f"--input {text!r}: every size must be >= 1")
    if math.prod(shape) > MAX_EXAMPLE:
        raise UsageError(f"--input {text!r}: {math.prod(shape):.3g} elements, more than the "
                         f"example input's limit of 2**{MAX_EXAMPLE.bit_length() - 1}; give a "
                         "smaller batch (--global-batch sets the batch the plan prices)")
    return shape


def example_input(shape: tuple[int, ...], tokens: int = 0, seed: int = 0) -> Any:
    """An example input of ``shape``: token ids below ``tokens`` when it is > 0 (a model that
    embeds tokens), else standard normal floats; from a generator seeded with ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    try:
        if tokens > 0:
            return torch.randint(0, tokens, shape, generator=g)
        return torch.randn(shape, generator=g)
    except (RuntimeError, MemoryError) as exc:  # the allocation failed
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"--input {'x'.join(map(str, shape))}: the example input cannot be "
                         f"allocated ({first}); give a smaller shape") from None


def forward_flops(module: Any, example: Any) -> float:
    """FLOPs of one forward of ``module`` on ``example`` (torch's FLOP counter: matmuls,
    convolutions, attention), on a copy in training mode under no_grad, so the module itself
    (its BatchNorm statistics) is untouched."""
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    args = example if isinstance(example, tuple) else (example,)
    work = copy.deepcopy(module).train()
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            work(*args)
    except Exception as exc:
        raise UsageError(f"{type(module).__name__}: its forward on the example input failed "
                         f"({_first_line(exc)}); give the input shape (and --input-tokens for "
                         "token ids) the model takes") from None
    return float(counter.get_total_flops())


def model_spec_from_example(module: Any, example: Any, *, name: str = "", min_units: int = 2,
                            residual: str = "whole", embeddings: str = "shared",
                            shared: tuple[str, ...] = (), global_batch: int = 0
                            ) -> CountedSpec:
    """The planner's spec of ``module`` with the IST plan derived from its graph on ``example``
    (a tensor, or a tuple of the forward's positional arguments, batch first), steps 1-3 of the
    module docstring. ``min_units``: a group with fewer units is shared (pass the number of
    workers, as IST does); ``residual``, ``embeddings``, ``shared``: as
    :func:`~thinwire.models.graph_adapter.derive_adapter`. ``name``: the spec's name (default
    the class name); ``global_batch``: its default global batch in samples (0: none). Nothing
    is trained; the module is not modified."""
    from thinwire.models.graph_adapter import derive_adapter

    label = name or type(module).__name__
    first = example[0] if isinstance(example, tuple) else example
    batch = int(first.shape[0]) if getattr(first, "ndim", 0) >= 1 else 1
    adapter = derive_adapter(module, example, residual=residual, embeddings=embeddings,
                             shared=shared, min_units=max(2, min_units))
    flops = 3.0 * forward_flops(module, example) / max(batch, 1)
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if flops <= 0:
        raise UsageError(f"{label}: torch's FLOP counter found no matmul or convolution in its "
                         "forward; describe the model in a TOML file (kind = counted)")
    return CountedSpec(name=label, params=params, flops_per_sample=flops,
                       global_batch=global_batch, ist=adapter.plan)
