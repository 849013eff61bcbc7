"""A training script that one rank SIGTERMs itself in, as a preemption would: run by
tests/test_preemption.py under Lightning's own launcher (popen) and under torchrun.

    python tests/preemption_script.py '{"strategy": "sdp4bit", "directory": "...", "rank": 1,
                                        "save": 2, "at": "fsync"}'

Options: `strategy` "sdp4bit" or "ddp"; `directory` for the checkpoints (ModelCheckpoint with a
fixed name, saved after every step) and the per-rank result files; `rank` the rank that gets
SIGTERM; `save` the training step whose save (or whose backward) it comes in; `at` where: the
first file operation of that save whose name (and, after a colon, file) match, e.g.
"replace:manifest.json", or "backward" (a parameter's gradient hook, while the bucket exchanges
started earlier in that backward are in flight). Each rank writes result_<rank>.json: how its
fit ended and the last step it saw.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_helpers import FileOps  # noqa: E402
from models import TinyLMModule  # noqa: E402

MAX_STEPS = 6


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def matching_op(spec: str):
    """The FileOps position test for `spec` ("name" or "name:file")."""
    name, _, label = spec.partition(":")
    return lambda op: op[0] == name and (not label or op[1] == label)


def main() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_sdp4bit  # noqa: F401
    from lightning_sdp4bit import SDP4BitStrategy

    options = json.loads(sys.argv[1])
    directory = Path(options["directory"])
    strategy_class = SDP4BitStrategy if options["strategy"] == "sdp4bit" else DDPStrategy
    strategy = (
        SDP4BitStrategy(config={"preset": "baseline", "bucket_numel": 3000})
        if options["strategy"] == "sdp4bit"
        else DDPStrategy()
    )
    recorded: list = []
    original = strategy_class.save_checkpoint

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        step = checkpoint["global_step"]
        if step == options["save"] - 1:  # the previous save: learn the file operations of one
            with FileOps() as ops:
                original(self, checkpoint, filepath, storage_options)
            recorded.extend(ops.ops)
            print(f"rank {self.global_rank} save ops: {ops.ops}", file=sys.stderr)
            return None
        if step != options["save"] or self.global_rank != options["rank"] or options["at"] == "backward":
            return original(self, checkpoint, filepath, storage_options)
        at = next(i for i, op in enumerate(recorded) if matching_op(options["at"])(op))
        with FileOps(fail_at=at, action=sigterm_self, proceed=True):
            return original(self, checkpoint, filepath, storage_options)

    strategy_class.save_checkpoint = save_checkpoint

    class SigtermInBackward(Callback):
        """SIGTERM from the first layer's gradient hook (the last gradients of backward)."""

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step + 1 == options["save"] and trainer.global_rank == options["rank"]:
                first = module.model.embed.weight
                self.handle = first.register_post_accumulate_grad_hook(lambda p: sigterm_self())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if getattr(self, "handle", None) is not None:
                self.handle.remove()
                self.handle = None

    class LastStep(Callback):
        def __init__(self):
            self.step = 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.step = trainer.global_step

    last = LastStep()
    callbacks = [ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1), last]
    if options["at"] == "backward":
        callbacks.append(SigtermInBackward())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    torch.set_num_threads(1)
    outcome = "finished"
    try:
        trainer.fit(TinyLMModule(dataset_size=32))
    except SystemExit:
        outcome = "sigterm"
        raise
    finally:
        rank = trainer.global_rank
        result = {"rank": rank, "outcome": outcome, "step": last.step, "received": trainer.received_sigterm}
        (directory / f"result_{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
