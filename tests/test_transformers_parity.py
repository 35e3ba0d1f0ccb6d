"""Parity with transformers' ``DeepseekV4ForCausalLM``, an independently written DeepSeek-V4 forward.

Two tiny random configurations of their own (neither is ``data/tiny``) are written as native checkpoints,
converted with :mod:`dsv4lab.tools.verify.hf_convert`, and run on both sides in float32 with every quantization simulation
off (transformers has none). Prefill logits must agree to a relative error ≤ 1e-4 at every position of prompts
that cross the window, both compression ratios and the indexer's top-k.

Where transformers' semantics differ from DeepSeek's reference (docs/transformers_parity.md), the test makes
the difference explicit:

* top-k tie order (the indexer's ReLU makes exact ties at 0 likely): the configurations use 16 index heads and
  the test asserts that no tie — nor a near-tie rounding could flip — sits on any top-k boundary, in the indexer
  or in the router, so the two implementations' different tie orders cannot matter;
* the SwiGLU clamp: limits are chosen so the clamp is active in routed *and* shared experts (asserted), and a
  negative control shows that dropping the shared-expert clamp (transformers issue #46018) breaks parity;
* per-layer RoPE base and YaRN's magnitude factor: negative controls show that either historical deviation
  breaks parity, so agreement is evidence the installed version follows the reference.

The other direction is checked too: each bug class of spec §3.11 injected into dsv4lab's reference
(``dsv4lab.load(backend=faulty_backend(...))``) breaks parity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", minversion="5.8")

import dsv4lab  # noqa: E402
from dsv4lab.core import quant  # noqa: E402
from dsv4lab.tools.verify import hf_convert  # noqa: E402
from dsv4lab.tools.verify.faults import faulty_backend  # noqa: E402
from dsv4lab.core.checkpoint import make_random_checkpoint  # noqa: E402
from dsv4lab.core.config import ModelArgs, get_preset  # noqa: E402

TOLERANCE = 1e-4
# A top-k boundary closer than this (relative to the largest |score| of the row) could be flipped by fp32
# rounding differences between the two implementations.
MIN_BOUNDARY_GAP = 1e-5


@dataclass(frozen=True)
class ParityCase:
    """One configuration: the model, the checkpoint seed, and the prompt batch it is run on."""

    name: str
    args: ModelArgs
    seed: int
    batch: int
    prompt_len: int


CASES = [
    # SWA first, CSA and HCA ratio 16, one hash layer, the real swiglu_limit 10, head_dim 80 with 16 rope dims,
    # a batch of two prompts. 160 tokens: window 16 ×10, 40 CSA entries > top-k 8, 10 HCA entries.
    ParityCase("swa-csa-hca16", get_preset("tiny").replace(
        vocab_size=512, dim=128, moe_inter_dim=64, n_layers=4, n_mtp_layers=1, n_hash_layers=1, n_heads=4,
        n_routed_experts=8, n_activated_experts=2, q_lora_rank=64, head_dim=80, rope_head_dim=16, o_groups=2,
        o_lora_rank=32, window_size=16, original_seq_len=64, rope_factor=4.0, compress_ratios=(0, 4, 16, 4, 0),
        index_n_heads=16, index_head_dim=32, index_topk=8, hc_mult=4, max_seq_len=512,
        max_position_embeddings=512), seed=1, batch=2, prompt_len=160),
    # CSA first (hash-routed), HCA ratio 128, SWA in the middle, two hash layers, hc_mult 2 with 7 Sinkhorn
    # iterations, a low swiglu_limit, other RoPE bases and YaRN betas, dim 192 (partial 128×128 FP8 blocks).
    # 300 tokens: window 24 ×12, 75 CSA entries > top-k 12, two HCA entries.
    ParityCase("csa-hca128-swa", get_preset("tiny").replace(
        vocab_size=320, dim=192, moe_inter_dim=96, n_layers=5, n_mtp_layers=1, n_hash_layers=2, n_heads=6,
        n_routed_experts=6, n_activated_experts=3, q_lora_rank=96, head_dim=128, rope_head_dim=64, o_groups=3,
        o_lora_rank=48, window_size=24, original_seq_len=128, rope_theta=20000.0, rope_factor=8.0, beta_fast=16,
        beta_slow=2, compress_rope_theta=80000.0, compress_ratios=(4, 128, 0, 4, 128, 0), index_n_heads=16,
        index_head_dim=64, index_topk=12, hc_mult=2, hc_sinkhorn_iters=7, swiglu_limit=2.0, route_scale=2.5,
        max_seq_len=512, max_position_embeddings=1024), seed=5, batch=1, prompt_len=300),
]


class TransformersProbe:
    """Forward hooks on the transformers model recording what the parity argument relies on: indexer scores,
    router scores (bias included) and the expert pre-activations the SwiGLU clamp acts on."""

    def __init__(self, model):
        self.indexer_scores: dict[int, torch.Tensor] = {}
        self.router_scores: dict[int, tuple[torch.Tensor, int]] = {}
        self.pre_activations: dict[str, list[torch.Tensor]] = {"shared_gate": [], "shared_up": [],
                                                               "routed_gate_up": []}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            comp = layer.self_attn.compressor
            if comp is not None and hasattr(comp, "indexer"):
                self._hook(comp.indexer.scorer, lambda out, i=i: self.indexer_scores.__setitem__(i, out))
            gate = layer.mlp.gate
            if hasattr(gate, "e_score_correction_bias"):
                self._hook(gate, lambda out, i=i, g=gate: self.router_scores.__setitem__(
                    i, (g.score_fn(out[0]) + g.e_score_correction_bias, g.top_k)))
            se = layer.mlp.shared_experts
            self._hook(se.gate_proj, self.pre_activations["shared_gate"].append)
            self._hook(se.up_proj, self.pre_activations["shared_up"].append)
            experts = layer.mlp.experts
            original = experts._apply_gate

            def recording_apply_gate(gate_up, original=original):
                self.pre_activations["routed_gate_up"].append(gate_up.detach().clone())
                return original(gate_up)

            experts._apply_gate = recording_apply_gate  # the eager experts backend calls it per expert
            self.handles.append(_InstanceAttr(experts, "_apply_gate"))

    def _hook(self, module, record):
        self.handles.append(module.register_forward_hook(lambda mod, inp, out: record(out)))

    def remove(self):
        for h in self.handles:
            h.remove()


class _InstanceAttr:
    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def remove(self):
        delattr(self.obj, self.name)


@dataclass
class Pair:
    case: ParityCase
    ours: object
    theirs: object
    tokens: torch.Tensor


_pairs: dict[str, Pair] = {}


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Run this module's tiny matmuls on one thread (on a busy 2-core machine, intra-op threads mostly wait on
    each other: the first forward cost 7.3 s of CPU with two threads, 0.12 s with one), and drop the models
    afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    _pairs.clear()


def _pair(case: ParityCase, tmp_path_factory) -> Pair:
    """Both models of ``case`` (built once per module)."""
    if case.name not in _pairs:
        ckpt = make_random_checkpoint(case.args, case.seed, tmp_path_factory.mktemp(case.name) / "ckpt")
        ours = dsv4lab.load(ckpt, dtype=torch.float32, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False,
                            max_batch=case.batch)
        theirs = hf_convert.load_transformers_model(ckpt, dtype=torch.float32)
        gen = torch.Generator().manual_seed(1000 + case.seed)
        tokens = torch.randint(0, case.args.vocab_size, (case.batch, case.prompt_len), generator=gen)
        _pairs[case.name] = Pair(case, ours, theirs, tokens)
    return _pairs[case.name]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def pair(request, tmp_path_factory) -> Pair:
    return _pair(request.param, tmp_path_factory)


@pytest.fixture
def first_pair(tmp_path_factory) -> Pair:
    """The first case only: the negative controls need one model to show the comparison has teeth."""
    return _pair(CASES[0], tmp_path_factory)


def _ours(pair: Pair) -> torch.Tensor:
    pair.ours.reset()
    return pair.ours.forward(pair.tokens, start_pos=0)


@torch.no_grad()
def _theirs(pair: Pair) -> torch.Tensor:
    return pair.theirs(input_ids=pair.tokens, use_cache=False).logits.float()


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position: max |ours − ref| over the vocabulary / max |ref| over the vocabulary → ``[b, n]``."""
    return (ours - ref).abs().amax(-1) / ref.abs().amax(-1)


