#!/usr/bin/env bash
# The package as a user gets it: build the sdist and wheel into dist/, check them (twine, and the
# wheel holds lightning_sdp4bit with its strategies and kernels subpackages and nothing else),
# install the wheel into a fresh virtual environment outside the repository, and fit a tiny
# LightningModule there with Trainer(strategy="sdp4bit", accelerator="cpu", devices=2).
# Run by `make wheel-check` (after `make install`, which brings `build` and `twine`).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
BIN=${VENV:-.venv}/bin
TORCH=${TORCH:-torch==2.13.0}

rm -rf dist build/lib build/bdist.*
"$BIN/python" -m build --outdir dist . >/dev/null
"$BIN/twine" check --strict dist/*
WHEEL=$(ls dist/*.whl)

# Every module of the three source folders is in the wheel, under lightning_sdp4bit/, and the
# wheel holds nothing else but its metadata (no tests/, no top-level strategies or kernels).
"$BIN/python" - "$WHEEL" <<'EOF'
import sys, zipfile
from pathlib import Path

names = set(zipfile.ZipFile(sys.argv[1]).namelist())
expected = {p.as_posix() for p in Path("lightning_sdp4bit").rglob("*.py")}
expected |= {f"lightning_sdp4bit/{folder}/{p.name}" for folder in ("strategies", "kernels") for p in Path(folder).glob("*.py")}
metadata = {n for n in names if n.split("/")[0].endswith(".dist-info")}
missing, extra = expected - names, names - expected - metadata
if missing or extra:
    sys.exit(f"{sys.argv[1]}: missing {sorted(missing)}, unexpected {sorted(extra)}")
print(f"{sys.argv[1]}: {len(expected)} modules, {len(metadata)} metadata files, nothing else")
EOF

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The user's environment: no PYTHONPATH, and a working directory outside the repository, so that
# only the installed wheel can be imported.
unset PYTHONPATH
"${PYTHON:-python3}" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet "$TORCH"
"$WORK/venv/bin/python" -m pip install --quiet "$REPO/$WHEEL"
"$WORK/venv/bin/python" -m pip check

cat >"$WORK/fit.py" <<'EOF'
"""A user's first fit: a tiny regression on 2 CPU processes with strategy="sdp4bit"."""

import importlib.metadata
import math
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_sdp4bit  # registers strategy="sdp4bit"


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    assert "site-packages" in lightning_sdp4bit.__file__, lightning_sdp4bit.__file__  # the wheel, not a tree
    assert lightning_sdp4bit.__version__ == importlib.metadata.version("lightning-sdp4bit")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=generator)
    y = x @ torch.randn(32, 1, generator=generator)
    module = Regression()
    trainer = L.Trainer(
        strategy="sdp4bit",
        accelerator="cpu",
        devices=2,
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    first, last = module.losses[0], module.losses[-1]
    if not (math.isfinite(last) and last < first):
        sys.exit(f"rank {trainer.global_rank}: the loss did not fall: {first:.4f} -> {last:.4f}")
    if trainer.global_rank == 0:
        print(f"lightning-sdp4bit {lightning_sdp4bit.__version__}: first loss {first:.4f}, final loss {last:.4f}")
EOF
cd "$WORK"
"$WORK/venv/bin/python" fit.py 2>"$WORK/fit.err" | tee "$WORK/fit.out" || { tail -n 40 "$WORK/fit.err"; exit 1; }
grep -q "final loss" "$WORK/fit.out" || { echo "wheel smoke: no final loss printed"; tail -n 40 "$WORK/fit.err"; exit 1; }
echo "wheel smoke: $WHEEL installs and fits outside the repository"
