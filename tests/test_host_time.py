"""benchmarks/host_time.py's arguments: a bad one stops the script with a message that names the
flag, before anything is built (the timing itself runs on a GPU only)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_time  # noqa: E402


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world", "6", "--nodes", "4"], "--nodes=4 must be >= 1 and divide --world=6"),
        (["--steps", "0"], "--steps must be at least 1 and --warmup at least 0, got 0 and 4"),
        (["--warmup", "-1"], "--steps must be at least 1 and --warmup at least 0, got 10 and -1"),
        (["--bucket-numel", "-5"], "--bucket-numel must be at least 1 element, got -5.0"),
    ],
)
def test_bad_arguments_name_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        host_time.main(args)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
