"""The corrupted-checkpoint corpus (issue 21): every way a copy of ``data/tiny`` can be damaged is refused.

Each case damages a private copy of ``data/tiny`` in a temporary folder, then runs ``dsv4lab inspect`` and
``dsv4lab generate`` on it through the command line's own entry point (``dsv4lab.faces.cli.main``, in process: the same
code path as the console script, without a Python start-up per case). Both must refuse — a non-zero exit status,
a message naming the damaged file or tensor, no traceback — and ``generate`` must never print generated ids:
0 tracebacks, 0 silent successes. Every file under ``data/`` is byte-identical afterwards.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4lab.core.checkpoint import INDEX_NAME, Checkpoint
from dsv4lab.faces.cli import main

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "tiny"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


# ------------------------------------------------------------------------------------------ damage helpers
def _json_edit(path: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite a JSON file after ``edit`` changed its document in place."""
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _shard_of(ck: Path, name: str) -> Path:
    return ck / json.loads((ck / INDEX_NAME).read_text())["weight_map"][name]


def _poke(ck: Path, name: str, element: int, raw: bytes) -> None:
    """Overwrite the bytes of element ``element`` of tensor ``name`` in place."""
    info = Checkpoint(ck).tensors[name]
    size = len(raw)
    with open(ck / info.file, "r+b") as fh:
        fh.seek(info.begin + element * size)
        fh.write(raw)


def _rewrite_header(ck: Path, shard: str, edit: Callable[[dict], None]) -> None:
    """Edit a shard's JSON header, keeping its data bytes."""
    path = ck / shard
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _rewrite_tensors(ck: Path, name: str, edit: Callable[[dict], None]) -> None:
    shard = _shard_of(ck, name)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def _set_header_entry(ck: Path, name: str, **fields) -> None:
    _rewrite_header(ck, _shard_of(ck, name).name, lambda h: h[name].update(fields))


def _shift_second_tensor_back(header: dict) -> None:
    """The second tensor's data moved two bytes back: it overlaps the first (and the file's last bytes are loose)."""
    second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[1]
    header[second]["data_offsets"] = [o - 2 for o in header[second]["data_offsets"]]


def _tokenizer_with_swapped_eos(ck: Path) -> None:
    def edit(doc):
        for tok in doc["added_tokens"]:
            tok["id"] = {0: 1, 1: 0}.get(tok["id"], tok["id"])
        vocab = doc["model"]["vocab"]
        for k, v in list(vocab.items()):
            vocab[k] = {0: 1, 1: 0}.get(v, v)
    _json_edit(ck / "tokenizer.json", edit)


@dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Path], None]
    says: tuple[str, ...]          # what inspect's message must contain (file or tensor, and the problem)


