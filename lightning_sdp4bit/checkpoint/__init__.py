"""Sharded checkpoints: save, load (on any world size), verify, and consolidate into one ordinary file.

A checkpoint is a directory (the format, `files`):

    x.ckpt/manifest.json                 the commit record: sizes and XXH3-64 checksums of the files
                                         below,
                                         each shard's rank and tensors, every parameter's shape
    x.ckpt/gen_000003/meta.pt            rank 0: format, world size, bucket layout, config, the
                                         engine's step, untrained entries (buffers, frozen
                                         parameters), the optimizers' classes and parameter names,
                                         and the rest of Lightning's checkpoint dict (loops,
                                         schedulers, ...)
    x.ckpt/gen_000003/shard_00000.pt     one per rank, saved at the engine's step (meta.pt's):
                                         per bucket the fp32 master shard [S] and
                                         the model weights' slice [S], the rank's optimizer state
                                         dicts, and for each optimizer parameter index the
                                         (parameter name, first element, element count) it steps

One concern per module:
- `files`: names, the manifest, checksums, completeness and verification, the ranks' agreement;
- `save`: the crash-safe save (a crash at any instant leaves the old or the new checkpoint);
- `load`: loading into a running engine, same layout or resharded; ordinary checkpoints;
- `consolidate`: one ordinary Lightning checkpoint from a sharded one;
- `lock`: one writer per path (`x.ckpt.lock`, held by rank 0 during a save);
- `recovery`: finishing a first save interrupted between its commit and its last rename;
- `upgrade`: converting the older formats in place (`python -m lightning_sdp4bit.checkpoint.upgrade`);
- `unpickling`: reading every file with torch's weights_only unpickler, so that none can run code;
- `changes`: what a resume changes (another optimizer class, another config, files of several saves).
"""

from lightning_sdp4bit.checkpoint.consolidate import consolidate_checkpoint
from lightning_sdp4bit.checkpoint.files import FORMAT, CheckpointError, is_sharded_checkpoint
from lightning_sdp4bit.checkpoint.load import (
    check_state_dict,
    complete_partial,
    find_checkpoint,
    full_state_from_lightning,
    load_full_state,
    load_sharded,
    read_full_state,
    read_meta,
)
from lightning_sdp4bit.checkpoint.save import remove_checkpoint, save_sharded

__all__ = [
    "FORMAT",
    "CheckpointError",
    "check_state_dict",
    "complete_partial",
    "consolidate_checkpoint",
    "find_checkpoint",
    "full_state_from_lightning",
    "is_sharded_checkpoint",
    "load_full_state",
    "load_sharded",
    "read_full_state",
    "read_meta",
    "remove_checkpoint",
    "save_sharded",
]
