"""The installed package: subpackages map to the repo's top-level folders, no top-level
`strategies` or `kernels` module leaks onto the import path, and `import lightning_sdp4bit` is
quick (it imports neither torch nor lightning)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code, cwd):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_subpackages_are_the_top_level_folders(tmp_path):
    code = "import lightning_sdp4bit.strategies as s, lightning_sdp4bit.kernels as k; print(s.__file__, k.__file__)"
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    strategies, kernels = result.stdout.split()
    assert Path(strategies).parent == REPO / "strategies" or "site-packages" in strategies
    assert Path(kernels).parent == REPO / "kernels" or "site-packages" in kernels


def test_no_top_level_strategies_or_kernels_module(tmp_path):
    for name in ("strategies", "kernels"):
        result = _python(f"import {name}", tmp_path)
        assert result.returncode != 0 and "No module named" in result.stderr


def test_import_is_quick_and_has_no_heavy_side_effects(tmp_path):
    code = (
        "import sys, lightning_sdp4bit; print(sorted(m for m in ('torch', 'lightning', 'triton') if m in sys.modules))"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