CASES = [
    Case("config.json missing", lambda ck: (ck / "config.json").unlink(), ("config.json",)),
    Case("config.json not JSON", lambda ck: (ck / "config.json").write_text('{"vocab_size": 4096,'),
         ("config.json", "not valid JSON")),
    Case("config.json not UTF-8", lambda ck: (ck / "config.json").write_bytes(b'{"x": "\xff\xfe"}'),
         ("config.json", "UTF-8")),
    Case("config.json a list", lambda ck: (ck / "config.json").write_text("[1, 2]"), ("config.json", "object")),
    Case("config.json wrong type", lambda ck: _json_edit(ck / "config.json", lambda c: c.update(rope_theta="big")),
         ("config.json", "wrong type")),
    Case("config.json zero layers", lambda ck: _json_edit(ck / "config.json", lambda c: c.update(num_hidden_layers=0)),
         ("config.json", "n_layers")),
    Case("config.json negative norm epsilon",
         lambda ck: _json_edit(ck / "config.json", lambda c: c.update(rms_norm_eps=-1e-6)),
         ("config.json", "'norm_eps' = -1e-06", "(0, 0.1]")),
    Case("config.json absurd routed scaling factor",
         lambda ck: _json_edit(ck / "config.json", lambda c: c.update(routed_scaling_factor=1e30)),
         ("config.json", "'route_scale' = 1e+30", "(0, 16]")),
    Case("index not JSON", lambda ck: (ck / INDEX_NAME).write_text("{"), (INDEX_NAME, "unreadable")),
    Case("index weight_map a list", lambda ck: _json_edit(ck / INDEX_NAME, lambda i: i.update(weight_map=[])),
         (INDEX_NAME, "weight_map")),
    Case("index points outside the folder",
         lambda ck: _json_edit(ck / INDEX_NAME, lambda i: i["weight_map"].update({"head.weight": "../../etc/passwd"})),
         (INDEX_NAME, "head.weight", "inside the checkpoint folder")),
    Case("shard deleted", lambda ck: (ck / SHARD2).unlink(), (SHARD2, "missing", "652 tensor(s)")),
    Case("shard empty", lambda ck: (ck / SHARD1).write_bytes(b""), (SHARD1, "truncated", "280 tensor(s)")),
    Case("shard truncated", lambda ck: (ck / SHARD2).write_bytes((ck / SHARD2).read_bytes()[:-4096]),
         (SHARD2, "truncated")),
    Case("shard header length garbage",
         lambda ck: (ck / SHARD1).write_bytes(struct.pack("<Q", 2**60) + (ck / SHARD1).read_bytes()[8:]),
         (SHARD1, "header length")),
    Case("shard header not JSON",
         lambda ck: (ck / SHARD1).write_bytes((ck / SHARD1).read_bytes()[:8] + b"#" + (ck / SHARD1).read_bytes()[9:]),
         (SHARD1, "not valid JSON")),
    Case("shard header unknown dtype", lambda ck: _set_header_entry(ck, "head.weight", dtype="BF17"),
         ("head.weight", "unknown dtype")),
    Case("shard header negative shape", lambda ck: _set_header_entry(ck, "norm.weight", shape=[-64]),
         ("norm.weight", "shape")),
    Case("shard header offsets overlap", lambda ck: _rewrite_header(ck, SHARD1, _shift_second_tensor_back),
         (SHARD1, "overlaps the previous tensor")),
    Case("bytes appended to a shard", lambda ck: open(ck / SHARD2, "ab").write(b"\0" * 64),
         (SHARD2, "64 bytes after the last tensor")),
    Case("tensor missing from shard and index",
         lambda ck: (_rewrite_tensors(ck, "layers.1.attn.wkv.weight", lambda t: t.pop("layers.1.attn.wkv.weight")),
                     _json_edit(ck / INDEX_NAME, lambda i: i["weight_map"].pop("layers.1.attn.wkv.weight"))),
         ("layers.1.attn.wkv.weight", "missing")),
    Case("wrong dtype", lambda ck: _rewrite_tensors(
        ck, "head.weight", lambda t: t.update({"head.weight": t["head.weight"].float()})),
        ("head.weight", "dtype F32", "expected BF16")),
    Case("wrong shape", lambda ck: _rewrite_tensors(
        ck, "norm.weight", lambda t: t.update({"norm.weight": torch.cat([t["norm.weight"]] * 2)})),
        ("norm.weight", "shape")),
    Case("NaN in a BF16 weight", lambda ck: _poke(ck, "head.weight", 1234, bytes([0xC1, 0x7F])),
         ("head.weight", "non-finite BF16", "1 NaN")),
    Case("Inf in an F32 tensor", lambda ck: _poke(ck, "hc_head_fn", 3, struct.pack("<f", float("inf"))),
         ("hc_head_fn", "non-finite F32", "1 Inf")),
    Case("0xFF E8M0 scale", lambda ck: _poke(ck, "layers.4.ffn.experts.7.w1.scale", 5, b"\xff"),
         ("layers.4.ffn.experts.7.w1.scale", "0xFF")),
    Case("E8M0 scale overflowing bf16", lambda ck: _poke(ck, "layers.0.attn.wkv.scale", 0, bytes([250])),
         ("layers.0.attn.wkv.scale", "1 overflowing", "bf16")),
    Case("NaN FP8 weight byte", lambda ck: _poke(ck, "layers.0.attn.wq_a.weight", 77, b"\x7f"),
         ("layers.0.attn.wq_a.weight", "FP8 byte(s) are NaN")),
    Case("expert id out of range", lambda ck: _poke(ck, "layers.1.ffn.gate.tid2eid", 9, struct.pack("<q", 999)),
         ("layers.1.ffn.gate.tid2eid", "expert id(s) outside")),
    Case("tokenizer.json not JSON", lambda ck: (ck / "tokenizer.json").write_text('{"model": '),
         ("tokenizer.json", "not a tokenizer")),
    Case("tokenizer.json with a non-string key",
         lambda ck: _json_edit(ck / "tokenizer.json", lambda d: d["model"].update(vocab=[[1, 2]])),
         ("tokenizer.json", "not a tokenizer")),
    Case("tokenizer.json BOS and EOS swapped", _tokenizer_with_swapped_eos, ("tokenizer.json", "EOS")),
]


