"""Mistakes on the command line, as a user meets them (issue 21): exit status 2, one line naming the flag, file or
device and what was expected, no traceback. Every case runs ``python -m dsv4lab`` in a subprocess; the ones refused
while parsing the flags start no torch (about 0.2 s each)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY, TINY_PY = REPO / "data" / "tiny", REPO / "data" / "tiny-py"


def refused(*argv: str) -> str:
    """Run ``dsv4lab ARGV``; require exit 2, nothing on stdout, one line on stderr and no traceback; return it."""
    r = subprocess.run([sys.executable, "-m", "dsv4lab", *argv], capture_output=True, text=True, cwd=REPO,
                       timeout=300)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    return r.stderr


GENERATE = ("generate", "--checkpoint", str(TINY_PY), "--prompt", "def f(")

FLAG_CASES = [
    (GENERATE + ("--max-new-tokens", "0"), "argument --max-new-tokens: must be an integer >= 1, got 0"),
    (GENERATE + ("--max-new-tokens", "-3"), "argument --max-new-tokens: must be an integer >= 1, got -3"),
    (GENERATE + ("--max-new-tokens", "many"), "argument --max-new-tokens: expected an integer, got 'many'"),
    (GENERATE + ("--temperature", "-1"), "argument --temperature: must be a finite number in [0, 2], got -1"),
    (GENERATE + ("--temperature", "nan"), "argument --temperature: must be a finite number in [0, 2], got nan"),
    (GENERATE + ("--top-p", "2"), "argument --top-p: must be a finite number in (0, 1], got 2"),
    (GENERATE + ("--top-p", "0"), "argument --top-p: must be a finite number in (0, 1], got 0"),
    (GENERATE + ("--seed", str(2**70)), "argument --seed: must be an integer in"),
    (GENERATE + ("--tp", "0"), "argument --tp: must be an integer >= 1, got 0"),
    (("serve", "--checkpoint", str(TINY_PY), "--port", "70000"), "argument --port: must be an integer in [0, 65535]"),
    (("serve", "--checkpoint", str(TINY_PY), "--max-body-mb", "0"), "argument --max-body-mb: must be an integer in"),
    (("serve", "--checkpoint", str(TINY_PY), "--max-concurrency", "0"), "argument --max-concurrency: must be"),
    (("roofline", "--batch", "0"), "argument --batch: must be an integer >= 1, got 0"),
    (("make-checkpoint", "--preset", "tiny", "--seed", "-1", "--out", "x"), "argument --seed: must be an integer >= 0"),
    (("bench", "serve", "--url", "http://127.0.0.1:1", "--request-rate", "0"), "argument --request-rate: must be"),
]


@pytest.mark.parametrize("argv,says", FLAG_CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in FLAG_CASES])
def test_an_out_of_range_flag_is_one_line_naming_it(argv, says):
    assert says in refused(*argv)


def test_a_device_the_machine_lacks_is_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = refused(*GENERATE, "--device", "cuda", "--max-new-tokens", "2")
    assert "device 'cuda'" in line and "use device 'cpu'" in line


def test_a_corrupt_tokenizer_is_one_line_naming_the_file(tmp_path):
    ck = tmp_path / "tiny-py"
    shutil.copytree(TINY_PY, ck)
    (ck / "tokenizer.json").write_text('{"model": {"vocab": {1: 2}}}')
    line = refused("generate", "--checkpoint", str(ck), "--prompt", "x", "--device", "cpu")
    assert "tokenizer.json: not a tokenizer the tokenizers library can read" in line
    r = subprocess.run([sys.executable, "-m", "dsv4lab", "inspect", str(ck), "--no-scan"], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "tokenizer.json: not a tokenizer" in r.stderr and "OK" not in r.stdout


def test_verify_model_on_a_renamed_copy_finds_its_golden_or_lists_the_candidates(tmp_path):
    from dsv4lab.tools.verify.model import find_golden
    copy = tmp_path / "suspect"
    shutil.copytree(TINY_PY, copy)
    assert find_golden(copy).name == "tiny-py.json"  # identical weights: the recorded identity decides
    shard = sorted(copy.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    line = refused("verify", "model", "--checkpoint", str(copy), "--device", "cpu")
    assert "no golden named suspect.json" in line and "tiny-py.json" in line and "tiny.json" in line
    assert "--golden" in line


def test_the_real_checkpoint_finds_the_flash_golden_in_a_folder_of_any_name(tmp_path):
    from dsv4lab.core.config import get_preset
    from dsv4lab.tools.verify.model import find_golden
    folder = tmp_path / "snapshots" / "60d8d70770c6"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(get_preset("flash").to_hf_config()))
    assert find_golden(folder).name == "flash.json"
