"""The benchmark scripts' arguments: a bad value stops a script with argparse's message, which
names the flag, before anything is built, spawned or written (`benchmarks/cli_args.py`)."""

from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("host_time", ["--world", "6", "--nodes", "4"], "--nodes=4 must be >= 1 and divide --world=6"),
        ("host_time", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        ("host_time", ["--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
        ("host_time", ["--bucket-numel", "-5"], "argument --bucket-numel: must be at least 1, got -5"),
        ("host_time", ["--cprofile", "-1"], "argument --cprofile: must be at least 0, got -1"),
        ("engine_ab", ["--out", "o", "--rounds", "0", "."], "argument --rounds: must be at least 1, got 0"),
        ("engine_ab", ["--out", "o", "nowhere"], "nowhere is not a source tree of the package: it has no pyproject"),
        ("engine_ab", ["--out", "o", "REPO", "REPO"], "the trees' folder names name their rows and must differ"),
        (
            "engine_ab",
            ["--out", "o", "REPO", "--", "--repeats", "2"],
            "engine_ab sets --repeats 1, --first-round and --json itself",
        ),
        (
            "emulated_network",
            ["--dry-run", "--first-round", "-1"],
            "argument --first-round: must be at least 0, got -1",
        ),
        ("read_guard", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        ("checkpoint_checksum", ["--gib", "-1"], "argument --gib: must be at least 0.001, got -1"),
        ("training_step", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        ("training_step", ["--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
        ("strategies", ["--devices", "two"], "argument --devices: expected int, got 'two'"),
        ("simulation_memory", ["--world", "1x1"], "argument --world: simulate=1x1: needs at least"),
        ("simulation_profile", ["--world", "16by4"], "argument --world: simulate='16by4': expected 'MxL'"),
        ("simulation_profile", ["--streams", "0"], "argument --streams: must be at least 1, got 0"),
        ("simulation_profile", ["--preset", "zero"], "argument --preset: invalid choice: 'zero'"),
    ],
)
def test_a_bad_argument_names_its_flag(script, args, message, capsys, tmp_path, monkeypatch, benchmark_script):
    monkeypatch.chdir(tmp_path)
    module = benchmark_script(script)
    args = [str(Path(__file__).resolve().parents[1]) if arg == "REPO" else arg for arg in args]
    with pytest.raises(SystemExit) as stopped:
        module.main(args)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written
