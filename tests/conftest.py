"""Test-wide switches: tests marked `slow` run only with SDP4BIT_SLOW=1, tests marked `gpu` only
where CUDA is available; each skip prints its reason (pytest -ra)."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("SDP4BIT_SLOW") == "1"
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: set SDP4BIT_SLOW=1 (make test-all) to run it"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA device"))
