"""The training script that tests/integration/test_cluster.py runs on every rank of a cluster (under
torchrun).

    python -m torch.distributed.run ... tests/support/cluster_worker.py '<json options>'

Options (JSON, all optional): "steps" (optimizer steps, default 4), "config" (SDP4BitConfig dict),
"timeout_s" (the strategy's collective timeout), "save" (a checkpoint path written after fit),
"progress" (a directory: rank r writes its global step to step_<r> after each optimizer step),
"result_at_step" (save the result after that optimizer step, from a hook, and train on: a run
that is stopped from outside still leaves its results). Each rank saves {"weights",
"comm_stats", "masters", "world", "local_world"} through namespace_cluster.save_result, after fit unless
"result_at_step" is given.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import namespace_cluster
import torch
from lightning_runs import TRAINER_DEFAULTS
from models import TinyLMModule


def main(options: dict) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import lightning_sdp4bit  # noqa: F401  (registers the strategy)
    from lightning_sdp4bit import SDP4BitStrategy

    torch.set_num_threads(1)
    progress = options.get("progress")
    result_at_step = options.get("result_at_step")

    class Progress(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            # A hook completes the weight exchange first, so the weights saved here are complete.
            if trainer.global_step == result_at_step:
                _save(module, strategy, trainer.world_size)
            if progress:
                Path(progress, f"step_{trainer.global_rank}").write_text(str(trainer.global_step))

    timeout = datetime.timedelta(seconds=options.get("timeout_s", 120))
    strategy = SDP4BitStrategy(config={"bucket_numel": 3000, **options.get("config", {})}, timeout=timeout)
    hosts = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = pl.Trainer(
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=hosts,
        strategy=strategy,
        max_steps=options.get("steps", 4),
        callbacks=[Progress()],
        **TRAINER_DEFAULTS,
    )
    module = TinyLMModule(**options.get("module", {}))
    trainer.fit(module)
    if options.get("save"):
        trainer.save_checkpoint(options["save"])
    if result_at_step is None:
        _save(module, strategy, trainer.world_size)
    torch.distributed.destroy_process_group()


def _save(module, strategy, world: int) -> None:
    masters = {}
    for records in strategy.engine.fragments_by_name.values():
        for record in records:
            masters[(record.fragment.name, record.fragment.param_start)] = record.master.clone()
    namespace_cluster.save_result(
        {
            "weights": {n: p.detach().float().clone() for n, p in module.model.named_parameters()},
            "comm_stats": dict(strategy.comm_stats),
            "masters": masters,
            "world": world,
            "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
        }
    )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
