"""oscar-calibrate's and oscar-eval's argument checks: bad sizes, windows, budgets and output folders are refused
with one line before any model is read (no model needed here)."""

import argparse
import os

import pytest

from oscar_sglang.calibration import cli, cli_args, eval_cli


def test_count_and_counts_take_integers_from_their_least_value():
    assert cli_args.count(0)("0") == 0 and cli_args.count(1)("12") == 12
    for text, least, msg in (("-1", 0, "at least 0, got -1"), ("0", 1, "at least 1, got 0"), ("1.5", 1, "integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            cli_args.count(least)(text)
    assert cli_args.counts(1)("1024, 2048,") == [1024, 2048] and cli_args.counts(1)("") == []
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1, got 0"):
        cli_args.counts(1)("512,0")


def test_the_output_folder_must_be_a_writable_directory(tmp_path):
    cli_args.check_out_dir(tmp_path)                       # exists
    cli_args.check_out_dir(tmp_path / "new" / "deeper")    # made later, under a writable folder
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        cli_args.check_out_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="file is not a directory"):
        cli_args.check_out_dir(tmp_path / "file" / "sub", "--save-artifacts")
    if os.geteuid() != 0:                                  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            cli_args.check_out_dir(locked / "rot")


@pytest.mark.parametrize("argv, msg", [
    (["--sink", "-1"], "argument --sink: must be at least 0"),
    (["--recent", "-4"], "argument --recent: must be at least 0"),
    (["--tokens", "0"], "argument --tokens: must be at least 1"),
    (["--seq-len", "abc"], "argument --seq-len: expected an integer"),
    (["--group", "0"], "argument --group: must be at least 1"),
    (["--keep-sequences", "0"], "argument --keep-sequences: must be at least 1"),
    (["--threads", "0"], "argument --threads: must be at least 1"),
    (["--bits", "17"], "argument --bits: bits per element must lie in (0, 16]"),
])
def test_oscar_calibrate_refuses_bad_numbers_while_parsing(argv, msg, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--out", str(tmp_path / "rot")])
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["--windows", "4"], "argument --windows: expected SINK:RECENT, got '4'"),
    (["--windows", "64:256,4:-1"], "argument --windows: must be at least 0"),
    (["--ppl-contexts", "1024,0"], "argument --ppl-contexts: must be at least 1"),
    (["--niah-trials", "0"], "argument --niah-trials: must be at least 1"),
    (["--policy-bits", "3,x"], "argument --policy-bits: expected bits per element, e.g. 2.75 or 2.75sym, got 'x'"),
    (["--policy-bits", "2.5sym,20"], "argument --policy-bits: bits per element must lie in (0, 16], got 20"),
])
def test_oscar_eval_refuses_bad_numbers_while_parsing(argv, msg, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        eval_cli.main(argv + ["--out", str(tmp_path / "out")])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_both_tools_refuse_an_output_path_that_is_a_file_before_reading_the_model(tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was read for a run that cannot write its result")

    monkeypatch.setattr(cli.model_io, "load", no_model)
    target = tmp_path / "rotations"
    target.write_text("not a folder")
    assert cli.main(["--method", "hadamard", "--out", str(target), "--quiet"]) == 2
    assert f"--out {target}: exists and is not a directory" in capsys.readouterr().err
    assert eval_cli.main(["--out", str(target), "--quiet"]) == 2
    assert f"oscar-eval: error: --out {target}: exists and is not a directory" in capsys.readouterr().err
    assert eval_cli.main(["--out", str(tmp_path / "ok"), "--save-artifacts", str(target / "x"), "--quiet"]) == 2
    assert "--save-artifacts" in capsys.readouterr().err and not (tmp_path / "ok").exists()


def test_the_serve_line_names_the_model_as_given_and_quotes_paths(tmp_path):
    out = tmp_path / "my rotations"
    assert cli.serve_command("Qwen/Qwen3-8B", tmp_path / "snapshot", out) == (
        f"python -m sglang.launch_server --model-path Qwen/Qwen3-8B --kv-cache-dtype oscar-int2 "
        f"--oscar-rotations '{out}'")
    assert cli.serve_command("default", tmp_path / "SmolLM2", out).split()[4] == str(tmp_path / "SmolLM2")
