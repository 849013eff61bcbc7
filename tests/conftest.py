"""Test-wide switches: tests marked `slow` run only with SDP4BIT_SLOW=1, tests marked `gpu` only
where CUDA is available; each skip prints its reason (pytest -ra). Without CUDA, the Triton
kernels (tests/test_kernels_*.py) run in Triton's CPU interpreter."""

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when lightning_sdp4bit.kernels is
# first imported, which is after this file is loaded. It changes nothing else: the package's
# dispatch sends only CUDA tensors to the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("SDP4BIT_SLOW") == "1"
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: set SDP4BIT_SLOW=1 (make test-all) to run it"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA device"))