def _tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def original_hashes():
    """Every committed file under data/ (checkpoints, goldens, results, tokenizers), byte-identical afterwards."""
    before = _tree_hashes(DATA)
    yield before
    assert _tree_hashes(DATA) == before, "a file under data/ changed while copies of data/tiny were damaged"


def _one_run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)  # an exception escaping here would be a traceback: the test fails on it
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_damaged_copy_is_refused_by_inspect_and_generate(case, tmp_path, capsys, original_hashes):
    ck = tmp_path / "tiny"
    shutil.copytree(TINY, ck)
    case.damage(ck)

    code, out, err = _one_run(["inspect", str(ck)], capsys)
    assert code != 0, f"inspect accepted a damaged copy ({case.name}):\n{out}"
    said = out + err
    assert "Traceback" not in said
    for needle in case.says:
        assert needle in said, (needle, said)

    code, out, err = _one_run(["generate", "--checkpoint", str(ck), "--prompt-ids", "5,6,7", "--max-new-tokens",
                               "2", "--device", "cpu"], capsys)
    assert code == 2 and "output_ids" not in out, f"generate ran on a damaged copy ({case.name}):\n{out}"
    first, *rest = err.splitlines()
    assert first.startswith("dsv4lab generate: error: ") and "Traceback" not in err
    assert all(line.startswith("  ") for line in rest), err  # further lines only list the problems


def test_one_bad_shard_is_one_problem_with_the_count_it_takes(tmp_path):
    ck = tmp_path / "tiny"
    shutil.copytree(TINY, ck)
    (ck / SHARD2).write_bytes((ck / SHARD2).read_bytes()[:100])
    rep = Checkpoint(ck).validate()
    assert len(rep.problems) == 1, rep.problems
    assert rep.problems[0].startswith(f"{SHARD2}: ") and "the 652 tensor(s) the index maps to it" in rep.problems[0]


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)


def test_load_scans_small_checkpoints_and_says_when_it_skips_the_scan(tmp_path, monkeypatch, caplog, capsys):
    import dsv4lab
    from dsv4lab.engine import loader
    from dsv4lab.core.errors import CheckpointError
    ck = tmp_path / "tiny"
    shutil.copytree(TINY, ck)
    _poke(ck, "head.weight", 7, bytes([0xC1, 0x7F]))
    with pytest.raises(CheckpointError, match="head.weight: 1 non-finite BF16"):
        dsv4lab.load(ck, device="cpu", max_batch=1)
    dsv4lab.load(TINY, device="cpu", max_batch=1, progress=True)  # a bar per phase, on stderr
    err = capsys.readouterr().err
    assert "scanning tiny" in err and "loading tiny" in err
    monkeypatch.setattr(loader, "VALUE_SCAN_LIMIT", 1 << 20)  # as if data/tiny (16 MB) were the real checkpoint
    with caplog.at_level("WARNING", logger="dsv4lab.load"):
        dsv4lab.load(ck, device="cpu", max_batch=1)
    assert f"run `dsv4lab inspect {ck}` to scan every value" in caplog.text and "skipped the scan" in caplog.text
