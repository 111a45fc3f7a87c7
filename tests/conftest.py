import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU smoke tests run only where one is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