def _worst(ours: torch.Tensor, ref: torch.Tensor) -> str:
    err = relative_error(ours, ref)
    b, p = divmod(int(err.argmax()), err.shape[1])
    v = int((ours[b, p] - ref[b, p]).abs().argmax())
    first = (err > TOLERANCE).nonzero()
    return (f"worst relative error {float(err.max()):.3e} at batch {b}, position {p} (vocab {v}: ours "
            f"{float(ours[b, p, v]):.6f}, transformers {float(ref[b, p, v]):.6f}); first position over "
            f"{TOLERANCE}: {first[0].tolist() if len(first) else None}")


def _boundary_gap(scores: torch.Tensor, k: int, visible: torch.Tensor | None = None) -> float:
    """Smallest gap between the k-th and (k+1)-th largest score of any row that picks k of more than k visible
    entries, relative to the row's largest |score|. ``inf`` when no row is ambiguous at all."""
    s = scores.reshape(-1, scores.shape[-1]).double()
    vis = torch.ones_like(s, dtype=torch.bool) if visible is None else visible.reshape(-1, s.shape[-1])
    rows = vis.sum(-1) > k
    if not rows.any():
        return math.inf
    s = s[rows].masked_fill(~vis[rows], float("-inf"))
    top = s.topk(k + 1, dim=-1).values
    scale = s.masked_fill(~vis[rows], 0).abs().amax(-1)
    return float(((top[:, k - 1] - top[:, k]) / scale).min())


