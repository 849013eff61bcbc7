"""A training script that one rank SIGTERMs itself in, as a preemption would: run by
tests/integration/test_preemption.py under Lightning's own launcher (popen) and under torchrun.

    python tests/support/preemption_script.py '{"strategy": "sdp4bit", "directory": "...", "rank": 1,
                                        "save": 2, "at": "fsync"}'

Options: `strategy` "sdp4bit" or "ddp"; `directory` for the checkpoints (ModelCheckpoint with a
fixed name, saved after every step) and the per-rank result files; `rank` the rank that gets
SIGTERM; `save` the training step whose save (or whose backward) it comes in; `at` where: the
first file operation of that save whose name (and, after a colon, file) match, e.g.
"replace:manifest.json.tmp", or "backward" (a parameter's gradient hook, while the bucket exchanges
started earlier in that backward are in flight). Each rank writes result_<rank>.json: how its
fit ended ("sigterm": Lightning's SIGTERMException, or "finished") and its global step then.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_runs import TRAINER_DEFAULTS  # noqa: E402
from models import TinyLMModule  # noqa: E402
from preemption_helpers import sigterm_in_backward, sigterm_in_save  # noqa: E402

MAX_STEPS = 6


def main() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_sdp4bit  # noqa: F401
    from lightning_sdp4bit import SDP4BitStrategy

    options = json.loads(sys.argv[1])
    directory = Path(options["directory"])
    strategy = (
        SDP4BitStrategy(config={"preset": "baseline", "bucket_numel": 3000})
        if options["strategy"] == "sdp4bit"
        else DDPStrategy()
    )
    callbacks = [ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1)]
    if options["at"] == "backward":
        callbacks.append(sigterm_in_backward(options["rank"], options["save"]))
        injected = nullcontext()
    else:
        injected = sigterm_in_save(type(strategy), options["rank"], options["at"], options["save"])
    settings = {**TRAINER_DEFAULTS, "enable_checkpointing": True}  # the ModelCheckpoint above
    trainer = pl.Trainer(devices=2, strategy=strategy, max_steps=MAX_STEPS, callbacks=callbacks, **settings)
    torch.set_num_threads(1)
    outcome = "finished"
    try:
        with injected:
            trainer.fit(TinyLMModule(dataset_size=32))
    except SystemExit:
        outcome = "sigterm"
        raise
    finally:
        rank = trainer.global_rank
        result = {"rank": rank, "outcome": outcome, "step": trainer.global_step}
        (directory / f"result_{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
