"""The dataset registry's vocabulary: an entry per dataset, where its files come from.

A dataset is one :class:`DataEntry` in its own module, registered by one line in
:data:`thinwire.data.DATASETS`. Its ``load(source, options, seed)`` returns a
:class:`~thinwire.data.datasets.Dataset`; ``options`` is an instance of the entry's own options
dataclass (``[data]`` keys beyond the common ones of :class:`DataSource`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from thinwire.options import NoOptions, Registry


@dataclass(frozen=True)
class DataSource:
    """Where and how much: the ``[data]`` options every dataset shares."""

    dir: str = ""
    """A directory holding the dataset's files ("" : the loader's standard places)."""
    download: bool = False
    """Allow fetching missing files from the canonical source."""
    limit_train: int = 0
    """Use only this many training examples (0: all)."""
    limit_test: int = 0
    """Use only this many test examples (0: all)."""


@dataclass(frozen=True)
class DataEntry:
    """One dataset: its name, kind (:data:`~thinwire.data.datasets.KINDS`), loader and options."""

    name: str
    kind: str
    load: Callable[[DataSource, Any, int], Any]
    """``(source, options, seed) -> Dataset`` (:class:`thinwire.data.datasets.Dataset`)."""
    summary: str
    options: type = NoOptions
    batch_size: int = 0
    """The run's ``train.batch_size`` when the config sets none (0: ``[train]``'s default), for a
    dataset too small for that default (Cora's 140 labelled nodes are 35 a worker over the
    default 4 workers)."""


DATASETS: Registry[DataEntry] = Registry("dataset", {
    "fashion-mnist": "thinwire.data.datasets:FASHION_MNIST",
    "digits": "thinwire.data.datasets:DIGITS",
    "teacher": "thinwire.data.datasets:TEACHER",
    "tinyshakespeare": "thinwire.data.text:TINYSHAKESPEARE",
    "cora": "thinwire.data.graph:CORA",
    "sbm": "thinwire.data.graph:SBM",
    "clicks": "thinwire.data.clicks:CLICKS",
    "xc-synth": "thinwire.data.xc:SYNTH",
    "xc-repo": "thinwire.data.xc:REPO",
    "shakespeare-words": "thinwire.data.shakespeare_words:SHAKESPEARE_WORDS",
})
"""Every dataset by name; each entry lives in its own module."""
