"""The command line as a user meets it: one spelling per flag, and every mistake reported in one line, exit 2."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4lab.core import errors
from dsv4lab.tools import options
from dsv4lab.faces.cli import build_parser, main
from dsv4lab.faces.commands._dispatch import LazySubcommandParser

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "data" / "tiny"


def all_parsers(parser: argparse.ArgumentParser | None = None):
    """Every parser of the command line, sub-commands filled in (their modules imported)."""
    parser = parser or build_parser()
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                if isinstance(sub, LazySubcommandParser):
                    sub.fill()
                yield from all_parsers(sub)


def test_a_mistyped_backend_is_one_line_naming_the_choices():
    r = subprocess.run([sys.executable, "-m", "dsv4lab", "generate", "--checkpoint", str(TINY), "--prompt-ids",
                        "5,6", "--backend", "trition"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "invalid choice: 'trition'" in r.stderr and "'reference'" in r.stderr and "'triton'" in r.stderr


def test_every_choice_valued_flag_has_one_spelling_in_every_command():
    expected = {
        "backend": (set(options.BACKENDS), None),
        "dtype": (set(options.DTYPES), options.dtype_name),
        "device": (None, options.device_name),
        "preset": (set(options.PRESETS), None),
        "hardware": (None, options.hardware_name),
    }
    seen = {name: 0 for name in expected}
    for parser in all_parsers():
        for action in parser._actions:
            if action.dest not in expected:
                continue
            choices, type_ = expected[action.dest]
            where = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
            assert (set(action.choices) if action.choices else None) == choices, where
            assert action.type is type_, where
            if action.dest in ("backend", "dtype", "device") and action.option_strings:
                assert action.option_strings == [f"--{action.dest}"], where
            seen[action.dest] += 1
    assert all(seen.values()), seen  # the check above looked at real flags
    # the long names are accepted for --dtype and stored as the short one
    args = build_parser().parse_args(["generate", "--checkpoint", "x", "--prompt-ids", "1", "--dtype", "bfloat16"])
    assert args.dtype == "bf16" and args.device == "auto"


MISTAKES = [
    (["generate", "--checkpoint", "no-such-folder", "--prompt-ids", "5"], "no-such-folder"),
    (["generate", "--checkpoint", str(TINY), "--prompt-ids", "x"], "--prompt-ids"),
    (["generate", "--checkpoint", str(TINY), "--prompt-ids", "5", "--dtype", "half"], "--dtype"),
    (["generate", "--checkpoint", str(TINY), "--prompt-ids", "5", "--device", "gpu"], "--device"),
    (["inspect", "no-such-folder"], "no-such-folder"),
    (["inventory", "flsh"], "invalid choice: 'flsh'"),
    (["inventory", "--config", "no-such.json"], "no-such.json"),
    (["roofline", "--hardware", "mi999"], "mi250-gcd"),
    (["roofline", "compare", "no-such.json"], "no-such.json"),
    (["repair", str(TINY), "--spec", "no-such.json", "--out", "unused"], "no-such.json"),
    (["verify", "layers", "--checkpoint", "no-such-folder"], "no-such-folder"),
    (["verify", "model", "--checkpoint", str(TINY), "--inject-fault", "nope"], "invalid choice: 'nope'"),
    (["verify", "model", "--checkpoint", str(TINY), "--tiers", "checkpoint,nope"], "nope"),
    (["verify", "kernels", "--op", "nope"], "nope"),
    (["bench", "e2e", "--backend", "cuda"], "invalid choice: 'cuda'"),
]


@pytest.mark.parametrize("argv,named", MISTAKES, ids=[" ".join(m[0][:2]) + f" #{i}" for i, m in enumerate(MISTAKES)])
def test_user_mistakes_are_one_line_and_exit_2(argv, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("dsv4lab ") and ": error: " in err and named in err, err


def test_every_user_facing_error_shares_the_base():
    from dsv4lab.core import checkpoint, config, layouts, quant
    from dsv4lab.faces import runs
    from dsv4lab.tools.perf import hardware, roofline
    from dsv4lab.tools.verify import hf_convert
    for cls in (errors.UserError, config.ConfigError, quant.QuantError, checkpoint.CheckpointError,
                layouts.LayoutError, hardware.HardwareError, roofline.PerfError, runs.RunError,
                hf_convert.ConversionError, errors.ParallelError):
        assert issubclass(cls, errors.DSV4LabError), cls
    assert str(errors.CheckpointError("ck", ["ck/config.json: missing"])) == "ck/config.json: missing"
    assert str(errors.CheckpointError("ck", ["a", "b"])).splitlines()[0] == "ck: 2 problem(s):"


def test_a_sub_command_whose_module_cannot_be_imported_says_why():
    from dsv4lab.faces.cli import ArgumentParser
    parser = ArgumentParser(prog="dsv4lab")
    sub = parser.add_subparsers(dest="command", parser_class=LazySubcommandParser)
    sub.add_parser("x", module="dsv4lab.no_such_module")
    args = parser.parse_args(["x", "--any-flag", "value"])  # its flags are unknown: the reason comes first
    with pytest.raises(errors.UserError, match="unavailable in this installation .*no_such_module"):
        args._run(args)
