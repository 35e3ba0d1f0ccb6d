"""Bad input, round 2 (issue 35): validation before work, nothing committed overwritten, run folders atomic, every
failure one line with exit status 2, a sensible CPU thread count.

Each contract is checked once through a real ``python -m dsv4lab`` subprocess (exit status, nothing but one line
on stderr, no traceback); the variations of a contract run in process through :func:`dsv4lab.faces.cli.main`
(the same code path without a Python start-up each). Every file under ``data/`` is byte-identical after the module
(damaged copies, refused recordings and refused overwrites included).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4lab.core.checkpoint import Checkpoint
from dsv4lab.core.config import ConfigError, ModelArgs, get_preset
from dsv4lab.core.errors import ResourceError
from dsv4lab.faces import cli

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
TINY, TINY_PY = DATA / "tiny", DATA / "tiny-py"


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", autouse=True)
def data_is_never_written():
    before = tree_hashes(DATA)
    yield
    assert tree_hashes(DATA) == before, "a file under data/ changed"


def refused(*argv: str, stdout=None, env: dict | None = None) -> str:
    """Run ``dsv4lab ARGV``; require exit 2, nothing on stdout, one line on stderr and no traceback; return it."""
    r = subprocess.run([sys.executable, "-m", "dsv4lab", *argv], cwd=REPO, timeout=300, text=True,
                       stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.PIPE,
                       env=dict(os.environ, **(env or {})))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and not r.stdout, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    return r.stderr


def in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)  # an exception escaping here would be a traceback: the test fails on it
    out = capsys.readouterr()
    return code, out.out, out.err


def copy_of(src: Path, where: Path, name: str | None = None) -> Path:
    dst = where / (name or src.name)
    shutil.copytree(src, dst)
    return dst


def poke(ck: Path, name: str, element: int, raw: bytes) -> None:
    info = Checkpoint(ck).tensors[name]
    with open(ck / info.file, "r+b") as fh:
        fh.seek(info.begin + element * len(raw))
        fh.write(raw)


# ============================================================================================ 3. validation
CONFIG_CASES = [  # config.json key, value, the field and the bound the one-line error names
    ("rms_norm_eps", -1e-6, "'norm_eps' = -1e-06: must be a finite number in (0, 0.1]"),
    ("rms_norm_eps", 0.0, "'norm_eps' = 0.0: must be a finite number in (0, 0.1]"),
    ("hc_eps", float("nan"), "'hc_eps' = nan"),
    ("routed_scaling_factor", 1e30, "'route_scale' = 1e+30: must be a finite number in (0, 16]"),
    ("sliding_window", 10**9, "'window_size' = 1000000000: must be an integer in [1, 16,777,216]"),
    ("sliding_window", 8192, "'window_size' = 8192: cannot exceed max_position_embeddings=4,096"),
    ("hc_sinkhorn_iters", 10**8, "'hc_sinkhorn_iters' = 100000000: must be an integer in [1, 100]"),
    ("num_hidden_layers", 100_000, "'n_layers' = 100000: must be an integer in [1, 1,024]"),
    ("vocab_size", 2**40, "'vocab_size' = 1099511627776: must be an integer in [1, 1,048,576]"),
    ("eos_token_id", 4096, "'eos_token_id' = 4096: must be a token id in [0, 4096)"),
    ("compress_ratios", [0, 4, 10**6, 4, 16, 4, 0], "entries must be 0 (SWA) or a ratio in [2, 1024]"),
]


@pytest.mark.parametrize("key,value,says", CONFIG_CASES, ids=[f"{k}={v}" for k, v, _ in CONFIG_CASES])
def test_config_fields_with_physical_meaning_are_bounded(key, value, says):
    cfg = dict(get_preset("tiny").to_hf_config(), **{key: value})
    with pytest.raises(ConfigError) as err:
        ModelArgs.from_hf_config(cfg, source="x/config.json")
    assert says in str(err.value) and str(err.value).startswith("x/config.json: config field") \
        and "\n" not in str(err.value)


def test_positions_are_bounded_by_the_declared_context():
    tiny = get_preset("tiny")
    with pytest.raises(ConfigError, match="'max_seq_len' = 8192: cannot exceed max_position_embeddings=4,096"):
        tiny.replace(max_seq_len=8192)
    short = dict(tiny.to_hf_config(), max_position_embeddings=512)
    assert ModelArgs.from_hf_config(short).max_seq_len == 512  # the default cache never exceeds the positions


def test_a_config_out_of_bounds_is_one_line_from_the_command_line(tmp_path):
    cfg = dict(get_preset("tiny").to_hf_config(), rms_norm_eps=-1e-6)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = refused("inventory", "--config", str(tmp_path / "config.json"))
    assert "config.json: config field 'norm_eps' = -1e-06: must be a finite number in (0, 0.1]" in line


def test_an_e8m0_scale_that_overflows_bf16_is_caught_at_load_naming_the_tensor(tmp_path, capsys):
    from dsv4lab.core.checkpoint_values import scale_byte_limit
    assert (scale_byte_limit("F8_E4M3"), scale_byte_limit("I8")) == (246, 252)  # 448·2^119 and 6·2^125 < 3.39e38
    ck = copy_of(TINY, tmp_path)
    poke(ck, "layers.2.attn.wq_a.scale", 1, bytes([247]))  # 448 · 2^120 = 5.96e38: Inf in bf16 and in fp32
    poke(ck, "layers.3.ffn.experts.5.w2.scale", 3, bytes([252]))  # the FP4 limit itself: finite
    code, out, err = in_process(["inspect", str(ck)], capsys)
    assert code == 1 and "OK" not in out
    assert "layers.2.attn.wq_a.scale: 1 scale byte(s) unusable" in err and "(0 0xFF, 1 overflowing)" in err
    assert "first at [0, 1]" in err and "experts.5.w2.scale" not in err
    line = refused("generate", "--checkpoint", str(ck), "--prompt-ids", "5,6,7", "--max-new-tokens", "1",
                   "--device", "cpu")
    assert line.startswith("dsv4lab generate: error: ") and "layers.2.attn.wq_a.scale" in line and "bf16" in line


def test_tokenizer_ids_are_checked_against_the_vocabulary(tmp_path, capsys):
    from dsv4lab.core.tokenizer import Tokenizer
    ck = copy_of(TINY_PY, tmp_path)
    doc = json.loads((ck / "tokenizer.json").read_text())
    token, _ = max(doc["model"]["vocab"].items(), key=lambda kv: kv[1])
    doc["model"]["vocab"][token] = 5000  # 4,096 tokens, but one of them is id 5000
    (ck / "tokenizer.json").write_text(json.dumps(doc))
    tok = Tokenizer(ck / "tokenizer.json")
    assert tok.vocab_size <= 4096 and tok.max_id == 5000
    assert any("up to 5000 but the model embeds only 4096" in p for p in tok.problems(4096, 0, 1))
    assert tok.ids_outside([5, 5000, 7], 4096) == [(1, 5000)]
    code, _, err = in_process(["generate", "--checkpoint", str(ck), "--prompt", "x", "--device", "cpu"], capsys)
    assert code == 2 and "tokenizer.json: 4096 token ids up to 5000" in err


def test_inspect_summarises_a_long_list_of_problems(tmp_path, capsys):
    ck = copy_of(TINY, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(num_hidden_layers=1000, compress_ratios=[4] * 1001)
    (ck / "config.json").write_text(json.dumps(cfg))
    code, out, err = in_process(["inspect", str(ck), "--no-scan"], capsys)
    assert code == 1 and len(out) + len(err) < 8000, len(out) + len(err)
    assert "layer kinds  1000 layers (1000 csa) + 1 MTP; first 0:csa" in out
    assert err.startswith("FAILED: 135,226 problem(s): 135,220 missing, 6 shape") and "... and 135,215 more" in err
    code, out, _ = in_process(["inspect", str(ck), "--no-scan", "--json"], capsys)
    doc = json.loads(out)
    assert doc["problem_counts"] == {"missing": 135220, "shape": 6} and len(doc["problems"]) == 200
    assert doc["problems_omitted"] == 135026


def test_disk_space_is_checked_before_large_writes(tmp_path, monkeypatch, capsys):
    from dsv4lab.core import resources
    monkeypatch.setattr(resources, "free_disk_bytes", lambda path: 10 << 20)
    for argv, what in ((["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "ck")], "writing ck"),
                       (["verify", "record", "--checkpoint", str(TINY), "--out", str(tmp_path / "g.json")],
                        "recording a golden file"),
                       (["reproduce", "--only", "05", "--out", str(tmp_path / "runs")], "a run folder")):
        code, out, err = in_process(argv, capsys)
        assert code == 2 and f"{what} needs" in err and "only 10.0 MiB free there" in err, err
        assert err.count("\n") == 1 and not out
    assert list(tmp_path.iterdir()) == []  # nothing was started


def test_the_flash_preset_does_not_fit_this_disk_and_is_refused_before_writing(tmp_path):
    from dsv4lab.core.resources import free_disk_bytes
    if free_disk_bytes(tmp_path) > 200 << 30:
        pytest.skip("this disk has room for DeepSeek-V4-Flash")
    line = refused("make-checkpoint", "--preset", "flash", "--out", str(tmp_path / "flash"))
    assert "writing flash needs 148.65 GiB of disk" in line and not (tmp_path / "flash").exists()


def test_caches_beyond_memory_are_refused_before_allocating():
    import dsv4lab
    with pytest.raises(ResourceError, match=r"caches for 1000000 sequence\(s\) of 4,096 positions .* of cpu memory"):
        dsv4lab.load(TINY, device="cpu", max_batch=10**6, validate=False)


# ============================================================================================ 4. goldens
def test_verify_record_never_replaces_a_golden_without_force(tmp_path):
    same_name = copy_of(TINY, tmp_path, "tiny-py")  # another checkpoint in a folder named like a committed one
    line = refused("verify", "record", "--checkpoint", str(same_name))
    assert "data/golden/tiny-py.json already exists (recorded from a checkpoint named 'tiny-py')" in line
    assert "pass --force to replace it" in line


def test_force_replaces_a_golden_whole(tmp_path, monkeypatch, capsys):
    from dsv4lab.tools.verify import cli_record
    out = tmp_path / "g.json"
    out.write_text("{}")

    def record(checkpoint, path, dump_layers, device):  # the recording itself is test_verify's subject
        Path(path).write_text('{"version": 1}')
        return dict(oracles=[1], trajectory=dict(n_tokens=256, hash="h"), teacher_forced=dict(ids=[1]),
                    layers=dict(order=[1]))
    monkeypatch.setattr(cli_record, "record_golden", record)
    code, _, err = in_process(["verify", "record", "--checkpoint", str(TINY), "--out", str(out)], capsys)
    assert code == 2 and "g.json already exists; pass --force" in err and out.read_text() == "{}"
    code, out_text, _ = in_process(["verify", "record", "--checkpoint", str(TINY), "--out", str(out), "--force"],
                                   capsys)
    assert code == 0 and out.read_text() == '{"version": 1}' and "recorded 1 oracles" in out_text


def test_a_golden_found_for_a_checkpoint_it_was_not_recorded_from_is_refused_naming_both_hashes(tmp_path):
    suspect = copy_of(TINY_PY, tmp_path)
    poke(suspect, "head.weight", 11, bytes([0x01, 0x3F]))
    golden = json.loads((DATA / "golden" / "tiny-py.json").read_text())["checkpoint"]["weights"]
    from dsv4lab.tools.verify.model import checkpoint_identity
    ours = checkpoint_identity(suspect)["weights"]
    line = refused("verify", "model", "--checkpoint", str(suspect), "--device", "cpu")
    assert f"data/golden/tiny-py.json was recorded from a checkpoint whose weights sha256 is {golden[:16]}…" in line
    assert f"but {suspect} has {ours[:16]}…" in line and "--golden data/golden/tiny-py.json" in line


def test_the_binding_holds_for_verify_layers_and_passes_the_checkpoint_it_was_recorded_from(tmp_path, capsys):
    from dsv4lab.tools.verify.model import find_golden, load_golden, require_recorded_from
    suspect = copy_of(TINY_PY, tmp_path)
    poke(suspect, "norm.weight", 0, bytes([0x00, 0x40]))
    code, _, err = in_process(["verify", "layers", "--checkpoint", str(suspect), "--device", "cpu"], capsys)
    assert code == 2 and "was recorded from a checkpoint whose weights sha256" in err
    for ck in (TINY, TINY_PY):
        require_recorded_from(load_golden(find_golden(ck)), find_golden(ck), ck)  # no refusal


# ============================================================================================ 5. run folders
ALIAS_BOMB = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdef", "bcdefg"))


def test_a_yaml_alias_bomb_in_params_is_refused_before_anything_runs(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text('a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + ALIAS_BOMB
                      + "SEED: *g\n")  # 9^7 ≈ 4.8 million values in 8 lines
    line = refused("reproduce", "--only", "05", "--params", str(params), "--out", str(tmp_path / "runs"))
    assert "more than 10,000 values once its aliases (*name) are expanded" in line
    assert not (tmp_path / "runs").exists()


def test_parameter_errors_quote_bounded_excerpts(tmp_path, capsys):
    params = tmp_path / "p.yaml"
    params.write_text(f"SEED: '{'x' * 200_000}'\n{'Y' * 1000}: 1\n")  # YAML keys stop at 1,024 characters
    code, _, err = in_process(["reproduce", "--only", "05", "--params", str(params), "--out", str(tmp_path / "r")],
                              capsys)
    assert code == 2 and "parameter SEED is declared int" in err and "no selected notebook declares" in err
    assert max(len(line) for line in err.splitlines()) < 700, max(len(line) for line in err.splitlines())
    manifest = json.loads(next((tmp_path / "r").glob("*/manifest.json")).read_text())
    assert manifest["status"] == "invalid_parameters"


def test_an_invalid_notebook_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "nbs").mkdir()
    (tmp_path / "nbs" / "broken.ipynb").write_text('{"cells": [')
    line = refused("reproduce", "--notebooks-dir", str(tmp_path / "nbs"), "--out", str(tmp_path / "runs"))
    assert "broken.ipynb: not a notebook nbformat can read (NotJSONError" in line
    _sleeping_notebook(tmp_path / "no-kernel", kernel=False)  # valid, but names no kernel papermill can use
    code, _, err = in_process(["reproduce", "--notebooks-dir", str(tmp_path / "no-kernel")], capsys)
    assert code == 2 and err.count("\n") == 1 and "sleeps.ipynb: papermill cannot read its parameters" in err


def test_a_notebook_cut_short_is_removed_and_a_whole_one_moved_into_place(tmp_path):
    from dsv4lab.faces.runs import settle_notebook
    partial, final = tmp_path / ".a.partial.ipynb", tmp_path / "a.ipynb"
    partial.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    assert settle_notebook(partial, final) == final and not partial.exists() and json.loads(final.read_text())
    partial.write_text('{"cells": [{"cell_type": "code", "sou')  # what a write killed half-way leaves
    assert settle_notebook(partial, tmp_path / "b.ipynb") is None and not partial.exists()
    assert not (tmp_path / "b.ipynb").exists()


SLEEPING_NOTEBOOK = '''
RUN_DIR: str = ""  # run folder
SMOKE: bool = False  # smoke
INTERACTIVE: bool = False  # widgets
SEED: int = 0  # seed
CHECKPOINT: str = ""  # checkpoint
'''


def _sleeping_notebook(folder: Path, kernel: bool = True) -> None:
    import nbformat
    spec = dict(kernelspec=dict(name="python3", display_name="Python 3", language="python")) if kernel else {}
    nb = nbformat.v4.new_notebook(metadata=spec)
    params = nbformat.v4.new_code_cell(SLEEPING_NOTEBOOK.strip())
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("import time\nprint('READY', flush=True)\ntime.sleep(120)")]
    folder.mkdir()
    nbformat.write(nb, str(folder / "sleeps.ipynb"))


@pytest.mark.notebooks
@pytest.mark.parametrize("sig,code,by", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_a_run_with_an_interrupted_manifest(sig, code, by, tmp_path):
    """SIGTERM and SIGINT end a run as "interrupted" — the run started with SIGINT ignored, as a shell starts a
    background job (``dsv4lab reproduce &``) and as some test runners' workers run: the run sets its own handler
    (before it did not, and a SIGINT was lost under pytest-xdist: the notebook slept its 120 s out)."""
    _sleeping_notebook(tmp_path / "nbs")
    out = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "dsv4lab", "reproduce", "--notebooks-dir", str(tmp_path / "nbs"),
                             "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    def cell_running() -> bool:
        return any("READY" in log.read_text() for log in out.glob("*/logs/sleeps.log"))
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not cell_running():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("dsv4lab reproduce: "), err
    (run,) = out.iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["interrupted_by"] == by
    assert manifest["notebooks"][0]["status"] == "interrupted"
    assert "interrupted" in (run / "report.md").read_text()
    assert not list(run.glob("notebooks/.*partial*"))  # the executed notebook is whole or absent
    for nb in run.glob("notebooks/*.ipynb"):
        json.loads(nb.read_text())


# ============================================================================================ 7. one line, exit 2
def _raising(err: BaseException):
    def run(args):
        raise err
    return run


class _OutOfMemoryError(RuntimeError):
    """What torch raises when a device allocation fails (``torch.OutOfMemoryError``), by name."""


_OutOfMemoryError.__name__ = "OutOfMemoryError"
FAILURES = [
    (PermissionError(errno.EACCES, "Permission denied", "/x/ck"), "/x/ck: Permission denied"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/x/dir"), "/x/dir: Is a directory"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/x/f/y"), "/x/f/y: Not a directory"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/nope"), "/x/nope: No such file or directory"),
    (OSError(errno.ENOSPC, "No space left on device", "/x/out"), "/x/out: No space left on device (free some"),
    (OSError(errno.EROFS, "Read-only file system", "/x/ro"), "/x/ro: Read-only file system"),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), "the output was closed before the command finished"),
    (MemoryError(), "out of memory (MemoryError"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 10995116277760 bytes.\nmore"), "out of memory (RuntimeError: [enforce fail"),
    (_OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), "out of memory (OutOfMemoryError: CUDA"),
    (ValueError("math domain error"), "out of the range this computation accepts (ValueError: math domain error)"),
    (OverflowError("math range error"), "out of the range this computation accepts (OverflowError"),
    (ZeroDivisionError("float division by zero"), "(ZeroDivisionError: float division by zero)"),
]


@pytest.mark.parametrize("err,says", FAILURES, ids=[type(e).__name__ + str(getattr(e, "errno", "") or "")
                                                     for e, _ in FAILURES])
def test_every_failure_family_is_one_line_and_exit_2(err, says, monkeypatch, capsys):
    from dsv4lab.faces.commands import inventory
    monkeypatch.setattr(inventory, "run", _raising(err))
    code, out, stderr = in_process(["inventory", "tiny"], capsys)
    assert code == 2 and not out and stderr.count("\n") == 1, stderr
    assert stderr.startswith("dsv4lab inventory: error: ") and says in stderr, stderr


def test_a_bug_is_one_line_with_its_traceback_kept_in_a_file(monkeypatch, capsys):
    from dsv4lab.faces.commands import inventory
    monkeypatch.setattr(inventory, "run", _raising(KeyError("layers.0")))
    code, _, err = in_process(["inventory", "tiny"], capsys)
    assert code == 2 and err.count("\n") == 1 and "internal error, a bug (KeyError: 'layers.0')" in err
    saved = Path(err.rsplit("traceback in ", 1)[1].strip())
    assert "Traceback" in saved.read_text() and "KeyError" in saved.read_text()
    saved.unlink()
    monkeypatch.setenv("DSV4LAB_DEBUG", "1")
    with pytest.raises(KeyError):
        cli.main(["inventory", "tiny"])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_under_stdout_is_one_line(tmp_path):
    with open("/dev/full", "w") as full:
        line = refused("roofline", "--hardware", "h200-sxm", "--json", stdout=full)
    assert line == "dsv4lab roofline: error: No space left on device (free some space, or write elsewhere)\n"


# ============================================================================================ 8. CPU threads
def test_generate_and_serve_state_their_cpu_thread_count(capsys):
    for command in ("generate", "serve"):
        assert cli.main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "--threads N CPU threads for torch's ops in a run on the CPU (default: $OMP_NUM_THREADS when set, " \
               "else 1" in text, command


def test_generate_on_a_cpu_runs_one_thread_unless_told():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "dsv4lab", "generate", "--checkpoint", str(TINY_PY), "--prompt-ids",
                        "5,6,7", "--max-new-tokens", "1", "--device", "cpu", "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["threads"] == 1


def test_thread_counts_follow_the_flag_the_environment_and_the_device(monkeypatch):
    import torch

    from dsv4lab.core.resources import usable_cpu_count
    from dsv4lab.tools.options import set_cpu_threads
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert set_cpu_threads(None, "cpu") == 1 == torch.get_num_threads()
        assert set_cpu_threads(2, "cpu") == 2 == torch.get_num_threads()
        assert set_cpu_threads(0, "cpu") == usable_cpu_count()
        assert set_cpu_threads(3, "cuda") is None  # a GPU run leaves torch's host threads alone
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert set_cpu_threads(None, "cpu") == 2  # torch already follows the variable
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("argv", [
    ["bench", "e2e", "--smoke", "--out", "{c}/e2e_1gpu.json"],
    ["bench", "engine", "--checkpoint", "data/tiny", "--out", "{c}/e2e_1gpu.json"],
    ["bench", "collectives", "--out", "{c}/e2e_1gpu.json"],
    ["bench", "kernels", "--suite", "decode", "--smoke", "--out", "{t}/x.json", "--tuned-out", "{c}/e2e_1gpu.json"],
    ["train-small", "ablation", "--weights", "w", "--tokens", "t", "--out", "{c}/e2e_1gpu.json"],
])
def test_a_committed_result_is_not_replaced_without_force(argv, tmp_path, capsys, monkeypatch):
    """A rerun must not silently change what the repository reports: refused before any work, one line, exit 2,
    the file untouched. The committed folder is a copy here, so a regression cannot damage the repository."""
    from conftest import ROOT
    from dsv4lab.core import provenance
    from dsv4lab.faces import cli
    committed = tmp_path / "committed"
    committed.mkdir()
    result = committed / "e2e_1gpu.json"
    result.write_bytes((ROOT / "data/results/h200/e2e_1gpu.json").read_bytes())
    before = result.read_bytes()
    monkeypatch.setattr(provenance, "COMMITTED_DIRS", (committed,))
    monkeypatch.chdir(ROOT)
    assert cli.main([a.format(c=committed, t=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exists and is committed: pass --force" in err, err
    assert result.read_bytes() == before


def test_the_committed_folders_are_data_and_the_tuned_tables():
    from dsv4lab.core.errors import UserError
    from dsv4lab.core.paths import COMMITTED_DIRS, DATA_DIR, TUNED_DIR
    from dsv4lab.core.provenance import refuse_replacing_committed
    assert set(COMMITTED_DIRS) == {DATA_DIR, TUNED_DIR}
    for path in (DATA_DIR / "results/h200/e2e_1gpu.json", TUNED_DIR / "h200.json", DATA_DIR / "golden/tiny.json"):
        with pytest.raises(UserError, match="pass --force"):
            refuse_replacing_committed(path, force=False)
        refuse_replacing_committed(path, force=True)  # told to
    refuse_replacing_committed(DATA_DIR / "results/h200/not_there.json", force=False)  # a new file is fine
