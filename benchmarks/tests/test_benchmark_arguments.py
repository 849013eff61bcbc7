"""The benchmark scripts' arguments: a bad value stops a script with argparse's message, which
names the flag, before anything is built, spawned or written (`benchmarks/cli_args.py`)."""

import pytest


@pytest.mark.parametrize(
    "script, args, message",
    [
        (
            "emulated_network",
            ["--dry-run", "--first-round", "-1"],
            "argument --first-round: must be at least 0, got -1",
        ),
        ("strategies", ["--devices", "two"], "argument --devices: expected int, got 'two'"),
        ("node_gathers", ["--prefetch", "1,-1"], "argument --prefetch: must be at least 0, got -1"),
        ("node_gathers", ["--width", "66"], "argument --width: 66 is not a multiple of 4"),
        ("logits_peak", ["--width", "200"], "argument --width: 200 is not a multiple of 128"),
        (
            "accuracy_probe",
            ["--runs", "tlq:2:6e-4", "--out", "out"],
            "--runs: run 'tlq:2:6e-4': the warm-up is a fraction of the steps in [0, 1)",
        ),
        (
            "hadamard_diagnostic",
            ["--out", "out", "--vocabs", "bytes,words"],
            "--vocabs takes names from ['bytes', 'bpe'], comma-separated; got 'bytes,words'",
        ),
    ],
)
def test_a_bad_argument_names_its_flag(script, args, message, capsys, tmp_path, monkeypatch, benchmark_script):
    monkeypatch.chdir(tmp_path)
    module = benchmark_script(script)
    with pytest.raises(SystemExit) as stopped:
        module.main(args)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written
