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
    (["dispatch", "--rows", "0,2"], "--rows"),
    (["dispatch", "--tuned", "no-such.json"], "no-such.json"),
    (["dispatch", "--prompt-tokens", "x"], "--prompt-tokens"),
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


def test_dispatch_shows_each_choice_and_the_rows_it_was_measured_at(tmp_path, capsys):
    """``dsv4lab dispatch``: per projection and row count the dispatch's choice and the rows of the tuned entry it
    came from — an entry serves the row counts up to its own (rows 2 takes the 8-row cuBLAS entry), the last one
    beyond; a shape without entries gets the GPU default."""
    import json
    from test_dispatch import _doc
    from dsv4lab.engine.dispatch import shape_key
    wq_b = shape_key(32768, 1024, 1, "fp8", True)
    fma = dict(impl="triton", route="fma", block_n=32, block_k=256, split_k=2, num_warps=4, fma_rows=2)
    doc = _doc(**{"decode.gemv": [dict(shape=wq_b, rows=1, choice=fma), dict(shape=wq_b, rows=8,
                                                                             choice=dict(impl="cublas"))]})
    (tmp_path / "t.json").write_text(json.dumps(doc))
    assert main(["dispatch", "--tuned", str(tmp_path / "t.json"), "--rows", "1,2,9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    got = out["choices"]["fp8_gemv_wq_b"]["by_rows"]
    assert [(got[r]["text"], got[r]["measured_at_rows"]) for r in ("1", "2", "9")] == [
        ("fma n32k256s2w4:r2", 1), ("cublas", 8), ("cublas", 8)]
    other = out["choices"]["fp8_gemv_wo_b"]["by_rows"]["1"]
    assert other["measured_at_rows"] is None and other["where"] == "default" and other["impl"] == "triton"
    assert out["fused_paths"] == {"1": [], "2": [], "9": []}  # the GPU defaults turn none on
    assert out["prefill"]["4604"]["chunk"] == 4096 and out["prefill"]["1024"]["chunk"] == 1024  # the default chunking
    assert main(["dispatch", "--tuned", str(tmp_path / "t.json"), "--rows", "1,2", "--prompt-tokens", "5000"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert any(line.startswith("fp8_gemv_wq_b ") and "cublas @8" in line for line in table), table
    assert any(line.startswith("prefill ") and "5000 tokens: chunk=4096" in line for line in table), table


def test_dispatch_takes_the_gpu_by_its_tuned_files_name(capsys):
    """``--gpu h200`` names the committed H200 file as ``--gpu "NVIDIA H200"`` does (the file records the name torch
    reports; a short name used to fall through to the defaults without a word)."""
    import json
    tables = []
    for gpu in ("h200", "NVIDIA H200"):
        assert main(["dispatch", "--gpu", gpu, "--rows", "1,2", "--json"]) == 0
        tables.append(json.loads(capsys.readouterr().out))
    assert tables[0] == tables[1]
    assert tables[0]["choices"]["fp8_gemv_wq_b"]["by_rows"]["1"]["measured_at_rows"] == 1
