"""The reference forward: decode = prefill, chunked prefill, ragged batches, hash routing (issue 3)."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import load_tiny
from dsv4lab.core.config import get_preset
from dsv4lab.engine.loader import build_model

N = 300  # crosses the window (32), both ratios (4, 16) and the index top-k (16 of 75 entries)


def _rel(a, b):
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def _prompt(n, seed, vocab=4096):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (1, n), generator=g)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_token_by_token_decode_equals_one_shot_prefill(dtype, tol):
    m = load_tiny(dtype=dtype, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False, max_batch=1)
    ids = _prompt(N, 0)
    full = m.forward(ids, 0)
    assert not torch.isnan(full).any()
    m.reset()
    dec = torch.cat([m.forward(ids[:, p:p + 1], p) for p in range(N)], 1)
    assert _rel(dec, full) <= tol


def test_chunked_prefill_equals_one_shot():
    m = load_tiny(dtype=torch.float64, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False, max_batch=1)
    ids = _prompt(N, 1)
    full = m.forward(ids, 0)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        m.reset()
        parts, p = [], 0
        while p < N:
            c = int(torch.randint(1, 70, (1,), generator=g))
            parts.append(m.forward(ids[:, p:p + c], p))
            p += c
        assert _rel(torch.cat(parts, 1)[:, :N], full) <= 1e-9


def test_chunked_prefill_with_simulations_on_matches_in_float64():
    # with the quantization simulations on, chunking changes nothing either: every simulation is per token / per entry
    m = load_tiny(dtype=torch.float64, max_batch=1)
    ids = _prompt(200, 2)
    full = m.forward(ids, 0)
    m.reset()
    parts = [m.forward(ids[:, :37], 0), m.forward(ids[:, 37:38], 37), m.forward(ids[:, 38:], 38)]
    assert _rel(torch.cat(parts, 1), full) <= 1e-9


def test_ragged_batch_equals_per_sequence_runs():
    m = load_tiny(dtype=torch.float64, max_batch=3)
    lens = [70, 23, 51]
    seqs = [_prompt(n, 10 + i)[0] for i, n in enumerate(lens)]
    ref = []
    for s in seqs:
        m.reset()
        ref.append(m.forward(s[None], 0, slots=[0])[0])
    m.reset()
    batch = torch.ones(3, max(lens), dtype=torch.long)  # padding with a valid id
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    out = m.forward(batch, 0, slots=[2, 0, 1], lengths=lens)
    for i, n in enumerate(lens):
        assert _rel(out[i, :n], ref[i]) <= 1e-9
        assert torch.isnan(out[i, n:]).all()
    # continue the ragged sequences by one decode step each, at different positions
    nxt = torch.tensor([[7], [8], [9]])
    step = m.forward(nxt, torch.tensor(lens), slots=[2, 0, 1])
    for i, s in enumerate(seqs):
        m2 = load_tiny(dtype=torch.float64, max_batch=1)
        full = m2.forward(torch.cat([s, nxt[i]])[None], 0)
        assert _rel(step[i, 0][None], full[0, -1][None]) <= 1e-9


def test_bf16_rows_are_batch_invariant_bit_for_bit():
    """In bf16 with every simulation on (the default numerics), a row's logits do not depend on the other rows:
    a ragged batched prefill and a batched decode step equal each sequence run alone, bit for bit (what
    concurrent serving relies on; README, "Batch invariance")."""
    m = load_tiny(dtype=torch.bfloat16, max_batch=3)
    lens = [23, 9, 17]
    seqs = [_prompt(n, 40 + i)[0] for i, n in enumerate(lens)]
    nxt = torch.tensor([[7], [8], [9]])
    alone = []
    for s, t in zip(seqs, nxt):
        m.reset()
        alone.append((m.forward(s[None], 0, slots=[0])[0], m.forward(t[None], len(s), slots=[0])[0, 0]))
    m.reset()
    batch = torch.ones(3, max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    out = m.forward(batch, 0, slots=[2, 0, 1], lengths=lens)
    step = m.forward(nxt, torch.tensor(lens), slots=[2, 0, 1])
    for i, n in enumerate(lens):
        assert torch.equal(out[i, :n], alone[i][0]) and torch.equal(step[i, 0], alone[i][1]), f"row {i}"


def test_last_logits_are_the_last_rows_of_all_logits():
    """``logits="last"``: each row's logits at its last valid token, bit for bit those of the all-positions form
    (the head and ``hc_head`` are row-independent), NaN for an empty row; the MTP form, fed the same greedy token, gives
    its logits at the last token too: the last row of its all-positions form."""
    m = load_tiny(dtype=torch.bfloat16, max_batch=3)
    lens = [19, 7, 0]
    batch = _prompt(19, 21).repeat(3, 1)
    full = m.forward(batch, 0, slots=[0, 1, 2], lengths=lens)
    m.reset()
    last = m.forward(batch, 0, slots=[0, 1, 2], lengths=lens, logits="last")
    assert last.shape == (3, 1, full.shape[-1])
    assert torch.equal(last[0, 0], full[0, 18]) and torch.equal(last[1, 0], full[1, 6])
    assert torch.isnan(last[2]).all()
    m.reset()
    ids = _prompt(12, 22)
    all_pos, mtp_all = m.forward(ids, 0, mtp=True)
    m.reset()
    last_pos, mtp_last = m.forward(ids, 0, mtp=True, logits="last")
    assert mtp_last.shape == (1, 1, mtp_all.shape[-1])
    assert torch.equal(last_pos[:, 0], all_pos[:, -1]) and torch.equal(mtp_last[:, 0], mtp_all[:, -1])
    with pytest.raises(ValueError, match="logits must be 'all' or 'last'"):
        m.forward(ids, 12, logits="first")


def test_slots_are_independent_and_reset():
    m = load_tiny(dtype=torch.float64, max_batch=2)
    a, b = _prompt(40, 3), _prompt(40, 4)
    ra = m.forward(a, 0, slots=[0])
    m.forward(b, 0, slots=[1])
    m.reset([0])
    again = m.forward(a, 0, slots=[0])
    assert torch.equal(ra, again)
    with pytest.raises(ValueError, match="does not continue"):
        m.forward(a[:, :1], 0, slots=[1])


def test_hash_layers_route_by_token_id():
    m = load_tiny(dtype=torch.float32, max_batch=1)
    args = m.args
    seen = {}
    m.forward(torch.tensor([[5, 9, 5, 300]]), 0, trace=lambda k, v: seen.__setitem__(k, v.clone()))
    for layer in range(args.n_layers):
        idx = seen[f"layers.{layer}.ffn.router_idx"]
        if args.is_hash_layer(layer):
            tid2eid = m.model.layers[layer].ffn.gate.tid2eid
            assert torch.equal(idx, tid2eid[torch.tensor([5, 9, 5, 300])])
        else:
            assert m.model.layers[layer].ffn.gate.tid2eid is None


def test_flash_builds_on_meta_with_the_real_parameter_count():
    model = build_model(get_preset("flash"))
    n_main = n_all = 0
    for name, b in model.named_buffers():
        if name.endswith("scale") and b.dtype == torch.float8_e8m0fnu:
            continue
        n = b.numel() * (2 if b.dtype == torch.int8 else 1)  # packed FP4 holds two parameters per byte
        n_all += n
        if not name.startswith("mtp."):
            n_main += n
    assert all(b.device.type == "meta" for b in model.buffers())
    assert round(n_main / 1e9, 2) == 284.33 and round(n_all / 1e9, 2) == 290.94


def test_generate_cli_is_deterministic(tiny_path):
    cmd = [sys.executable, "-m", "dsv4lab", "generate", "--checkpoint", str(tiny_path), "--prompt-ids",
           "5,6,7,8,9", "--max-new-tokens", "12", "--json"]
    outs = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout) for _ in range(2)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] and outs[0]["hash"] == outs[1]["hash"]
    assert len(outs[0]["output_ids"]) == 12 and len(outs[0]["hash"]) == 16
    m = load_tiny(max_batch=1)
    assert m.generate([5, 6, 7, 8, 9], 12) == outs[0]["output_ids"]
