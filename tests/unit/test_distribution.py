"""What the distribution declares, against the tree:
- every third-party module imported by the package (lightning_sdp4bit/, strategies/, kernels/)
  comes from a distribution in its dependencies; the examples' and benchmarks' may also come from
  their extras, the tests' from `dev` (the import -> distribution map is the installed one);
- the version is written once: `lightning_sdp4bit.__version__` is the installed metadata's;
- `make test-gpu` refuses at once without CUDA, naming the interpreter, before installing anything.
The built wheel's contents and a fit from it in a fresh environment: .ci/wheel_smoke.sh."""

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

import lightning_sdp4bit

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTION = "lightning-sdp4bit"
# Folders whose scripts put one another on sys.path (benchmarks import examples' gpt and the
# tests' models): their module names are local, not third-party.
SCRIPT_FOLDERS = ("examples", "benchmarks")
# Test trees: pytest puts each of their folders on sys.path, so their module names are local too.
TEST_TREES = ("tests", "benchmarks/tests")
# Source folder -> the extras whose distributions its imports may come from (besides the dependencies).
# A file belongs to the innermost folder that holds it (benchmarks/tests/ is not benchmarks/).
EXTRAS = {
    "lightning_sdp4bit": (),
    "strategies": (),
    "kernels": (),
    "examples": ("examples", "litgpt"),
    "benchmarks": ("examples", "benchmarks"),
    "benchmarks/tests": ("dev",),
    "tests": ("dev",),
}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _allowed(extras: tuple[str, ...]) -> set[str]:
    """Distribution names of the dependencies and of `extras` (nested extras followed)."""
    allowed, pending, seen = set(), list(extras), set()
    for text in importlib.metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(text)
        if requirement.marker is None or "extra" not in str(requirement.marker):
            allowed.add(_normalized(requirement.name))
    while pending:
        extra = pending.pop()
        seen.add(extra)
        for text in importlib.metadata.requires(DISTRIBUTION) or []:
            requirement = Requirement(text)
            if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}):
                if _normalized(requirement.name) == DISTRIBUTION:
                    pending += [e for e in requirement.extras if e not in seen]
                else:
                    allowed.add(_normalized(requirement.name))
    return allowed


def _local_modules() -> set[str]:
    names = {"lightning_sdp4bit"}
    for folder in SCRIPT_FOLDERS:
        names |= {p.stem for p in (REPO / folder).glob("*.py")}
        names |= {p.name for p in (REPO / folder).iterdir() if (p / "__init__.py").exists()}
    for tree in TEST_TREES:
        names |= {p.stem for p in (REPO / tree).rglob("*.py")}
    return names


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_every_third_party_import_is_declared():
    local, providers = _local_modules(), importlib.metadata.packages_distributions()
    undeclared = []
    for folder, extras in EXTRAS.items():
        allowed = _allowed(extras)
        for path in sorted((REPO / folder).rglob("*.py")):
            if max((f for f in EXTRAS if path.is_relative_to(REPO / f)), key=len) != folder:
                continue
            for root in sorted(_imported_roots(path) - local - set(sys.stdlib_module_names)):
                distributions = {_normalized(d) for d in providers.get(root, [])}
                if not distributions & allowed:
                    where = path.relative_to(REPO)
                    undeclared.append(f"{where}: {root} (from {sorted(distributions) or 'no installed distribution'})")
    assert not undeclared, "imports whose distribution pyproject.toml does not declare there:\n" + "\n".join(undeclared)


def test_the_version_is_the_installed_metadata():
    assert lightning_sdp4bit.__version__ == importlib.metadata.version(DISTRIBUTION)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: make test-gpu would run the GPU suite")
def test_make_test_gpu_refuses_without_cuda(tmp_path):
    install = tmp_path / "gpu-install"
    result = subprocess.run(
        ["make", "-s", "test-gpu", f"GPU_PYTHON={sys.executable}", f"GPU_INSTALL={install}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"make test-gpu: no CUDA device for {sys.executable}" in result.stderr
    assert not install.exists()