# ---------------------------------------------------------------------------------------------- parity
def test_prefill_logits_match_transformers(pair: Pair):
    case, a = pair.case, pair.case.args
    probe = TransformersProbe(pair.theirs)
    try:
        ref = _theirs(pair)
    finally:
        probe.remove()
    ours = _ours(pair)
    assert ours.shape == ref.shape == (case.batch, case.prompt_len, a.vocab_size)
    assert torch.isfinite(ours).all() and torch.isfinite(ref).all()

    # The prompt crosses every boundary the comparison is meant to cover.
    n = case.prompt_len
    hca = max(r for r in a.compress_ratios[: a.n_layers] if r != 4)
    assert n > 2 * a.window_size and n // 4 > a.index_topk and n // hca >= 2

    # Different top-k tie orders cannot matter: no selection boundary is tied or nearly tied.
    positions = torch.arange(n)
    visible = torch.arange(n // 4)[None, :] < ((positions + 1) // 4)[:, None]  # [n, T]
    assert probe.indexer_scores, "no CSA layer ran"
    for layer, scores in probe.indexer_scores.items():
        gap = _boundary_gap(scores, a.index_topk, visible.expand(case.batch, -1, -1))
        assert gap > MIN_BOUNDARY_GAP, f"layer {layer}: indexer top-{a.index_topk} boundary gap {gap:.2e}"
    assert probe.router_scores, "no bias-routed layer ran"
    for layer, (scores, k) in probe.router_scores.items():
        gap = _boundary_gap(scores, k)
        assert gap > MIN_BOUNDARY_GAP, f"layer {layer}: router top-{k} boundary gap {gap:.2e}"

    # The SwiGLU clamp is exercised in routed and shared experts (gate above the limit, or |up| above it).
    lim = a.swiglu_limit
    shared_gate = torch.cat([t.flatten() for t in probe.pre_activations["shared_gate"]])
    shared_up = torch.cat([t.flatten() for t in probe.pre_activations["shared_up"]])
    routed = [t.chunk(2, dim=-1) for t in probe.pre_activations["routed_gate_up"]]
    routed_gate = torch.cat([g.flatten() for g, _ in routed])
    routed_up = torch.cat([u.flatten() for _, u in routed])
    assert int((shared_gate > lim).sum() + (shared_up.abs() > lim).sum()) > 0, "shared-expert clamp never active"
    assert int((routed_gate > lim).sum() + (routed_up.abs() > lim).sum()) > 0, "routed-expert clamp never active"

    err = relative_error(ours, ref)
    assert float(err.max()) <= TOLERANCE, _worst(ours, ref)


# ---------------------------------------------------------------------------------------------- controls
def _no_shared_clamp(model, monkeypatch):
    def unclamped(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    for layer in model.model.layers:
        se = layer.mlp.shared_experts
        monkeypatch.setattr(se, "forward", unclamped.__get__(se))


def _main_rope_on_compressed_layers(model, monkeypatch):
    for layer in model.model.layers:
        if layer.self_attn.compressor is not None:
            monkeypatch.setattr(layer.self_attn, "rope_layer_type", "main")


def _yarn_magnitude_scaling(model, monkeypatch):
    factor = 0.1 * math.log(model.config.rope_parameters["compress"]["factor"]) + 1.0
    for module in model.modules():
        if hasattr(module, "compress_attention_scaling"):
            monkeypatch.setattr(module, "compress_attention_scaling", factor)


DEVIATIONS = {
    "shared_expert_without_clamp": _no_shared_clamp,  # transformers issue #46018 (spec §3.11 item 1)
    "compressed_layers_with_swa_rope": _main_rope_on_compressed_layers,  # transformers issue #45910 (item 3)
    "yarn_mscale_on_cos_sin": _yarn_magnitude_scaling,  # spec §3.11 item 4
}


@pytest.mark.parametrize("deviation", sorted(DEVIATIONS))
def test_known_transformers_deviations_break_parity(first_pair: Pair, deviation, monkeypatch):
    """Each historical deviation of transformers from the reference, re-introduced, is detected: the parity
    test above can fail for exactly the bugs it is meant to rule out."""
    ours = _ours(first_pair)
    DEVIATIONS[deviation](first_pair.theirs, monkeypatch)
    ref = _theirs(first_pair)
    err = float(relative_error(ours, ref).max())
    assert err > 100 * TOLERANCE, f"{deviation}: relative error only {err:.2e}"


OUR_FAULTS = ["no_shared_clamp", "rope_first_half", "rope_non_interleaved", "compressed_rope_block_end",
              "stale_compressor_state"]


@pytest.mark.parametrize("fault", OUR_FAULTS)
def test_oracle_catches_reference_faults(first_pair: Pair, fault, tmp_path_factory):
    """The bug classes of spec §3.11, injected into dsv4lab's reference (``backend=faulty_backend(...)``), are caught
    by transformers. Another sequence runs in the same cache slots first, so state kept across a reset shows."""
    case = first_pair.case
    faulty = dsv4lab.load(first_pair.ours.checkpoint, dtype=torch.float32, act_quant=False, kv_fp8_sim=False,
                          indexer_fp4_sim=False, max_batch=case.batch, validate=False, backend=faulty_backend(fault))
    other = torch.randint(0, case.args.vocab_size, first_pair.tokens.shape, generator=torch.Generator().manual_seed(9))
    faulty.forward(other, start_pos=0)
    faulty.reset()
    err = float(relative_error(faulty.forward(first_pair.tokens, start_pos=0), _theirs(first_pair)).max())
    assert err > 100 * TOLERANCE, f"{fault}: relative error only {err:.2e}"


def test_reset_leaves_no_trace_in_parity(first_pair: Pair):
    """The fault-free reference, run on another sequence first and reset, still matches transformers."""
    case = first_pair.case
    other = torch.randint(0, case.args.vocab_size, first_pair.tokens.shape, generator=torch.Generator().manual_seed(9))
    first_pair.ours.reset()
    first_pair.ours.forward(other, start_pos=0)
    err = float(relative_error(_ours(first_pair), _theirs(first_pair)).max())
    assert err <= TOLERANCE, f"relative error {err:.2e} after a reset"


# ---------------------------------------------------------------------------------------------- converter
def test_converter_dequantizers_agree_with_dsv4lab_codecs():
    """The converter's own decoders (torch casts + the E2M1 table) equal dsv4lab.core.quant's on partial blocks."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(200, 328, generator=gen) * 2.0 ** torch.randint(-3, 4, (200, 328), generator=gen)
    q, s = quant.fp8_block_quantize(w)
    assert s.shape == (2, 3)
    assert torch.equal(hf_convert.dequant_fp8(q, s), quant.fp8_block_dequant(q, s, torch.float32))
    packed, s4 = quant.fp4_quantize(torch.randn(72, 96, generator=gen))
    assert torch.equal(hf_convert.dequant_fp4(packed, s4), quant.fp4_dequant(packed, s4, torch.float32))
    with pytest.raises(hf_convert.ConversionError, match="scale of shape"):
        hf_convert.dequant_fp8(q, s[:1])


def test_converter_rejects_what_transformers_cannot_express():
    base = CASES[0].args
    with pytest.raises(hf_convert.ConversionError, match="one HCA ratio"):
        hf_convert.check_convertible(base.replace(compress_ratios=(0, 4, 16, 128, 0)))
    with pytest.raises(hf_convert.ConversionError, match="n_shared_experts"):
        hf_convert.check_convertible(base.replace(n_shared_experts=2))
    with pytest.raises(hf_convert.ConversionError, match="not a DeepSeek-V4 tensor"):
        hf_convert.hf_name("model.layers.0.self_attn.q_a_proj.weight")
    assert hf_convert.hf_name("mtp.0.e_proj.weight") is None
    assert hf_convert.hf_name("layers.3.attn.wq_b.scale") is None
    assert hf_convert.hf_name("layers.3.hc_ffn_scale") == "model.layers.3.ffn_hc.scale"


def test_config_schedule_is_explicit():
    """The config carries our schedule, not transformers' V4-Pro default, and YaRN without magnitude scaling."""
    for case in CASES:
        a = case.args
        cfg = hf_convert.hf_config(a)
        kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
        assert cfg.layer_types == [kinds.get(r, "heavily_compressed_attention") for r in a.compress_ratios[:a.n_layers]]
        assert cfg.mlp_layer_types == ["hash_moe"] * a.n_hash_layers + ["moe"] * (a.n_layers - a.n_hash_layers)
        assert cfg.rope_parameters["compress"]["attention_factor"] == 1.0
        assert cfg.rope_parameters["compress"]["rope_theta"] == a.compress_rope_theta
        assert cfg.rope_parameters["main"] == {"rope_type": "default", "rope_theta": a.rope_theta,
                                               "partial_rotary_factor": a.rope_head_dim / a.head_dim}
        assert cfg.qk_rope_head_dim == a.rope_head_dim
    assert hf_convert.hf_config(CASES[0].args.replace(swiglu_limit=0.0)).swiglu_limit == math.inf


def test_flash_config_converts_to_the_flash_schedule():
    """DeepSeek-V4-Flash itself: SWA, SWA, then CSA/HCA alternating, layer 42 CSA (spec §4), HCA ratio 128."""
    a = get_preset("flash")
    cfg = hf_convert.hf_config(a)
    assert cfg.layer_types[:4] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                   "heavily_compressed_attention"]
    assert cfg.layer_types[42] == "compressed_sparse_attention" and len(cfg.layer_types) == 43
    assert cfg.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert cfg.mlp_layer_types.count("hash_moe") == 3 and cfg.mlp_layer_types[:3] == ["hash_moe"] * 3
    dims = (cfg.hidden_size, cfg.head_dim, cfg.qk_rope_head_dim, cfg.o_groups, cfg.index_topk)
    assert dims == (4096, 512, 64, 8, 512)
