"""Native DeepSeek-V4 checkpoint → Hugging Face transformers' ``DeepseekV4ForCausalLM`` (the independent oracle).

transformers (≥ 5.8) ships its own eager implementation of DeepSeek-V4. Fed the same weights, it is a second,
independently written forward to compare the reference model with. This module converts a native checkpoint
(spec §2.2 names, FP8/FP4 storage) into that model, so the oracle never depends on dsv4lab's model code:

* :func:`hf_config` builds the ``DeepseekV4Config`` *explicitly* from :class:`~dsv4lab.core.config.ModelArgs`. Left to
  its defaults, transformers silently falls back to the V4-Pro layer schedule, maps only the compress ratios
  0/4/128, and applies YaRN's 1.277 magnitude factor to cos/sin — DeepSeek's reference does none of that.
* :func:`hf_state_dict` renames every tensor, dequantizes FP8 (128×128 E8M0 blocks, partial edge blocks
  included) and FP4 (E2M1 with 1×32 E8M0 groups) with its own small decoder (torch's float8 casts and the E2M1
  value table of spec §2.3 — deliberately not :mod:`dsv4lab.core.quant`, so a codec bug cannot hide on both sides),
  and merges each layer's routed experts into ``gate_up_proj [E, 2I, D]`` (w1 rows, then w3) and
  ``down_proj [E, D, I]``. MTP tensors are dropped (transformers has no MTP module).
* :func:`load_transformers_model` puts both together.

transformers is imported inside the functions (it is a test dependency, and ``import dsv4lab`` stays light).
The semantic differences between transformers and DeepSeek's reference, and how the parity test handles each,
are listed in ``docs/transformers_parity.md``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from dsv4lab.core.checkpoint import Checkpoint
from dsv4lab.core.config import ModelArgs
from dsv4lab.core.errors import ConversionError

# E2M1 code → value (sign bit = bit 3), spec §2.3.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# ---------------------------------------------------------------------------------------------- config
def check_convertible(args: ModelArgs) -> int | None:
    """Raise :class:`ConversionError` if transformers cannot represent ``args``; return the HCA ratio (or None)."""
    main = args.compress_ratios[: args.n_layers]
    hca = sorted({r for r in main if r not in (0, 4)})
    if len(hca) > 1:
        raise ConversionError(f"compress_ratios {list(main)}: transformers allows one HCA ratio per model "
                              f"(compress_rates is keyed by layer type), got {hca}")
    if args.n_shared_experts != 1:
        raise ConversionError(f"n_shared_experts = {args.n_shared_experts}: transformers builds exactly one "
                              "shared expert")
    if args.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConversionError(f"score_func {args.score_func!r} has no transformers activation")
    return hca[0] if hca else None


def hf_config(args: ModelArgs, attn_implementation: str = "eager") -> Any:
    """The transformers ``DeepseekV4Config`` of ``args``, with every schedule and RoPE field set explicitly.

    ``swiglu_limit = 0`` (dsv4lab: no clamp) becomes ``inf``: transformers would otherwise clamp at 0.
    """
    from transformers import DeepseekV4Config

    hca_ratio = check_convertible(args)
    main = args.compress_ratios[: args.n_layers]
    layer_types = [_SWA if r == 0 else (_CSA if r == 4 else _HCA) for r in main]
    partial = args.rope_head_dim / args.head_dim
    rope_parameters = {
        # SWA layers: plain RoPE, theta = rope_theta, no YaRN.
        "main": {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": partial},
        # CSA/HCA layers (and their compressors and indexer): compress_rope_theta with DeepSeek's YaRN, which
        # scales frequencies only — attention_factor must be 1.0 or transformers multiplies cos/sin by
        # 0.1·ln(factor) + 1.
        "compress": {"rope_type": "yarn", "rope_theta": args.compress_rope_theta, "factor": args.rope_factor,
                     "original_max_position_embeddings": args.original_seq_len, "beta_fast": args.beta_fast,
                     "beta_slow": args.beta_slow, "attention_factor": 1.0, "partial_rotary_factor": partial},
    }
    cfg = DeepseekV4Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, moe_intermediate_size=args.moe_inter_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=1,
        head_dim=args.head_dim, q_lora_rank=args.q_lora_rank, partial_rotary_factor=partial,
        num_experts_per_tok=args.n_activated_experts, n_routed_experts=args.n_routed_experts,
        n_shared_experts=args.n_shared_experts, scoring_func=args.score_func, norm_topk_prob=True,
        routed_scaling_factor=args.route_scale,
        # the YaRN factor is explicit; keep max/original consistent so transformers does not warn about it
        max_position_embeddings=int(args.original_seq_len * args.rope_factor),
        rope_theta=args.rope_theta, compress_rope_theta=args.compress_rope_theta, rope_parameters=rope_parameters,
        layer_types=layer_types,
        compress_rates={_CSA: 4, _HCA: hca_ratio if hca_ratio is not None else 128},
        mlp_layer_types=["hash_moe" if args.is_hash_layer(i) else "moe" for i in range(args.n_layers)],
        hc_mult=args.hc_mult, hc_sinkhorn_iters=args.hc_sinkhorn_iters, hc_eps=args.hc_eps,
        swiglu_limit=args.swiglu_limit if args.swiglu_limit > 0 else float("inf"),
        sliding_window=args.window_size, o_groups=args.o_groups, o_lora_rank=args.o_lora_rank,
        index_n_heads=args.index_n_heads, index_head_dim=args.index_head_dim, index_topk=args.index_topk,
        num_nextn_predict_layers=args.n_mtp_layers, rms_norm_eps=args.norm_eps,
        bos_token_id=args.bos_token_id, eos_token_id=args.eos_token_id, tie_word_embeddings=False,
        attention_bias=False, attention_dropout=0.0, use_cache=False,
        # plain per-expert loop: the most readable of transformers' expert backends, and no fused kernels
        attn_implementation=attn_implementation, experts_implementation="eager",
    )
    # The fields transformers derives must come out as DeepSeek's; a silent mismatch here would make every
    # later comparison meaningless.
    derived = {"qk_rope_head_dim": (cfg.qk_rope_head_dim, args.rope_head_dim),
               "layer_types": (list(cfg.layer_types), layer_types),
               "compress_rates": (cfg.compress_rates[_CSA], 4)}
    for name, (got, want) in derived.items():
        if got != want:
            raise ConversionError(f"transformers derived {name} = {got!r}, expected {want!r}")
    return cfg


# ---------------------------------------------------------------------------------------------- dequant
def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    # E8M0 byte b encodes 2^(b-127); torch's own cast, not dsv4lab.core.quant's decoder.
    return scale.float()


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """E4M3 ``[N, K]`` × E8M0 ``[ceil(N/b), ceil(K/b)]`` → fp32 ``[N, K]``; edge blocks may be partial."""
    n, k = weight.shape
    want = (-(-n // block), -(-k // block))
    if tuple(scale.shape) != want:
        raise ConversionError(f"FP8 weight {list(weight.shape)} needs a scale of shape {list(want)}, "
                              f"got {list(scale.shape)}")
    rows = torch.arange(n) // block
    cols = torch.arange(k) // block
    return weight.float() * _e8m0(scale)[rows[:, None], cols[None, :]]


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Packed E2M1 ``[N, K/2]`` (element 2c in the low nibble of byte c) × E8M0 ``[N, K/group]`` → fp32."""
    n, half = packed.shape
    if tuple(scale.shape) != (n, 2 * half // group):
        raise ConversionError(f"FP4 weight {list(packed.shape)} needs a scale of shape "
                              f"{[n, 2 * half // group]}, got {list(scale.shape)}")
    b = packed.view(torch.uint8).long()
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(n, 2 * half)
    values = torch.tensor(_E2M1_VALUES, dtype=torch.float32)[codes]
    return values * _e8m0(scale).repeat_interleave(group, dim=1)


def _logical(ck: Checkpoint, name: str) -> torch.Tensor:
    """The fp32 value of native weight ``name`` (dequantized when it has a ``.scale`` companion)."""
    t = ck.get(name)
    scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
    if scale_name is not None and scale_name in ck:
        s = ck.get(scale_name)
        if t.dtype == torch.float8_e4m3fn:
            return dequant_fp8(t, s)
        if t.dtype in (torch.int8, torch.uint8) or t.dtype == getattr(torch, "float4_e2m1fn_x2", None):
            return dequant_fp4(t, s)
        raise ConversionError(f"{name}: dtype {t.dtype} with a block scale is neither FP8 nor packed FP4")
    if t.dtype.is_floating_point:
        return t.float()
    return t


# ---------------------------------------------------------------------------------------------- names
# Per-layer native suffix → transformers suffix (spec §2.2); experts are merged separately.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_GLOBAL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def hf_name(native: str) -> str | None:
    """transformers' name of native tensor ``native``; None for tensors it has no place for (scales are folded
    into their weights, MTP is not modelled, routed experts are merged by :func:`hf_state_dict`)."""
    if native in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[native]
    if native.startswith("mtp.") or native.endswith(".scale"):  # hc_*_scale has no dot: it is kept
        return None
    parts = native.split(".")
    if parts[0] != "layers" or len(parts) < 3:
        raise ConversionError(f"{native}: not a DeepSeek-V4 tensor name")
    suffix = ".".join(parts[2:])
    if suffix.startswith("ffn.experts."):
        return None
    if suffix not in _LAYER_NAMES:
        raise ConversionError(f"{native}: no transformers counterpart known")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[suffix]}"


