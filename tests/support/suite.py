"""The test suite's pytest plugin, loaded by the conftest.py at the root of each test tree (tests/
and benchmarks/tests/) through `pytest_plugins`; pyproject's `pythonpath` puts tests/support, this
folder, on sys.path. It holds what every test layer shares:
- tests marked `gpu` run only where CUDA is available, and their skip prints its reason (pytest -ra);
- without CUDA, the Triton kernels (test_kernels_*.py) run in Triton's CPU interpreter;
- the `benchmark_script` fixture imports a benchmarks/ script by name."""

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
    drop the benchmarks/ modules it loaded. Some scripts put benchmarks/ or examples/ first on
    sys.path: what later tests import by bare name, and the forkserver that starts their workers
    (it copies sys.path once, when it starts), must not depend on which script ran before."""
    import importlib
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.setattr(sys, "path", [str(benchmarks), *sys.path])
    before = set(sys.modules)
    yield importlib.import_module
    # The scripts' own new modules only: a package such as triton cannot be imported twice.
    for name in set(sys.modules) - before:
        if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == benchmarks:
            del sys.modules[name]
