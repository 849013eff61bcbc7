"""Test-wide switches: tests marked `gpu` run only where CUDA is available, and their skip prints
its reason (pytest -ra). Without CUDA, the Triton kernels (tests/test_kernels_*.py) run in
Triton's CPU interpreter. The whole suite takes about 8.5 minutes on 2 CPU cores (measured from
a fresh clone on 2026-12-02: `make test` 563 s with the install, 496 s of tests), most of it in
multi-process Lightning fits, the namespace cluster, the stall and preemption jobs and the
checkpoint fault injection; workers start from a forkserver (tests/distributed.py), so nothing
is marked slow."""

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when lightning_sdp4bit.kernels is
# first imported, which is after this file is loaded. It changes nothing else: the package's
# dispatch sends only CUDA tensors to the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA device"))


@pytest.fixture
def benchmark_script(monkeypatch):
    """Import a benchmarks/ script by name; afterwards, undo what the import did to sys.path and
    drop the benchmarks/ modules it loaded. Some scripts put benchmarks/ first on sys.path, where
    its cluster.py would shadow tests/cluster.py for the workers that later tests start."""
    import importlib
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.setattr(sys, "path", [str(benchmarks), *sys.path])
    before = set(sys.modules)
    yield importlib.import_module
    # The scripts' own new modules only: a package such as triton cannot be imported twice.
    for name in set(sys.modules) - before:
        if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == benchmarks:
            del sys.modules[name]
