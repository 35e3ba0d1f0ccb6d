"""Model configuration: the `ModelArgs` dataclass, its HF `config.json` mapping, and named presets.

Field names follow DeepSeek's own `inference/ModelArgs` (``dim``, ``moe_inter_dim``, ``window_size`` ...);
:meth:`ModelArgs.from_hf_config` maps the Hugging Face keys of a checkpoint's ``config.json`` onto them and
:meth:`ModelArgs.to_hf_config` writes them back, so a checkpoint written by dsv4lab reads like the real one.

Per-layer structure (spec §4) is derived, never stored twice:

* ``compress_ratios[L]`` — 0: sliding-window attention only (SWA); 4: compressed sparse attention with the
  lightning indexer and an overlapping compressor (CSA); any larger ratio: heavily compressed attention over
  every completed block (HCA). The list has ``n_layers + n_mtp_layers`` entries; the tail belongs to the MTP
  blocks.
* RoPE: SWA layers use ``rope_theta`` without YaRN; CSA/HCA layers use ``compress_rope_theta`` with
  DeepSeek's YaRN (no magnitude scaling) for every rotary use inside the layer.
* Routing: the first ``n_hash_layers`` layers route by token id through ``tid2eid``; the rest (and MTP) pick a
  biased top-k.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dsv4lab.core.errors import ConfigError, excerpt
from dsv4lab.core.paths import read_json

LayerKind = Literal["swa", "csa", "hca"]

# The range each field with a physical meaning must be in, checked before any work (:meth:`ModelArgs.validate`):
# integers ``(lo, hi)`` inclusive, numbers ``(lo, hi)`` with ``lo`` excluded. The upper ends sit far above every
# published DeepSeek model (Flash: 43 layers, 256 experts, dim 4,096, 20 Sinkhorn iterations, a routed scaling
# factor of 1.5; V3: 2.5) and keep a malformed config.json from asking for a loop of 10^8 iterations or tables of
# 10^5 layers before anything is read; the lower ends are where the arithmetic stops meaning anything (an epsilon
# of 0 divides by zero on a zero row, a negative one takes the square root of a negative number).
BOUNDS: dict[str, tuple[Any, Any]] = {
    "vocab_size": (1, 1 << 20), "dim": (1, 1 << 16), "moe_inter_dim": (1, 1 << 16), "n_layers": (1, 1024),
    "n_mtp_layers": (0, 16), "n_hash_layers": (0, 1024), "n_heads": (1, 1024), "n_routed_experts": (1, 4096),
    "n_shared_experts": (0, 16), "n_activated_experts": (1, 4096), "q_lora_rank": (1, 1 << 16),
    "head_dim": (1, 4096), "rope_head_dim": (1, 4096), "o_groups": (1, 1024), "o_lora_rank": (1, 1 << 16),
    "window_size": (1, 1 << 24), "original_seq_len": (1, 1 << 24), "beta_fast": (1, 1024), "beta_slow": (1, 1024),
    "index_n_heads": (1, 1024), "index_head_dim": (1, 4096), "index_topk": (1, 1 << 20), "hc_mult": (1, 16),
    "hc_sinkhorn_iters": (1, 100), "max_seq_len": (1, 1 << 24), "max_position_embeddings": (1, 1 << 24),
    "bos_token_id": (0, 1 << 20), "eos_token_id": (0, 1 << 20),
    "norm_eps": (0.0, 0.1), "hc_eps": (0.0, 0.1), "route_scale": (0.0, 16.0), "rope_theta": (0.0, 1e12),
    "compress_rope_theta": (0.0, 1e12), "rope_factor": (0.0, 1e4),
}
MAX_COMPRESS_RATIO = 1024
"""The largest compression ratio (Flash: 128); a compressor keeps two rings of ``2 × ratio`` rows per sequence."""


@dataclass(frozen=True)
class ModelArgs:
    """Every hyper-parameter of a DeepSeek-V4 model (defaults: DeepSeek-V4-Flash).

    Attributes:
        vocab_size: rows of the embedding and of the LM head.
        dim: model (residual stream) width, HF ``hidden_size``.
        moe_inter_dim: intermediate width of routed and shared experts, HF ``moe_intermediate_size``.
        n_layers: transformer blocks of the main model (the MTP blocks come on top).
        n_mtp_layers: multi-token-prediction blocks, HF ``num_nextn_predict_layers``.
        n_hash_layers: the first layers that route by token id through ``ffn.gate.tid2eid``.
        n_heads: attention (query) heads; there is one shared latent K=V head.
        n_routed_experts: routed experts per MoE layer.
        n_shared_experts: shared experts per MoE layer (the real model has 1).
        n_activated_experts: top-k routed experts per token, HF ``num_experts_per_tok``.
        score_func: router score function; DeepSeek-V4 uses ``"sqrtsoftplus"``.
        route_scale: multiplier applied after renormalising the top-k weights, HF ``routed_scaling_factor``.
        swiglu_limit: SwiGLU clamp (gate ≤ limit, up ∈ [−limit, limit]) in routed *and* shared experts.
        q_lora_rank: width of the query LoRA latent (``wq_a`` output, indexer input).
        head_dim: query/key/value head width.
        rope_head_dim: rotary dims, the *last* ``rope_head_dim`` of each head, rotated as interleaved pairs.
        o_groups: groups of the grouped output projection ``wo_a``.
        o_lora_rank: per-group rank of ``wo_a``.
        window_size: sliding-window length (every layer attends to its last ``window_size`` tokens).
        original_seq_len: YaRN's original context, HF ``rope_scaling.original_max_position_embeddings``.
        rope_theta: RoPE base of SWA layers (no YaRN there).
        rope_factor: YaRN factor (CSA/HCA layers).
        beta_fast: YaRN high-frequency boundary.
        beta_slow: YaRN low-frequency boundary.
        compress_rope_theta: RoPE base of CSA/HCA layers.
        compress_ratios: per-block compression ratio, ``n_layers + n_mtp_layers`` entries (see module doc).
        index_n_heads: lightning-indexer heads.
        index_head_dim: lightning-indexer head width (a power of two: it is Hadamard-rotated).
        index_topk: compressed entries a CSA query attends to.
        hc_mult: mHC residual streams.
        hc_sinkhorn_iters: Sinkhorn iterations of the mHC mixing matrix.
        hc_eps: mHC epsilon.
        norm_eps: RMSNorm epsilon (also the mHC RMS epsilon).
        max_seq_len: positions the caches and RoPE tables are sized for (a runtime choice, not in config.json).
        max_position_embeddings: the model's declared context limit.
        bos_token_id: beginning-of-sequence id.
        eos_token_id: end-of-sequence id.
        dtype: dense projection storage, ``"fp8"`` (E4M3 with 128×128 E8M0 block scales) or ``"bf16"``.
        expert_dtype: routed expert storage, ``"fp4"`` (E2M1, 1×32 E8M0 scales) or ``"fp8"``.
        scale_fmt: block-scale format; DeepSeek-V4 uses ``"ue8m0"`` (powers of two).
        weight_block_size: FP8 weight block (rows, cols).
        fp4_block_size: FP4 scale group along K.

    Every field is checked when the object is made (:meth:`validate`): sizes, counts and numbers with a physical
    meaning against :data:`BOUNDS`, positions (``max_seq_len``, ``window_size``, ``original_seq_len``) against
    ``max_position_embeddings``, token ids against ``vocab_size``, and the shapes against each other.
    """

    vocab_size: int = 129280
    dim: int = 4096
    moe_inter_dim: int = 2048
    n_layers: int = 43
    n_mtp_layers: int = 1
    n_hash_layers: int = 3
    n_heads: int = 64
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    q_lora_rank: int = 1024
    head_dim: int = 512
    rope_head_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    compress_rope_theta: float = 160000.0
    compress_ratios: tuple[int, ...] = tuple([0, 0] + [4, 128] * 20 + [4] + [0])
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    dtype: str = "fp8"
    expert_dtype: str = "fp4"
    scale_fmt: str = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)
    fp4_block_size: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        object.__setattr__(self, "weight_block_size", tuple(int(b) for b in self.weight_block_size))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field outside its bounds (:data:`BOUNDS`) or inconsistent
        with another, in one line: ``config field 'norm_eps' = -1e-06: must be a finite number in (0, 0.1]``."""

        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config field {name!r} = {excerpt(getattr(self, name))}: {msg}")

        for name, (lo, hi) in BOUNDS.items():
            v = getattr(self, name)
            if isinstance(lo, int):
                need(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, name,
                     f"must be an integer in [{lo:,}, {hi:,}]")
            else:
                need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo < v <= hi,
                     name, f"must be a finite number in ({lo:g}, {hi:g}]")
        need(isinstance(self.swiglu_limit, (int, float)) and math.isfinite(self.swiglu_limit)
             and self.swiglu_limit >= 0, "swiglu_limit", "must be a finite number >= 0 (0 disables the clamp)")
        need(self.score_func in ("sqrtsoftplus", "softmax", "sigmoid"), "score_func",
             "expected 'sqrtsoftplus', 'softmax' or 'sigmoid'")
        need(self.n_activated_experts <= self.n_routed_experts, "n_activated_experts",
             f"cannot exceed n_routed_experts={self.n_routed_experts}")
        need(self.n_hash_layers <= self.n_layers, "n_hash_layers", f"cannot exceed n_layers={self.n_layers}")
        need(len(self.compress_ratios) == self.n_layers + self.n_mtp_layers, "compress_ratios",
             f"needs n_layers + n_mtp_layers = {self.n_layers + self.n_mtp_layers} entries, "
             f"got {len(self.compress_ratios)}")
        need(all(r == 0 or 2 <= r <= MAX_COMPRESS_RATIO for r in self.compress_ratios), "compress_ratios",
             f"entries must be 0 (SWA) or a ratio in [2, {MAX_COMPRESS_RATIO}]")
        for name in ("max_seq_len", "window_size", "original_seq_len"):
            need(getattr(self, name) <= self.max_position_embeddings, name,
                 f"cannot exceed max_position_embeddings={self.max_position_embeddings:,} (the model's positions)")
        for name in ("bos_token_id", "eos_token_id"):
            need(0 <= getattr(self, name) < self.vocab_size, name, f"must be a token id in [0, {self.vocab_size})")
        need(self.beta_slow < self.beta_fast, "beta_fast", f"must exceed beta_slow={self.beta_slow} (YaRN's ramp)")
        need(self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim, "rope_head_dim",
             f"must be even and <= head_dim={self.head_dim}")
        need(self.rope_head_dim <= self.index_head_dim, "rope_head_dim",
             f"must be <= index_head_dim={self.index_head_dim} (the indexer rotates its last rope dims too)")
        need((self.head_dim - self.rope_head_dim) % 64 == 0, "head_dim",
             f"head_dim - rope_head_dim = {self.head_dim - self.rope_head_dim} must be a multiple of 64 "
             "(the KV FP8 simulation quantizes the non-rope dims in blocks of 64)")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0, "index_head_dim",
             "must be a power of two (Hadamard transform)")
        need(self.index_head_dim % 32 == 0, "index_head_dim", "must be a multiple of 32 (FP4 simulation)")
        need(self.n_heads % self.o_groups == 0, "o_groups", f"must divide n_heads={self.n_heads}")
        need(self.dim % self.fp4_block_size == 0, "dim", f"must be a multiple of fp4_block_size={self.fp4_block_size}")
        need(self.moe_inter_dim % self.fp4_block_size == 0, "moe_inter_dim",
             f"must be a multiple of fp4_block_size={self.fp4_block_size}")
        need(self.dtype in ("fp8", "bf16"), "dtype", "expected 'fp8' or 'bf16'")
        need(self.expert_dtype in ("fp4", "fp8"), "expert_dtype", "expected 'fp4' or 'fp8'")
        need(self.scale_fmt == "ue8m0", "scale_fmt", "only 'ue8m0' (power-of-two E8M0 scales) is supported")

    def cache_bytes(self, max_batch: int, act_bytes: int = 2, acc_bytes: int = 4) -> int:
        """Bytes the caches of ``max_batch`` sequences (plus the spare slot the decode graphs pad into) take at
        ``max_seq_len`` positions: per block the window ring, the compressed and indexer caches, the compressors'
        pooling rings and the RoPE tables (``act_bytes``: the compute dtype's size; ``acc_bytes``: fp32's)."""
        slots, s, d = max_batch + 1, self.max_seq_len, self.head_dim
        total = 0
        for block in range(self.n_blocks):
            r = self.compress_ratios[block]
            total += s * self.rope_head_dim * acc_bytes + slots * self.window_size * d * act_bytes
            if r:
                width = (2 if r == 4 else 1) * d
                total += slots * (s // r) * d * act_bytes + 2 * slots * 2 * r * width * acc_bytes
            if r == 4:
                ic = self.index_head_dim
                total += slots * (s // 4) * ic * act_bytes + 2 * slots * 8 * 2 * ic * acc_bytes
        return total

    # ------------------------------------------------------------------ derived constants (spec §1.2)
    @property
    def nope_head_dim(self) -> int:
        """Non-rotary dims of a head (448 for Flash)."""
        return self.head_dim - self.rope_head_dim

    @property
    def hc_dim(self) -> int:
        """Flattened width of the mHC streams (hc_mult · dim)."""
        return self.hc_mult * self.dim

    @property
    def mix_hc(self) -> int:
        """Rows of an mHC ``fn`` matrix: pre (n) + post (n) + comb (n·n)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def index_scale(self) -> float:
        """Scale applied to the indexer head weights (index_head_dim^-0.5 · index_n_heads^-0.5)."""
        return self.index_head_dim ** -0.5 * self.index_n_heads ** -0.5

    @property
    def wo_a_in_per_group(self) -> int:
        return self.n_heads * self.head_dim // self.o_groups

    @property
    def n_blocks(self) -> int:
        """Main layers plus MTP blocks."""
        return self.n_layers + self.n_mtp_layers

    # ------------------------------------------------------------------ per-layer schedule (spec §4)
    def layer_kind(self, layer: int) -> LayerKind:
        r = self.compress_ratios[layer]
        return "swa" if r == 0 else ("csa" if r == 4 else "hca")

    def has_indexer(self, layer: int) -> bool:
        return self.compress_ratios[layer] == 4

    def has_compressor(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0

    def is_hash_layer(self, layer: int) -> bool:
        """Hash routing applies to main layers only (MTP blocks route by bias)."""
        return layer < self.n_hash_layers and layer < self.n_layers

    def rope_params(self, layer: int) -> tuple[float, bool]:
        """(theta, uses_yarn) for every rotary use inside ``layer``."""
        if self.compress_ratios[layer] == 0:
            return self.rope_theta, False
        return self.compress_rope_theta, True

    def layer_table(self) -> list[dict[str, Any]]:
        rows = []
        for layer in range(self.n_blocks):
            theta, yarn = self.rope_params(layer)
            rows.append(dict(layer=layer, block="mtp.%d" % (layer - self.n_layers) if layer >= self.n_layers
                             else "layers.%d" % layer, ratio=self.compress_ratios[layer],
                             kind=self.layer_kind(layer), rope_theta=theta, yarn=yarn,
                             indexer=self.has_indexer(layer),
                             routing="hash" if self.is_hash_layer(layer) else "bias top-%d" % self.n_activated_experts))
        return rows

    def replace(self, **changes: Any) -> "ModelArgs":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json mapping
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json", **overrides: Any) -> "ModelArgs":
        """Build from an HF ``config.json`` dict; every missing or wrong key is named with ``source``."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(cfg).__name__}")

        def get(key: str, default: Any = _REQUIRED) -> Any:
            if key in cfg:
                return cfg[key]
            if default is _REQUIRED:
                raise ConfigError(f"{source}: missing key {key!r}")
            return default

        model_type = cfg.get("model_type")
        if model_type is not None and model_type != "deepseek_v4":
            raise ConfigError(f"{source}: model_type is {model_type!r}, expected 'deepseek_v4'")
        rope_scaling = get("rope_scaling", None) or {}
        if rope_scaling and rope_scaling.get("type", rope_scaling.get("rope_type")) not in ("yarn", None):
            raise ConfigError(f"{source}: rope_scaling.type {rope_scaling.get('type')!r} is not 'yarn'")
        qc = get("quantization_config", None) or {}
        block = tuple(qc.get("weight_block_size", (128, 128)))
        kwargs = dict(
            vocab_size=get("vocab_size"), dim=get("hidden_size"), moe_inter_dim=get("moe_intermediate_size"),
            n_layers=get("num_hidden_layers"), n_mtp_layers=get("num_nextn_predict_layers", 0),
            n_hash_layers=get("num_hash_layers", 0), n_heads=get("num_attention_heads"),
            n_routed_experts=get("n_routed_experts"), n_shared_experts=get("n_shared_experts", 1),
            n_activated_experts=get("num_experts_per_tok"), score_func=get("scoring_func", "sqrtsoftplus"),
            route_scale=float(get("routed_scaling_factor", 1.0)), swiglu_limit=float(get("swiglu_limit", 0.0)),
            q_lora_rank=get("q_lora_rank"), head_dim=get("head_dim"), rope_head_dim=get("qk_rope_head_dim"),
            o_groups=get("o_groups"), o_lora_rank=get("o_lora_rank"), window_size=get("sliding_window"),
            original_seq_len=int(rope_scaling.get("original_max_position_embeddings", 65536)),
            rope_theta=float(get("rope_theta", 10000.0)), rope_factor=float(rope_scaling.get("factor", 1.0)),
            beta_fast=int(rope_scaling.get("beta_fast", 32)), beta_slow=int(rope_scaling.get("beta_slow", 1)),
            compress_rope_theta=float(get("compress_rope_theta")), compress_ratios=tuple(get("compress_ratios")),
            index_n_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"), index_topk=get("index_topk"),
            hc_mult=get("hc_mult"), hc_sinkhorn_iters=get("hc_sinkhorn_iters"), hc_eps=float(get("hc_eps", 1e-6)),
            norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=get("max_position_embeddings", 1048576),
            max_seq_len=_default_cache_len(get("max_position_embeddings", 1048576)),
            bos_token_id=get("bos_token_id", 0), eos_token_id=get("eos_token_id", 1),
            dtype="fp8" if qc.get("quant_method") == "fp8" else "bf16",
            expert_dtype=get("expert_dtype", "fp4"), scale_fmt=qc.get("scale_fmt", "ue8m0"),
            weight_block_size=block,
        )
        if block != (128, 128):
            raise ConfigError(f"{source}: quantization_config.weight_block_size {list(block)} is not [128, 128]")
        if qc and qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{source}: quantization_config.fmt {qc.get('fmt')!r} is not 'e4m3'")
        if get("num_key_value_heads", 1) != 1:
            raise ConfigError(f"{source}: num_key_value_heads must be 1 (one shared latent K=V head)")
        if get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"{source}: topk_method {cfg['topk_method']!r} is not 'noaux_tc'")
        kwargs.update(overrides)
        try:
            return cls(**kwargs)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        except TypeError as err:  # a wrong JSON type, e.g. a string where a list belongs
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_json(cls, path: str | Path, **overrides: Any) -> "ModelArgs":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: no config.json (is this a checkpoint directory?)")
        cfg = read_json(path, ConfigError)
        try:
            return cls.from_hf_config(cfg, source=str(path), **overrides)
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError) as err:  # a wrong JSON type where a number/list/object belongs
            raise ConfigError(f"{path}: a value has the wrong type ({err})") from None

    def to_hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` of this model (keys in the order the real file uses)."""
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "expert_dtype": self.expert_dtype,
            "hc_eps": self.hc_eps,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.dim,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_topk": self.index_topk,
            "initializer_range": 0.02,
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": "deepseek_v4",
            "moe_intermediate_size": self.moe_inter_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "norm_topk_prob": True,
            "num_attention_heads": self.n_heads,
            "num_experts_per_tok": self.n_activated_experts,
            "num_hidden_layers": self.n_layers,
            "num_hash_layers": self.n_hash_layers,
            "num_key_value_heads": 1,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.rope_head_dim,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": self.scale_fmt, "weight_block_size": list(self.weight_block_size)},
            "rms_norm_eps": self.norm_eps,
            "rope_scaling": {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "factor": self.rope_factor,
                             "original_max_position_embeddings": self.original_seq_len, "type": "yarn"},
            "rope_theta": self.rope_theta,
            "routed_scaling_factor": self.route_scale,
            "scoring_func": self.score_func,
            "sliding_window": self.window_size,
            "swiglu_limit": self.swiglu_limit,
            "tie_word_embeddings": False,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": self.vocab_size,
            "compress_rope_theta": self.compress_rope_theta,
            "compress_ratios": list(self.compress_ratios),
        }

    def summary(self) -> str:
        kinds = [self.layer_kind(i) for i in range(self.n_layers)]
        return (f"dim {self.dim}, {self.n_layers} layers (+{self.n_mtp_layers} MTP): "
                f"SWA {kinds.count('swa')}, CSA {kinds.count('csa')}, HCA {kinds.count('hca')}; "
                f"heads {self.n_heads}×{self.head_dim} (rope {self.rope_head_dim}); "
                f"experts {self.n_routed_experts} routed top-{self.n_activated_experts} + {self.n_shared_experts} shared "
                f"({self.moe_inter_dim} wide, {self.expert_dtype}); hash layers {self.n_hash_layers}; "
                f"window {self.window_size}, index top-k {self.index_topk}; hc_mult {self.hc_mult}; "
                f"vocab {self.vocab_size}")


_REQUIRED = object()


def _default_cache_len(max_position_embeddings: Any) -> Any:
    """The cache length a checkpoint gets when nothing asks for one: 4,096 positions, or the model's declared
    positions when it has fewer (a wrong type passes through for the field check to name)."""
    default = ModelArgs.__dataclass_fields__["max_seq_len"].default
    if isinstance(max_position_embeddings, int) and not isinstance(max_position_embeddings, bool):
        return max(1, min(default, max_position_embeddings))
    return default


def _tiny() -> ModelArgs:
    """The small model shipped in ``data/tiny``: every structural feature of Flash at toy size.

    Layers: 0 SWA (hash-routed), 1 CSA (ratio 4, indexer, hash-routed), 2 HCA (ratio 16), 3 CSA, 4 HCA, 5 CSA,
    plus an SWA MTP block. Window 32, index top-k 16, so a 300-token sequence crosses the window, both ratios
    and the top-k boundary (75 compressed CSA entries > 16). Dense widths are not all multiples of 128, so the
    128×128 FP8 block scales include partial blocks, as a user porting kernels must handle.
    """
    return ModelArgs(
        vocab_size=4096, dim=256, moe_inter_dim=128, n_layers=6, n_mtp_layers=1, n_hash_layers=2, n_heads=8,
        n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, route_scale=1.5, swiglu_limit=10.0,
        q_lora_rank=192, head_dim=96, rope_head_dim=32, o_groups=4, o_lora_rank=64, window_size=32,
        original_seq_len=256, rope_theta=10000.0, rope_factor=4.0, beta_fast=32, beta_slow=1,
        compress_rope_theta=160000.0, compress_ratios=(0, 4, 16, 4, 16, 4, 0), index_n_heads=4, index_head_dim=64,
        index_topk=16, hc_mult=4, hc_sinkhorn_iters=20, max_seq_len=1024, max_position_embeddings=4096,
    )


PRESETS: dict[str, Any] = {
    "flash": ModelArgs,  # the defaults are DeepSeek-V4-Flash, exactly
    "tiny": _tiny,
}


def get_preset(name: str, **overrides: Any) -> ModelArgs:
    """Return the named preset (``flash`` = DeepSeek-V4-Flash exactly, ``tiny`` = the ``data/tiny`` model)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    args = PRESETS[name]()
    return args.replace(**overrides) if overrides else args


def resolve_args(preset: str | None = None, config: str | Path | None = None) -> ModelArgs:
    """One entry point for the CLI: ``--preset NAME`` or ``--config FILE`` (a config.json or checkpoint dir)."""
    if (preset is None) == (config is None):
        raise ConfigError("give exactly one of a preset name or a config file")
    return get_preset(preset) if preset is not None else ModelArgs.from_json(config)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelArgs", "ConfigError", "PRESETS", "get_preset", "resolve_args", "ceil_div", "LayerKind"]
