"""Fixtures shared by every test folder."""

from __future__ import annotations

import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def release_cached_gpu_memory(request):
    """GPU test files share the one GPU across xdist workers: after each GPU test, hand its cached
    blocks back so that a worker's largest test does not keep them from the others (the caching
    allocator would hold them for the rest of the file)."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture
def seed(request) -> int:
    """A per-test seed derived from the test id, so reruns are reproducible but tests differ."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value
