"""A checkpoint cannot run code, on 2 ranks:
- a checkpoint directory with a planted pickle payload (a global that calls `builtins.exec` when
  unpickled) in meta.pt or in a shard, its manifest's checksums recomputed as an attacker can:
  `load_sharded` (same layout and resharded), `read_meta`, `consolidate_checkpoint`, the upgrade
  tool (a sharded-v1 checkpoint), `Trainer.fit(ckpt_path=...)` and `load_from_checkpoint` each
  refuse it with a CheckpointError naming the file and `builtins.exec`, on every rank, the engine
  untouched, and the payload never runs (before, every one of them ran it);
- Lightning's `weights_only` is honoured for what Lightning puts in meta.pt: hyperparameters
  holding a `pathlib.PurePosixPath` are refused by default, naming meta.pt and the type, and load
  with `fit`, `validate` and `load_from_checkpoint` given `weights_only=False` (fit and validate
  dropped it before: Lightning 2.6 does not pass it to a strategy that restores after setup);
- what the package writes loads with weights_only=True: the Trainer's sharded checkpoint (it
  resumes) and the consolidated file (plain torch.load);
- Fabric's `load` honours its `weights_only` likewise for an entry of the user's own.
"""

import pathlib
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from checkpoint_helpers import make_engine, same, snapshot, train_step
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit
from models import TinyLMModule


class Payload:
    """Unpickles as a call of builtins.exec that writes the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('the payload ran')",))


def _plant(path: Path, name: str, marker: Path) -> None:
    """Add a Payload to `name` (meta.pt or a shard) of checkpoint `path`, and rewrite the manifest
    with the file's new size and XXH3-64, as whoever can write the directory can."""
    from lightning_sdp4bit.checkpoint.files import file_checksum, read_manifest, write_manifest

    manifest = read_manifest(path)
    file = path / manifest.generation / name
    content = torch.load(file, weights_only=True)
    content["planted"] = Payload(marker)
    torch.save(content, file)
    record = replace(manifest.files[name], size=file.stat().st_size, checksum=file_checksum(file))
    write_manifest(path, replace(manifest, files={**manifest.files, name: record}))


def _as_v1(current: Path, old: Path) -> None:
    """sharded-v1: meta.pt and the shards at the top, no manifest (see test_checkpoint_formats)."""
    old.mkdir()
    for file in (current / "gen_000000").iterdir():
        shutil.copyfile(file, old / file.name)


def _refusal(call, *args, **kwargs) -> str | None:
    """The CheckpointError that call(*args, **kwargs) raises; None if it raises none."""
    from lightning_sdp4bit.checkpoint import CheckpointError

    try:
        call(*args, **kwargs)
    except CheckpointError as error:
        return str(error)
    return None


def _planted_payloads(rank, world, directory):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint, load_sharded, read_meta, save_sharded
    from lightning_sdp4bit.checkpoint.upgrade import upgrade_checkpoint

    directory, marker = Path(directory), Path(directory) / "payload-ran"
    engine, optimizer = make_engine(rank, world)
    train_step(engine, optimizer, seed=1)
    save_sharded(engine, [optimizer], {}, directory / "good.ckpt", torch.distributed.barrier)
    train_step(engine, optimizer, seed=2)
    before = snapshot(engine, optimizer)
    if rank == 0:
        for name in ("meta.pt", "shard_00001.pt"):
            shutil.copytree(directory / "good.ckpt", directory / f"{name}.ckpt")
            _plant(directory / f"{name}.ckpt", name, marker)
        _as_v1(directory / "shard_00001.pt.ckpt", directory / "v1.ckpt")
    torch.distributed.barrier()
    resharded, resharded_optimizer = make_engine(rank, world, bucket_numel=5000)
    out = {}
    for name in ("meta.pt", "shard_00001.pt"):
        path = directory / f"{name}.ckpt"
        out[name, "load"] = _refusal(load_sharded, engine, [optimizer], path)
        out[name, "resharded"] = _refusal(load_sharded, resharded, [resharded_optimizer], path)
        out[name, "consolidate"] = _refusal(consolidate_checkpoint, path)
    out["meta.pt", "read_meta"] = _refusal(read_meta, directory / "meta.pt.ckpt")
    if rank == 0:
        out["v1", "upgrade"] = _refusal(upgrade_checkpoint, directory / "v1.ckpt")
    torch.distributed.barrier()
    return out, same(snapshot(engine, optimizer), before), marker.exists()


def test_a_planted_payload_is_refused_by_every_loader_and_never_runs(tmp_path):
    results = run_workers(_planted_payloads, 2, str(tmp_path))
    for rank, (out, unchanged, ran) in enumerate(results):
        assert not ran and unchanged, rank
        for (name, how), message in out.items():
            planted = "shard_00001.pt" if name == "v1" else name
            assert message is not None and f"{planted}: refused: it holds builtins.exec" in message, (how, message)
            assert "nothing of it ran" in message
        # Loading agrees across ranks: rank 0 reads only its own shard, and names rank 1's refusal.
        assert out["shard_00001.pt", "load"].startswith("rank 1: ")
        assert out["shard_00001.pt", "load"] == results[0][0]["shard_00001.pt", "load"]
    assert "nothing was converted" in results[0][0]["v1", "upgrade"]
    assert not (tmp_path / "v1.ckpt" / "manifest.json").exists()


