"""A 2-rank CPU job, started as a user would (`python tests/support/stall_job.py ...`, Lightning's
popen launcher starts the second rank), in which one rank stalls: it sleeps in its third step, as a
rank with a hung data loader would. The strategy's `timeout=` must end the job.

    python tests/support/stall_job.py trainer|fabric STALLED_RANK TIMEOUT_S
    torchrun --nproc-per-node 2 tests/support/stall_job.py trainer|fabric STALLED_RANK TIMEOUT_S

Each process writes its PID to $STALL_PIDS/rank<N>, so that the test can see which ones outlive
the job, and the stalled rank touches $STALL_PIDS/stalled before it sleeps.
"""

import datetime
import os
import sys
import time
from pathlib import Path

import torch

STALL_S = 600  # far beyond any timeout the test gives: the stalled rank never wakes by itself


def main(kind: str, stalled_rank: int, timeout_s: float) -> None:
    import lightning_sdp4bit

    timeout = datetime.timedelta(seconds=timeout_s)
    config = {"bucket_numel": 3000}
    if kind == "trainer":
        import lightning.pytorch as pl
        from models import TinyLMModule

        class Stalling(TinyLMModule):
            def training_step(self, batch, batch_idx):
                _record_and_maybe_stall(self.global_rank, stalled_rank, batch_idx)
                return super().training_step(batch, batch_idx)

        strategy = lightning_sdp4bit.SDP4BitStrategy(config=config, timeout=timeout)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Stalling())
    else:
        from fabric_runs import loss_of, setup
        from lightning.fabric import Fabric
        from models import batch

        strategy = lightning_sdp4bit.SDP4BitFabricStrategy(config=config, timeout=timeout)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        model, optimizer, _ = setup(fabric)
        for step in range(6):
            _record_and_maybe_stall(fabric.global_rank, stalled_rank, step)
            fabric.backward(loss_of(model, batch(fabric.global_rank, step), 1.0))
            optimizer.step()
            optimizer.zero_grad()
    raise SystemExit("the job finished although a rank stalled")


def _record_and_maybe_stall(rank: int, stalled_rank: int, step: int) -> None:
    (Path(os.environ["STALL_PIDS"]) / f"rank{rank}").write_text(str(os.getpid()))
    if rank == stalled_rank and step == 2:
        (Path(os.environ["STALL_PIDS"]) / "stalled").touch()  # the peers' timeout starts now
        time.sleep(STALL_S)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