def hf_state_dict(checkpoint: str | Path | Checkpoint) -> dict[str, torch.Tensor]:
    """transformers' state dict (fp32, tid2eid int64) of a native checkpoint, MTP excluded.

    Every tensor is materialised in fp32: meant for test-size models, not for the 284 B-parameter checkpoint.
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    args = ck.args
    check_convertible(args)
    out: dict[str, torch.Tensor] = {}
    for name in ck.names():
        target = hf_name(name)
        if target is not None:
            out[target] = _logical(ck, name)
    for layer in range(args.n_layers):
        out.update(_merged_experts(ck, args, layer))
    return out


def _merged_experts(ck: Checkpoint, args: ModelArgs, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
    pre = f"layers.{layer}.ffn.experts"
    gate_up, down = [], []
    for e in range(args.n_routed_experts):
        w1, w3 = _logical(ck, f"{pre}.{e}.w1.weight"), _logical(ck, f"{pre}.{e}.w3.weight")
        gate_up.append(torch.cat((w1, w3), 0))  # [2I, D]: gate rows, then up rows
        down.append(_logical(ck, f"{pre}.{e}.w2.weight"))  # [D, I]
    yield f"model.layers.{layer}.mlp.experts.gate_up_proj", torch.stack(gate_up)
    yield f"model.layers.{layer}.mlp.experts.down_proj", torch.stack(down)


# ---------------------------------------------------------------------------------------------- model
def load_transformers_model(checkpoint: str | Path, dtype: torch.dtype = torch.float32):
    """A transformers ``DeepseekV4ForCausalLM`` holding the checkpoint's weights (eager attention, eval mode).

    Every parameter and persistent buffer of the transformers model must be filled by the checkpoint and every
    converted tensor must land somewhere; either failure raises :class:`ConversionError` naming the tensors.
    """
    from transformers import DeepseekV4ForCausalLM

    ck = Checkpoint(checkpoint)
    cfg = hf_config(ck.args)
    state = hf_state_dict(ck)
    model = DeepseekV4ForCausalLM(cfg)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConversionError(f"{ck.path}: transformers weights not filled: {sorted(result.missing_keys)}; "
                              f"converted tensors with no place: {sorted(result.unexpected_keys)}")
    # DeepSeek's YaRN scales frequencies only; a cos/sin magnitude factor other than 1 is spec §3.11 item 4.
    for name, module in model.named_modules():
        if type(module).__name__ != "DeepseekV4RotaryEmbedding":
            continue
        for label in module.layer_types:  # the rope-parameter sets: "main" (SWA) and "compress" (CSA/HCA)
            factor = getattr(module, f"{label}_attention_scaling")
            if factor != 1.0:
                raise ConversionError(f"{name}: transformers scales {label!r} cos/sin by {factor}, expected 1.0")
    return model.to(dtype).eval()


__all__ = ["ConversionError", "check_convertible", "hf_config", "hf_state_dict", "hf_name", "dequant_fp8",
           "dequant_fp4", "load_transformers_model"]
