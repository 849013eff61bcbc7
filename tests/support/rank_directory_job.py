"""A 2-rank CPU fit started as a user starts one (Lightning's popen launcher starts rank 1), in
which rank 1 runs in another working directory, as on a node with its own: the relative
`ckpt_path` exists only where rank 0 looks for it.

    python tests/support/rank_directory_job.py RANK_1_DIRECTORY

Run from a directory that holds `rel.ckpt`. Rank 1 changes into RANK_1_DIRECTORY before fit.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_runs import TRAINER_DEFAULTS  # noqa: E402
from models import TinyLMModule  # noqa: E402


def main(rank_1_directory: str) -> None:
    import lightning.pytorch as pl

    from lightning_sdp4bit import SDP4BitStrategy

    if os.environ.get("LOCAL_RANK") == "1":  # set by the launcher for the rank it starts
        os.chdir(rank_1_directory)
    trainer = pl.Trainer(devices=2, strategy=SDP4BitStrategy(), max_steps=1, **TRAINER_DEFAULTS)
    trainer.fit(TinyLMModule(dataset_size=1, repeat=32), ckpt_path="rel.ckpt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