DATA_DIR = pathlib.PurePosixPath("data")


class PathHyperparameter(TinyLMModule):
    """Lightning puts `data` (a pathlib.PurePosixPath, which weights_only loading refuses) into
    the checkpoint's hyperparameters."""

    def __init__(self, data: pathlib.PurePosixPath = DATA_DIR, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()


DATA = dict(dataset_size=1, repeat=32)


def _lightning(rank, world, directory):
    from lightning_sdp4bit.checkpoint import consolidate_checkpoint

    directory, marker = Path(directory), Path(directory) / "payload-ran"
    plain, with_path = str(directory / "plain.ckpt"), str(directory / "path.ckpt")
    trainer = make_trainer(world, sdp4bit(), max_steps=2)
    trainer.fit(TinyLMModule(**DATA))
    trainer.save_checkpoint(plain)
    trainer = make_trainer(world, sdp4bit(), max_steps=2)
    trainer.fit(PathHyperparameter(**DATA))
    trainer.save_checkpoint(with_path)
    if rank == 0:
        shutil.copytree(plain, directory / "planted.ckpt")
        _plant(directory / "planted.ckpt", "meta.pt", marker)
        consolidate_checkpoint(plain, directory / "consolidated.ckpt")
    torch.distributed.barrier()

    def fit(path, **kwargs):
        trainer = make_trainer(world, sdp4bit(), max_steps=3)
        trainer.fit(PathHyperparameter(**DATA), ckpt_path=path, **kwargs)
        return trainer.global_step

    def validate(path, **kwargs):
        trainer = make_trainer(world, sdp4bit())
        trainer.validate(PathHyperparameter(**DATA), ckpt_path=path, verbose=False, **kwargs)
        return "validated"

    out = {
        "fit planted": _refusal(fit, str(directory / "planted.ckpt")),
        "fit path": _refusal(fit, with_path),
        "fit path trusted": fit(with_path, weights_only=False),
        "fit plain": fit(plain),
        "validate path": _refusal(validate, with_path),
        "validate path trusted": validate(with_path, weights_only=False),
    }
    if rank == 0:
        out["load planted"] = _refusal(TinyLMModule.load_from_checkpoint, directory / "planted.ckpt")
        out["load path"] = _refusal(PathHyperparameter.load_from_checkpoint, with_path)
        trusted = PathHyperparameter.load_from_checkpoint(with_path, weights_only=False)
        out["load path trusted"] = str(trusted.hparams.data)
        consolidated = torch.load(directory / "consolidated.ckpt", weights_only=True)
        out["consolidated"] = (
            consolidated["global_step"],
            sorted(consolidated["state_dict"]) == sorted(TinyLMModule(**DATA).state_dict()),
        )
    torch.distributed.barrier()
    out["ran"] = marker.exists()
    return out


def test_lightning_honours_weights_only_and_refuses_a_payload(tmp_path):
    results = run_workers(_lightning, 2, str(tmp_path))
    for rank, out in enumerate(results):
        assert not out["ran"], rank
        planted, path = out["fit planted"], out["fit path"]
        assert planted is not None and "planted.ckpt/gen_000000/meta.pt: refused: it holds builtins.exec" in planted
        assert path is not None and "path.ckpt/gen_000000/meta.pt: refused: it holds pathlib.PurePosixPath" in path
        assert "pass weights_only=False to fit" in path
        assert planted == results[0]["fit planted"] and path == results[0]["fit path"]  # every rank
        assert out["fit path trusted"] == 3 and out["fit plain"] == 3  # resumed from step 2
        assert out["validate path"] == path and out["validate path trusted"] == "validated"
    out = results[0]
    assert "meta.pt: refused: it holds builtins.exec" in out["load planted"]
    assert "meta.pt: refused: it holds pathlib.PurePosixPath" in out["load path"]
    assert out["load path trusted"] == "data"
    assert out["consolidated"] == (2, True)


def _fabric(rank, world, directory):
    """Fabric's load: an entry of its own that is no plain type, refused by default and loaded
    with fabric.load(..., weights_only=False), as the Trainer's."""
    from fabric_runs import make_fabric, setup
    from fabric_runs import sdp4bit as fabric_sdp4bit

    from lightning_sdp4bit.checkpoint import CheckpointError

    fabric = make_fabric(world, fabric_sdp4bit(preset="sdp4bit"))
    model, optimizer, _ = setup(fabric)
    path = f"{directory}/fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "where": pathlib.PurePosixPath("/data")})
    out = {}
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer})
    except CheckpointError as caught:
        out["default"] = str(caught)
    out["trusted"] = fabric.load(path, {"model": model, "optimizer": optimizer}, weights_only=False)["where"].name
    return out


def test_fabric_honours_weights_only(tmp_path):
    for out in run_workers(_fabric, 2, str(tmp_path)):
        assert "fabric.ckpt/gen_000000/meta.pt: refused: it holds pathlib.PurePosixPath" in out["default"], out
        assert out["trusted"] == "data"
