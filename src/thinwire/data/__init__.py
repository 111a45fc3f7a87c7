"""Data: real datasets offline, deterministic per-rank sharding, a stateless batch stream.

``load_dataset(name)`` gives a normalised :class:`Dataset` (Fashion-MNIST, scikit-learn digits,
or a synthetic teacher task); ``shard_indices`` cuts its train split into per-rank shards (iid or
label-skewed); a :class:`BatchStream` turns a shard into the mini-batch of any global step.
"""

from thinwire.data.datasets import (
    FASHION_MNIST_FILES,
    KINDS,
    Dataset,
    TeacherMLP,
    download_fashion_mnist,
    fashion_mnist_search_dirs,
    find_fashion_mnist,
    load_dataset,
    make_teacher,
    read_idx,
    stratified_subset,
)
from thinwire.data.registry import DataEntry, DataSource
from thinwire.data.sharding import SHARD_MODES, all_shards, label_histogram, shard_indices
from thinwire.data.stream import BatchStream
from thinwire.options import Registry

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

__all__ = [
    "DATASETS",
    "FASHION_MNIST_FILES",
    "SHARD_MODES",
    "KINDS",
    "BatchStream",
    "DataEntry",
    "DataSource",
    "Dataset",
    "TeacherMLP",
    "all_shards",
    "download_fashion_mnist",
    "fashion_mnist_search_dirs",
    "find_fashion_mnist",
    "label_histogram",
    "load_dataset",
    "make_teacher",
    "read_idx",
    "shard_indices",
    "stratified_subset",
]
