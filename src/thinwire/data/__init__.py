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
from thinwire.data.registry import DATASETS, DataEntry, DataSource
from thinwire.data.sharding import SHARD_MODES, all_shards, label_histogram, shard_indices
from thinwire.data.stream import BatchStream

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
