"""Native checkpoint I/O: inventory, validation of damaged copies, deterministic regeneration (issue 2)."""
import contextlib
import io
import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4lab.core.checkpoint import Checkpoint, CheckpointError, file_hashes, inventory, make_random_checkpoint
from dsv4lab.core.config import get_preset
from dsv4lab.faces import cli

CLI = [sys.executable, "-m", "dsv4lab"]


def run_cli(*args, own_process: bool = False) -> subprocess.CompletedProcess:
    """``dsv4lab ARGS``: its exit status, stdout and stderr. In this process (``cli.main``; an exception that escapes
    it fails the test, as a traceback would) unless ``own_process`` (test_not_a_checkpoint_and_bad_config: the
    command's refusals from its own process)."""
    if own_process:
        return subprocess.run(CLI + list(args), capture_output=True, text=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(args))
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


def test_flash_inventory_matches_the_real_index():
    inv = inventory(get_preset("flash"))
    assert inv.tensors == 69_187 and inv.total_bytes == 159_609_485_896
    assert {k: v[0] for k, v in inv.by_dtype.items()} == {
        "BF16": 433, "F32": 417, "F8_E4M3": 375, "F8_E8M0": 34_167, "I8": 33_792, "I64": 3}
    assert round(inv.params_main / 1e9, 2) == 284.33 and round(inv.params_with_mtp / 1e9, 2) == 290.94


def test_inventory_cli_allocates_no_weights():
    r = run_cli("inventory", "flash")
    assert r.returncode == 0, r.stderr
    assert "69,187" in r.stdout and "159,609,485,896" in r.stdout


def test_inspect_tiny_ok(tiny_path):
    r = run_cli("inspect", str(tiny_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "tensors" in r.stdout
    rep = Checkpoint(tiny_path).validate()
    assert rep.ok and rep.inventory.tensors == inventory(get_preset("tiny")).tensors


def _shard_of(ck_dir, name):
    idx = json.loads((ck_dir / "model.safetensors.index.json").read_text())
    return ck_dir / idx["weight_map"][name]


def _refused(path, *needles):
    r = run_cli("inspect", str(path))
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)
    with pytest.raises(CheckpointError):
        Checkpoint(path).validate().raise_if_failed()


def test_tensor_removed_from_index_is_refused(tiny_copy):
    name = "layers.2.attn.wq_b.weight"
    p = tiny_copy / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    del idx["weight_map"][name]
    p.write_text(json.dumps(idx))
    _refused(tiny_copy, name)


def test_tensor_missing_from_shard_is_refused(tiny_copy):
    name = "layers.3.ffn.experts.5.w2.scale"
    shard = _shard_of(tiny_copy, name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    _refused(tiny_copy, name, "missing")


def test_truncated_shard_is_refused(tiny_copy):
    shard = sorted(tiny_copy.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    _refused(tiny_copy, shard.name, "truncated")


def test_wrong_dtype_is_refused(tiny_copy):
    name = "layers.1.attn.wkv.weight"
    shard = _shard_of(tiny_copy, name)
    tensors = load_file(shard)
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    _refused(tiny_copy, name, "BF16", "F8_E4M3")


def test_nan_expert_scale_is_refused(tiny_copy):
    name = "layers.4.ffn.experts.7.w1.scale"
    shard = _shard_of(tiny_copy, name)
    ck = Checkpoint(tiny_copy)
    off = ck.info(name).begin + 5
    ck.close()
    data = bytearray(shard.read_bytes())
    data[off] = 0xFF
    shard.write_bytes(bytes(data))
    _refused(tiny_copy, name, "0xFF")


def test_not_a_checkpoint_and_bad_config(tmp_path, tiny_copy):
    r = run_cli("inspect", str(tmp_path / "missing"), own_process=True)
    assert r.returncode != 0 and "no such file" in r.stderr
    (tmp_path / "empty").mkdir()
    r = run_cli("inspect", str(tmp_path / "empty"), own_process=True)
    assert r.returncode != 0 and "config.json" in r.stderr and "Traceback" not in r.stderr
    cfg = json.loads((tiny_copy / "config.json").read_text())
    del cfg["head_dim"]
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    r = run_cli("inspect", str(tiny_copy), own_process=True)
    assert r.returncode != 0 and "head_dim" in r.stderr


def test_regenerating_tiny_gives_identical_files(tmp_path, tiny_path):
    out = tmp_path / "regen"
    r = run_cli("make-checkpoint", "--preset", "tiny", "--seed", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert file_hashes(out) == file_hashes(tiny_path)


def test_writer_leaves_nothing_on_failure(tmp_path):
    args = get_preset("tiny")
    calls = {"n": 0}

    def bad(spec):
        calls["n"] += 1
        if calls["n"] > 50:
            raise RuntimeError("disk full (simulated)")
        from dsv4lab.core.checkpoint import _RandomSource
        return _RandomSource(args, 0)(spec)

    from dsv4lab.core.checkpoint import write_checkpoint
    with pytest.raises(RuntimeError):
        write_checkpoint(tmp_path / "out", args, bad)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileExistsError):
        make_random_checkpoint(args, 0, tmp_path)  # exists and no overwrite


def test_lazy_reads_touch_one_tensor(tiny_path):
    ck = Checkpoint(tiny_path)
    t = ck.get("layers.0.ffn.gate.tid2eid")
    assert t.dtype == torch.int64 and t.shape == (4096, 4)
    rows = ck.get_slice("layers.0.attn.wq_b.weight", 0, 96, 192)
    assert torch.equal(rows.view(torch.uint8), ck.get("layers.0.attn.wq_b.weight")[96:192].view(torch.uint8))
    # header parsing found every tensor without loading any
    assert len(ck.tensors) == inventory(get_preset("tiny")).tensors
    assert struct.calcsize("<Q") == 8
