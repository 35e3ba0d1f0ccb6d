"""Per-op bytes and FLOPs of a DeepSeek-V4 decode step or prefill, per rank under TP/EP, for any ModelArgs.

Weights come from the checkpoint's own tensor table (:func:`dsv4lab.core.checkpoint.expected_tensors`), so the byte
model cannot drift from the checkpoint: every tensor is mapped to the op (kernel) that reads it and to its
spec §5.1 component. Where §5.1 reads differently from "the whole checkpoint" it is followed: routed experts are
read for the selected experts only, the embedding for the looked-up rows only, ``tid2eid`` for one row per
token (counted as a lookup, not as weights), MTP blocks not at all, and ``wo_a`` stays FP8.

A *decode step* generates one token for each of ``batch`` sequences that already hold ``context`` tokens; a
*prefill* runs ``tokens`` prompt tokens per sequence through the model in ``ceil(tokens / chunk)`` passes. Each
op is one kernel launch per layer it appears in (the table of ops is the kernel inventory the step-time model
charges launch overhead for; see ``docs/perf.md``).

Sharding policies (``sharding=``) say which weights every rank reads in full:

* ``ideal`` — the bandwidth bound: every weight matrix is divided over the TP ranks except the ones that act on
  the full residual stream to make small routing/mixing decisions (router gate, mHC) and the norm vectors.
  Splitting ``wq_a``/``wkv``/the compressors/the indexer heads costs extra collectives, which are listed.
* ``sglang`` — the layout of the paper's SGLang fork: ``wq_a``, ``wkv``, the compressors and the whole indexer
  replicated (``ReplicatedLinear``); ``wq_b``/``wo_a`` column-, ``wo_b`` row-parallel; experts and head split.
  Two all-reduces per layer plus one for the vocab-parallel embedding and one logits gather.
* ``reference`` — DeepSeek's ``convert.py`` sharding (spec §2.4): additionally replicates the shared expert and
  splits the indexer heads (its score sum needs one more all-reduce per CSA layer).

Routed experts: under ``ep`` expert-parallel groups (``tp % ep == 0``) each expert lives in one group and its
intermediate dimension is split over the group's ``tp // ep`` ranks; the busiest rank sets the pace, so the
per-rank routed bytes carry the expected max/mean load of the groups (exact for batch 1, sampled otherwise).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from dsv4lab.core.config import ConfigError, ModelArgs

# §5.1 components, in the spec's order
COMPONENTS = ("routed_experts", "shared_expert", "attention", "compressor", "indexer", "indexer_compressor",
              "router", "mhc", "norms", "embedding", "final", "lm_head")
SHARDINGS = ("ideal", "sglang", "reference")
KV_FORMATS = ("fp8", "bf16")

_FORMAT_OF_DTYPE = {"I8": "fp4", "F8_E4M3": "fp8", "BF16": "bf16", "F32": "f32", "I64": "i64", "F8_E8M0": "e8m0"}
_ACT_BYTES = 2  # activations cross kernel boundaries in bf16


# ============================================================================================ tensor -> op
_LAYER_OPS: list[tuple[str, str]] = [
    (r"hc_attn_(fn|base|scale)$", "mhc.attn.pre"),
    (r"hc_ffn_(fn|base|scale)$", "mhc.ffn.pre"),
    (r"attn_norm\.weight$", "attn_norm"),
    (r"ffn_norm\.weight$", "ffn_norm"),
    (r"attn\.attn_sink$", "attn.core"),
    (r"attn\.wq_a\.(weight|scale)$", "attn.wq_a"),
    (r"attn\.q_norm\.weight$", "attn.q_norm"),
    (r"attn\.wq_b\.(weight|scale)$", "attn.wq_b"),
    (r"attn\.wkv\.(weight|scale)$", "attn.wkv"),
    (r"attn\.kv_norm\.weight$", "attn.kv_store"),
    (r"attn\.wo_a\.(weight|scale)$", "attn.wo_a"),
    (r"attn\.wo_b\.(weight|scale)$", "attn.wo_b"),
    (r"attn\.compressor\.(wkv|wgate)\.weight$", "compressor.proj"),
    (r"attn\.compressor\.(ape|norm\.weight)$", "compressor.pool"),
    (r"attn\.indexer\.wq_b\.(weight|scale)$", "indexer.wq_b"),
    (r"attn\.indexer\.weights_proj\.weight$", "indexer.weights_proj"),
    (r"attn\.indexer\.compressor\.(wkv|wgate)\.weight$", "indexer.compressor.proj"),
    (r"attn\.indexer\.compressor\.(ape|norm\.weight)$", "indexer.compressor.pool"),
    (r"ffn\.gate\.(weight|bias)$", "router.gate"),
    (r"ffn\.gate\.tid2eid$", "router.topk"),
    (r"ffn\.shared_experts\.(\d+\.)?w[13]\.(weight|scale)$", "shared.w13"),
    (r"ffn\.shared_experts\.(\d+\.)?w2\.(weight|scale)$", "shared.w2"),
    (r"ffn\.experts\.\d+\.w[13]\.(weight|scale)$", "routed.w13"),
    (r"ffn\.experts\.\d+\.w2\.(weight|scale)$", "routed.w2"),
]
_LAYER_PATTERNS = [(re.compile(p), op) for p, op in _LAYER_OPS]
_GLOBAL_OPS = {"embed.weight": "embed", "head.weight": "head", "norm.weight": "final.norm",
               "hc_head_fn": "final.hc_head", "hc_head_base": "final.hc_head", "hc_head_scale": "final.hc_head"}


_LAYER_PREFIX = re.compile(r"layers\.\d+\.")
_EXPERT_INDEX = re.compile(r"experts\.\d+\.")


def op_of_tensor(name: str) -> str | None:
    """The op (kernel) that reads checkpoint tensor ``name``; None for MTP tensors (not read in native decode)."""
    if name.startswith("mtp."):
        return None
    if name in _GLOBAL_OPS:
        return _GLOBAL_OPS[name]
    m = _LAYER_PREFIX.match(name)
    if m is None:
        raise ConfigError(f"tensor {name!r}: not a layer, MTP or global tensor of the native format")
    op = _op_of_layer_suffix(_EXPERT_INDEX.sub("experts.0.", name[m.end():]))
    if op is None:
        raise ConfigError(f"tensor {name!r}: no op reads it (update dsv4lab/tools/perf/costmodel.py _LAYER_OPS)")
    return op


@functools.lru_cache(maxsize=None)
def _op_of_layer_suffix(rest: str) -> str | None:
    for pattern, op in _LAYER_PATTERNS:
        if pattern.search(rest):
            return op
    return None


# ============================================================================================ small helpers
def expected_distinct_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected number of distinct experts chosen by ``tokens`` tokens picking ``k`` each, uniformly."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


@functools.lru_cache(maxsize=256)
def ep_load_imbalance(n_experts: int, k: int, tokens: int, ep: int, samples: int = 2000) -> float:
    """Expected (max over EP groups) / (mean over groups) of the distinct experts a step reads.

    Batch 1 is exact (multivariate hypergeometric over the ``ep`` equal expert groups); larger batches are
    sampled with a fixed seed (uniform independent routing)."""
    if ep <= 1:
        return 1.0
    if n_experts % ep:
        raise ConfigError(f"ep={ep} must divide n_routed_experts={n_experts}")
    per_group = n_experts // ep
    if expected_distinct_experts(n_experts, k, tokens) > n_experts - 0.5:
        return 1.0  # (almost) every expert is read: the groups are equally loaded
    samples = max(200, min(samples, 200_000 // tokens))
    if tokens == 1:
        total = math.comb(n_experts, k)
        expect_max = 0.0

        def compositions(remaining: int, groups: int):
            if groups == 1:
                yield (remaining,)
                return
            for first in range(min(remaining, per_group) + 1):
                for rest in compositions(remaining - first, groups - 1):
                    yield (first,) + rest

        for comp in compositions(k, ep):
            if any(c > per_group for c in comp):
                continue
            ways = 1
            for c in comp:
                ways *= math.comb(per_group, c)
            expect_max += max(comp) * ways / total
        return expect_max / (k / ep)
    import numpy as np
    rng = np.random.default_rng(0)
    maxima = np.empty(samples)
    means = np.empty(samples)
    for i in range(samples):
        chosen = np.argpartition(rng.random((tokens, n_experts)), k, axis=1)[:, :k]
        used = np.zeros(n_experts, dtype=bool)
        used[chosen.ravel()] = True
        per = used.reshape(ep, per_group).sum(axis=1)
        maxima[i], means[i] = per.max(), per.mean()
    return float(maxima.mean() / means.mean())


def kv_row_bytes(args: ModelArgs, kv_format: str) -> int:
    """Bytes of one cached main-attention KV row (window or compressed entry)."""
    if kv_format == "bf16":
        return args.head_dim * 2
    if kv_format == "fp8":
        # fp8_ds_mla layout: e4m3 non-rope dims + one ue8m0 scale per 64 dims, padded to 8 B, + bf16 rope dims
        quant = args.nope_head_dim + args.nope_head_dim // 64
        return -(-quant // 8) * 8 + args.rope_head_dim * 2
    raise ConfigError(f"kv_format {kv_format!r}: expected one of {KV_FORMATS}")


def index_key_bytes(args: ModelArgs, kv_format: str) -> int:
    """Bytes of one cached lightning-indexer key: bf16 (reference) or FP4 + E8M0 per 32 (production)."""
    if kv_format == "bf16":
        return args.index_head_dim * 2
    if kv_format == "fp8":
        return args.index_head_dim // 2 + args.index_head_dim // 32
    raise ConfigError(f"kv_format {kv_format!r}: expected one of {KV_FORMATS}")


def attention_rows(args: ModelArgs, layer: int, context: int) -> int:
    """Main-cache rows one decode query of ``layer`` reads at ``context`` cached tokens (spec §5.3)."""
    window = min(context, args.window_size)
    ratio = args.compress_ratios[layer]
    if ratio == 0:
        return window
    if args.has_indexer(layer):
        return window + min(args.index_topk, context // ratio)
    return window + context // ratio


def index_keys(args: ModelArgs, layer: int, context: int) -> int:
    """Indexer keys a decode query of ``layer`` scans (all completed compressed entries; 0 off CSA layers)."""
    return context // args.compress_ratios[layer] if args.has_indexer(layer) else 0


def kv_read_bytes(args: ModelArgs, context: int, kv_format: str = "fp8") -> dict[str, int]:
    """KV-cache bytes one decode token reads at ``context``, summed over the main layers (spec §5.3).

    Returns ``rows`` (window + compressed entries), ``index_keys`` (indexer scan) and ``total``."""
    if context < 0:
        raise ConfigError(f"context {context}: must be >= 0")
    rb, kb = kv_row_bytes(args, kv_format), index_key_bytes(args, kv_format)
    rows = sum(attention_rows(args, layer, context) for layer in range(args.n_layers)) * rb
    keys = sum(index_keys(args, layer, context) for layer in range(args.n_layers)) * kb
    return dict(rows=rows, index_keys=keys, total=rows + keys)


@functools.lru_cache(maxsize=16)
def _tensor_table(args: ModelArgs) -> tuple:
    from dsv4lab.core.checkpoint import expected_tensors  # imports torch: only when a cost is asked for
    return tuple(expected_tensors(args))


def _logical_values(spec) -> int:
    """Weight values a tensor holds (packed FP4 bytes hold two); scales count as zero (no multiply-adds)."""
    if spec.name.endswith(".scale") or spec.dtype in ("F8_E8M0", "I64"):
        return 0
    n = spec.numel
    return 2 * n if spec.dtype == "I8" else n


# ============================================================================================ weights per token
@dataclass(frozen=True)
class _OpWeights:
    """The checkpoint tensors one op reads, summed (all experts, whole embedding table)."""

    nbytes: float
    values: float          # logical weight values (scales excluded)
    mm_values: float       # values of 2-D weight matrices (the multiply-adds)
    formats: tuple         # ((format, values), ...)
    components: tuple      # ((component, bytes), ...)
    layers: frozenset


@functools.lru_cache(maxsize=16)
def _op_weights(args: ModelArgs) -> dict[str, _OpWeights]:
    """Group the checkpoint table by op once per model (the table of Flash has 69,187 tensors)."""
    acc: dict[str, dict[str, Any]] = {}
    for spec in _tensor_table(args):
        op = op_of_tensor(spec.name)
        if op is None:
            continue
        a = acc.setdefault(op, dict(nbytes=0.0, values=0.0, mm=0.0, formats={}, components={}, layers=set()))
        if spec.block is not None and spec.block < args.n_layers:
            a["layers"].add(spec.block)
        if op == "router.topk":  # tid2eid: one row per token is a lookup, not a weight stream
            continue
        values = _logical_values(spec)
        a["nbytes"] += spec.nbytes
        a["values"] += values
        a["components"][spec.component] = a["components"].get(spec.component, 0.0) + spec.nbytes
        if values:
            fmt = "fp4" if (spec.dtype == "I8" and op.startswith("routed.")) else _FORMAT_OF_DTYPE[spec.dtype]
            a["formats"][fmt] = a["formats"].get(fmt, 0) + values
            if len(spec.shape) == 2:
                a["mm"] += values
    return {op: _OpWeights(a["nbytes"], a["values"], a["mm"], tuple(a["formats"].items()),
                           tuple(a["components"].items()), frozenset(a["layers"])) for op, a in acc.items()}


def weight_bytes_per_token(args: ModelArgs, batch: int = 1) -> dict[str, float]:
    """Weight bytes read per generated token, by §5.1 component (batch 1 reproduces spec §5.1 exactly).

    With ``batch`` > 1 the dense weights are shared by the batch and the routed experts read are the expected
    distinct experts of the batch; the result is per token (step bytes / batch)."""
    if batch < 1:
        raise ConfigError(f"batch {batch}: must be >= 1")
    frac = expected_distinct_experts(args.n_routed_experts, args.n_activated_experts, batch) / args.n_routed_experts
    out = {c: 0.0 for c in COMPONENTS}
    for op, w in _op_weights(args).items():
        if op == "embed":
            out["embedding"] += batch * args.dim * 2
            continue
        scale = frac if op.startswith("routed.") else 1.0
        for comp, nbytes in w.components:
            out[comp] += nbytes * scale
    return {c: v / batch for c, v in out.items()}


# ============================================================================================ ops
@dataclass
class Op:
    """One kernel (or collective) of a step, summed over the layers it appears in.

    Byte and FLOP fields ending in ``_rank`` are for the busiest rank; ``weight_bytes`` and ``flops`` are the
    whole model's (all ranks together, each weight counted once)."""

    name: str
    component: str
    kind: str                    # matmul | attention | indexer | vector | lookup | collective
    launches: float              # kernel launches (or collectives) per step
    weight_bytes: float = 0.0
    weight_bytes_rank: float = 0.0
    other_bytes_rank: float = 0.0  # activations, KV cache, compressor state, lookups
    flops: float = 0.0
    flops_rank: float = 0.0
    weight_format: str | None = None
    m: float = 1.0                # rows of the activation a matmul multiplies (low-M utilization)
    weight_values_rank: float = 0.0
    replicated: bool = False
    message_bytes: float = 0.0    # collectives: payload per call
    components: dict[str, float] = field(default_factory=dict)  # weight_bytes by §5.1 component
    latency_bound: bool = False   # decode: a chain of dependent steps, not a stream of bytes (see LATENCY_BOUND_OPS)
    note: str = ""

    @property
    def bytes_rank(self) -> float:
        return self.weight_bytes_rank + self.other_bytes_rank

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte moved by the busiest rank."""
        return self.flops_rank / self.bytes_rank if self.bytes_rank else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes_rank"] = self.bytes_rank
        d["intensity"] = self.intensity
        return d


@dataclass
class StepCost:
    """The ops of one decode step or one prefill, with the parallel layout they were costed for."""

    phase: str
    args: ModelArgs = field(repr=False)
    tp: int
    ep: int
    batch: int
    context: int
    kv_format: str
    sharding: str
    tokens: int                  # tokens a step produces (decode) or consumes (prefill)
    chunks: int
    ops: list[Op]

    @property
    def compute_ops(self) -> list[Op]:
        return [o for o in self.ops if o.kind != "collective"]

    @property
    def collectives(self) -> list[Op]:
        return [o for o in self.ops if o.kind == "collective"]

    def total(self, attr: str, ops: Iterable[Op] | None = None) -> float:
        return float(sum(getattr(o, attr) for o in (self.compute_ops if ops is None else ops)))

    @property
    def weight_bytes(self) -> float:
        return self.total("weight_bytes")

    @property
    def weight_bytes_rank(self) -> float:
        return self.total("weight_bytes_rank")

    @property
    def bytes_rank(self) -> float:
        return self.total("bytes_rank")

    @property
    def flops_rank(self) -> float:
        return self.total("flops_rank")

    @property
    def launches(self) -> float:
        return self.total("launches")

    def by_component(self, attr: str = "weight_bytes") -> dict[str, float]:
        """``attr`` summed by §5.1 component (weight bytes follow each tensor's own component)."""
        out: dict[str, float] = {}
        for o in self.compute_ops:
            if attr == "weight_bytes" and o.components:
                for comp, b in o.components.items():
                    out[comp] = out.get(comp, 0.0) + b
            else:
                out[o.component] = out.get(o.component, 0.0) + getattr(o, attr)
        return out

    def op(self, name: str) -> Op:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(f"no op {name!r} in this step; ops: {', '.join(o.name for o in self.ops)}")

    def summary(self) -> dict[str, Any]:
        per_token = self.tokens
        kv = sum(o.other_bytes_rank for o in self.compute_ops if o.kind in ("attention", "indexer"))
        return dict(
            phase=self.phase, tp=self.tp, ep=self.ep, batch=self.batch, context=self.context,
            kv_format=self.kv_format, sharding=self.sharding, tokens_per_step=self.tokens, chunks=self.chunks,
            weight_bytes_per_step=self.weight_bytes, weight_bytes_per_step_per_rank=self.weight_bytes_rank,
            bytes_per_step_per_rank=self.bytes_rank, kv_bytes_per_step_per_rank=kv,
            flops_per_step=self.total("flops"), flops_per_step_per_rank=self.flops_rank,
            flops_per_token=self.total("flops") / per_token, kernel_launches=self.launches,
            collectives=self.total("launches", self.collectives),
        )


def _check_parallel(args: ModelArgs, tp: int, ep: int, sharding: str) -> None:
    if tp < 1 or ep < 1:
        raise ConfigError(f"tp={tp}, ep={ep}: both must be >= 1")
    if tp % ep:
        raise ConfigError(f"ep={ep} must divide tp={tp} (expert groups live inside the TP group)")
    if args.n_routed_experts % ep:
        raise ConfigError(f"ep={ep} must divide n_routed_experts={args.n_routed_experts}")
    if args.n_heads % tp:
        raise ConfigError(f"tp={tp} must divide n_heads={args.n_heads}")
    if sharding not in SHARDINGS:
        raise ConfigError(f"sharding {sharding!r}: expected one of {SHARDINGS}")


_ALWAYS_REPLICATED = {"mhc.attn.pre", "mhc.attn.post", "mhc.ffn.pre", "mhc.ffn.post", "attn_norm", "ffn_norm",
                      "attn.q_norm", "attn.kv_store", "router.gate", "router.topk", "embed", "final.hc_head",
                      "final.norm", "sample"}
_REPLICATED = {
    "ideal": _ALWAYS_REPLICATED,
    "sglang": _ALWAYS_REPLICATED | {"attn.wq_a", "attn.wkv", "compressor.proj", "compressor.pool", "indexer.wq_b",
                                    "indexer.q_prep", "indexer.weights_proj", "indexer.compressor.proj",
                                    "indexer.compressor.pool", "indexer.score", "indexer.topk"},
    "reference": _ALWAYS_REPLICATED | {"attn.wq_a", "attn.wkv", "compressor.proj", "compressor.pool",
                                       "indexer.compressor.proj", "indexer.compressor.pool", "indexer.topk",
                                       "shared.w13", "shared.act", "shared.w2"},
}
# Decode kernels whose batch-1 work is a chain of dependent steps — softmax over attended rows, Sinkhorn
# iterations, top-k selection, softmax pooling over a few slots — so a handful of work-groups run them and their
# time is set by latency, not by bytes (the paper calls its attention kernel "launch-bound").
LATENCY_BOUND_OPS = frozenset({"attn.core", "mhc.attn.pre", "mhc.ffn.pre", "router.topk", "compressor.pool",
                               "indexer.compressor.pool", "indexer.score", "indexer.topk"})
# ops whose bytes every rank reads in full whatever the weight layout (MQA: one shared latent KV for all heads)
_KV_REPLICATED = {"attn.core", "indexer.score", "indexer.topk"}


def _kind(op: str) -> str:
    if op in ("attn.core",):
        return "attention"
    if op in ("indexer.score",):
        return "indexer"
    if op == "embed":
        return "lookup"
    if op in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "compressor.proj", "indexer.wq_b",
              "indexer.weights_proj", "indexer.compressor.proj", "router.gate", "shared.w13", "shared.w2",
              "routed.w13", "routed.w2", "head"):
        return "matmul"
    return "vector"


def _build(args: ModelArgs, *, phase: str, tp: int, ep: int, batch: int, context: int, tokens: int,
           chunk: int | None, kv_format: str, sharding: str) -> StepCost:
    _check_parallel(args, tp, ep, sharding)
    if batch < 1:
        raise ConfigError(f"batch {batch}: must be >= 1")
    kv_row_bytes(args, kv_format)  # validates kv_format
    L, D, k, E = args.n_layers, args.dim, args.n_activated_experts, args.n_routed_experts
    decode = phase == "decode"
    m = batch if decode else batch * tokens          # activation rows per pass (all chunks together for prefill)
    chunks = 1 if decode else max(1, -(-tokens // (chunk or tokens)))
    rows_per_pass = batch if decode else batch * min(tokens, chunk or tokens)
    replicated = _REPLICATED[sharding]

    # ---------------------------------------------------------------- weights from the checkpoint table
    distinct = expected_distinct_experts(E, k, rows_per_pass)  # per pass (a chunk of a prefill)
    frac = distinct / E
    acc: dict[str, dict[str, Any]] = {}
    layers_of: dict[str, frozenset] = {}
    for op, w in _op_weights(args).items():
        layers_of[op] = w.layers
        if op == "embed":  # the looked-up rows only
            nbytes, scale = rows_per_pass * D * 2, 0.0
            comps = {"embedding": nbytes * chunks}
        else:
            scale = frac if op.startswith("routed.") else 1.0
            nbytes = w.nbytes * scale
            comps = {c: b * scale * chunks for c, b in w.components}
        acc[op] = dict(weight_bytes=nbytes * chunks,  # every pass streams the weights again
                       values=w.values * scale, mm_values=w.mm_values * scale,
                       formats=dict(w.formats), components=comps)

    ops: dict[str, Op] = {}

    def add(name: str, *, launches: float, component: str | None = None, kind: str | None = None,
            other_bytes: float = 0.0, flops: float = 0.0, m_rows: float | None = None, note: str = "",
            split_flops: bool = True) -> Op:
        a = acc.get(name, dict(weight_bytes=0.0, values=0.0, formats={}, components={}, mm_values=0.0))
        comp = component or (max(a["components"], key=a["components"].get) if a["components"] else "norms")
        rep = name in replicated
        o = Op(name=name, component=comp, kind=kind or _kind(name), launches=launches * chunks,
               weight_bytes=a["weight_bytes"],
               weight_format=max(a["formats"], key=a["formats"].get) if a["formats"] else None,
               m=m_rows if m_rows is not None else rows_per_pass, replicated=rep, note=note,
               components=dict(a["components"]), latency_bound=decode and name in LATENCY_BOUND_OPS)
        if name.startswith("routed."):
            imbalance = ep_load_imbalance(E, k, rows_per_pass, ep)
            o.weight_bytes_rank = a["weight_bytes"] / tp * imbalance
            o.weight_values_rank = a["values"] * chunks / tp * imbalance
            o.note = note or (f"expected max/mean EP-group load {imbalance:.3f}" if ep > 1 else "")
        elif rep:
            o.weight_bytes_rank, o.weight_values_rank = a["weight_bytes"], a["values"] * chunks
        else:
            o.weight_bytes_rank, o.weight_values_rank = a["weight_bytes"] / tp, a["values"] * chunks / tp
        o.other_bytes_rank = other_bytes
        o.flops = flops
        o.flops_rank = flops if (rep or not split_flops) else flops / tp
        if name.startswith("routed."):
            o.flops_rank = flops / tp * ep_load_imbalance(E, k, rows_per_pass, ep)
        ops[name] = o
        return o

    def n_layers_with(op: str) -> int:
        return len([b for b in layers_of.get(op, ()) if b < L])

    def mm_flops(op: str) -> float:
        """2 x rows x weight values, all passes (routed: each token multiplies only its k experts)."""
        a = acc.get(op)
        if a is None:
            return 0.0
        if op.startswith("routed."):
            return 2.0 * m * k * a["mm_values"] / max(distinct, 1e-12)
        return 2.0 * m * a["mm_values"]

    act = _ACT_BYTES
    heads_local = args.n_heads // tp
    hc, hcd, mix = args.hc_mult, args.hc_dim, args.mix_hc
    n_csa = sum(1 for layer in range(L) if args.has_indexer(layer))
    n_comp = sum(1 for layer in range(L) if args.has_compressor(layer))
    q_dim, kv_dim = args.n_heads * args.head_dim, args.head_dim
    o_dim = args.o_groups * args.o_lora_rank
    inter = args.moe_inter_dim * max(args.n_shared_experts, 1)

    # ---------------------------------------------------------------- mHC + norms
    for site in ("attn", "ffn"):
        add(f"mhc.{site}.pre", launches=L, component="mhc", m_rows=m,
            other_bytes=L * m * (hcd + D) * act,
            flops=L * m * (2.0 * mix * hcd + args.hc_sinkhorn_iters * 4 * hc * hc + 2.0 * hc * D),
            note="mixes (fn GEMV), Sinkhorn, weighted sum of the streams")
        add(f"mhc.{site}.post", launches=L, component="mhc", m_rows=m,
            other_bytes=L * m * (2 * hcd + D) * act, flops=L * m * (2.0 * hc * hc * D + 2.0 * hc * D),
            note="combine the streams and add the block output")
        add(f"{site}_norm", launches=L, component="norms", other_bytes=L * 2 * m * D * act, flops=L * 4.0 * m * D)

    # ---------------------------------------------------------------- attention projections
    add("attn.wq_a", launches=L, other_bytes=L * m * (D + args.q_lora_rank) * act, flops=mm_flops("attn.wq_a"))
    add("attn.q_norm", launches=L, component="norms", other_bytes=L * 2 * m * args.q_lora_rank * act,
        flops=L * 4.0 * m * args.q_lora_rank)
    add("attn.wq_b", launches=L, other_bytes=L * m * (args.q_lora_rank + q_dim / tp) * act,
        flops=mm_flops("attn.wq_b"))
    add("attn.q_rope", launches=L, component="attention", kind="vector", other_bytes=L * 2 * m * q_dim / tp * act,
        flops=L * 6.0 * m * q_dim, note="per-head RMS scaling and RoPE of q")
    add("attn.wkv", launches=L, other_bytes=L * m * (D + kv_dim) * act, flops=mm_flops("attn.wkv"))
    add("attn.kv_store", launches=L, component="norms",
        other_bytes=L * m * (kv_dim * act + kv_row_bytes(args, kv_format)),
        flops=L * 8.0 * m * kv_dim, note="kv RMSNorm, RoPE, FP8 quantization, window-cache write")

    # ---------------------------------------------------------------- compressor / indexer
    row_b, key_b = kv_row_bytes(args, kv_format), index_key_bytes(args, kv_format)
    if n_comp:
        comp_out = sum(2 * (2 if args.has_indexer(layer) else 1) * args.head_dim
                       for layer in range(L) if args.has_compressor(layer)) / max(n_comp, 1)
        add("compressor.proj", launches=n_comp, other_bytes=n_comp * m * (D + comp_out) * act,
            flops=mm_flops("compressor.proj"), note="wkv and wgate as one GEMV")
        state = 0.0
        for layer in range(L):
            r = args.compress_ratios[layer]
            if r:
                coff = 2 if r == 4 else 1
                full = 2 * (coff * r) * (coff * args.head_dim) * 4           # kv + score state, fp32
                slot = 2 * coff * args.head_dim * 4
                state += (m * slot + m / r * (full + row_b)) if decode else (m * slot * 2 + m / r * row_b)
        add("compressor.pool", launches=n_comp, other_bytes=state,
            flops=sum(8.0 * m * 2 * args.head_dim for layer in range(L) if args.has_compressor(layer)),
            note="pooling state update; emits an entry every ratio tokens (norm, RoPE, FP8 store)")
    if n_csa:
        ic, ih = args.index_head_dim, args.index_n_heads
        add("indexer.wq_b", launches=n_csa, other_bytes=n_csa * m * (args.q_lora_rank + ih * ic) * act,
            flops=mm_flops("indexer.wq_b"))
        add("indexer.q_prep", launches=n_csa, component="indexer", kind="vector",
            other_bytes=n_csa * 2 * m * ih * ic * act, flops=n_csa * m * ih * ic * (8.0 + 2 * math.log2(ic)),
            note="RoPE, Hadamard transform, FP4 quantization of the indexer queries")
        add("indexer.weights_proj", launches=n_csa, other_bytes=n_csa * m * (D + ih) * act,
            flops=mm_flops("indexer.weights_proj"))
        add("indexer.compressor.proj", launches=n_csa, other_bytes=n_csa * m * (D + 4 * ic) * act,
            flops=mm_flops("indexer.compressor.proj"))
        add("indexer.compressor.pool", launches=n_csa,
            other_bytes=n_csa * ((m * 2 * 2 * ic * 4 + m / 4 * (2 * 8 * 2 * ic * 4 + key_b)) if decode
                                 else m * 2 * 2 * ic * 4 * 2 + m / 4 * key_b),
            flops=n_csa * 8.0 * m * 2 * ic, note="pooling state of the index keys; Hadamard + FP4 store")
        keys_total = sum(index_keys(args, layer, context) for layer in range(L)) if decode else \
            sum(_prefill_index_keys(args, layer, tokens) for layer in range(L))
        key_reads = batch * (keys_total if decode else sum(
            _prefill_distinct_keys(args, layer, tokens, chunk) for layer in range(L)))
        add("indexer.score", launches=n_csa, other_bytes=key_reads * key_b,
            flops=batch * keys_total * (2.0 * ih * ic + 3.0 * ih), m_rows=ih,
            note="relu(q . k) weighted over the indexer heads, every completed compressed entry")
        add("indexer.topk", launches=n_csa, component="indexer", other_bytes=batch * keys_total * 4,
            flops=batch * keys_total * math.log2(max(args.index_topk, 2)), note="top-k of the scores")

    # ---------------------------------------------------------------- attention core
    if decode:
        rows_total = sum(attention_rows(args, layer, context) for layer in range(L))
        kv_bytes = batch * rows_total * row_b
        attn_flops = batch * rows_total * 4.0 * args.n_heads * args.head_dim
    else:
        rows_total = sum(_prefill_rows(args, layer, tokens) for layer in range(L))
        kv_bytes = batch * row_b * sum(_prefill_distinct_rows(args, layer, tokens, chunk) for layer in range(L))
        attn_flops = batch * rows_total * 4.0 * args.n_heads * args.head_dim
    add("attn.core", launches=L, component="attention", other_bytes=kv_bytes + L * 2 * m * q_dim / tp * act,
        flops=attn_flops, m_rows=heads_local * (1 if decode else min(tokens, chunk or tokens)),
        note="sparse attention with sink over window + selected compressed rows")
    add("attn.inv_rope", launches=L, component="attention", kind="vector",
        other_bytes=L * 2 * m * q_dim / tp * act, flops=L * 4.0 * m * q_dim)
    add("attn.wo_a", launches=L, other_bytes=L * m * (q_dim + o_dim) / tp * act, flops=mm_flops("attn.wo_a"))
    add("attn.wo_b", launches=L, other_bytes=L * m * (o_dim / tp + D) * act, flops=mm_flops("attn.wo_b"))

    # ---------------------------------------------------------------- FFN
    add("router.gate", launches=L, other_bytes=L * m * (D * act + E * 4),
        flops=mm_flops("router.gate") + L * 4.0 * m * E, note="gate logits (fp32) and sqrt(softplus)")
    n_hash = sum(1 for layer in range(L) if args.is_hash_layer(layer))
    add("router.topk", launches=L, component="router", kind="vector",
        other_bytes=m * E * 4 * L + m * k * 8 * n_hash, flops=m * E * math.log2(max(k, 2)) * L,
        note="top-k (biased) or tid2eid row lookup on hash layers; renormalise")
    add("shared.w13", launches=L, other_bytes=L * m * (D + 2 * inter) * act, flops=mm_flops("shared.w13"))
    add("shared.act", launches=L, component="shared_expert", kind="vector",
        other_bytes=m * 3 * inter * act * L, flops=m * 6.0 * inter * L, note="clamped SwiGLU")
    add("shared.w2", launches=L, other_bytes=L * m * (inter + D) * act, flops=mm_flops("shared.w2"))
    ex_rows = m * k / max(distinct * chunks, 1e-12)
    add("routed.w13", launches=L, m_rows=ex_rows, other_bytes=L * m * k * (D + 2 * args.moe_inter_dim / tp) * act,
        flops=mm_flops("routed.w13"), note="gate/up of the selected experts")
    add("routed.act", launches=L, component="routed_experts", kind="vector",
        other_bytes=m * k * 3 * args.moe_inter_dim * act * L / tp, flops=m * k * 6.0 * args.moe_inter_dim * L,
        note="clamped SwiGLU times the routing weight")
    add("routed.w2", launches=L, m_rows=ex_rows, other_bytes=L * m * k * (args.moe_inter_dim / tp + D) * act,
        flops=mm_flops("routed.w2"), note="down projection, top-k combine in fp32")

    # ---------------------------------------------------------------- embedding, final, head
    head_rows = batch  # prefill needs the logits of the last position only
    add("embed", launches=1, component="embedding", other_bytes=m * D * act, m_rows=m)
    last = [add("final.hc_head", launches=1, component="final", other_bytes=head_rows * (hcd + D) * act,
                flops=head_rows * 2.0 * hc * hcd, m_rows=head_rows),
            add("final.norm", launches=1, component="final", other_bytes=2 * head_rows * D * act,
                flops=4.0 * head_rows * D),
            add("head", launches=1, other_bytes=head_rows * (D * act + args.vocab_size * 4 / tp),
                flops=2.0 * head_rows * args.vocab_size * D, m_rows=head_rows),
            add("sample", launches=1, component="lm_head", kind="vector",
                other_bytes=head_rows * args.vocab_size * 4, flops=head_rows * args.vocab_size,
                note="argmax / sampling")]
    for o in last:  # these run once, after the last chunk: undo the per-pass scaling
        o.launches /= chunks
        o.weight_bytes /= chunks
        o.weight_bytes_rank /= chunks
        o.weight_values_rank /= chunks
        o.components = {c: b / chunks for c, b in o.components.items()}

    for name in _KV_REPLICATED:  # MQA: every rank reads the whole shared KV and index keys
        if name in ops and not ops[name].replicated:
            ops[name].note = (ops[name].note + "; " if ops[name].note else "") + "KV read in full on every rank (MQA)"

    # ---------------------------------------------------------------- collectives
    coll: list[Op] = []
    if tp > 1:
        msg = rows_per_pass * D * act

        def collective(name: str, count: float, message: float, note: str) -> None:
            if count > 0:
                coll.append(Op(name=name, component="collective", kind="collective", launches=count * chunks,
                               message_bytes=message, other_bytes_rank=count * chunks * message, note=note))

        collective("allreduce.attn", L, msg, "after wo_b (row-parallel)")
        if ep > 1:
            collective("alltoall.dispatch", L, rows_per_pass * k * D * act / ep, "routed tokens to their expert group")
            collective("alltoall.combine", L, rows_per_pass * k * D * act / ep, "expert outputs back")
            collective("allreduce.ffn", L, msg, "shared expert + in-group partial sums")
        else:
            collective("allreduce.ffn", L, msg, "after the MoE combine (shared + routed partial sums)")
        if sharding == "ideal":
            collective("allgather.q_latent", L, rows_per_pass * args.q_lora_rank * act, "wq_a is split")
            collective("allgather.kv", L, rows_per_pass * kv_dim * act, "wkv is split")
            emitted = (sum(1.0 / args.compress_ratios[x] for x in range(L) if args.has_compressor(x)) if decode
                       else n_comp)  # decode: one gather per emitted entry; prefill: one per layer and chunk
            collective("allgather.compressed", emitted, rows_per_pass * kv_dim * act,
                       "compressor split by channel: gather the emitted entries")
        if sharding in ("ideal", "reference") and n_csa:
            collective("allreduce.index_scores", n_csa, rows_per_pass * 4 * ((context if decode else tokens) // 4),
                       "indexer heads split: sum the scores over heads")
        if sharding in ("sglang", "reference"):
            collective("allreduce.embed", 1, msg, "vocab-parallel embedding")
        collective("allgather.logits", 1, head_rows * args.vocab_size * 4 / tp, "vocab-parallel head")

    return StepCost(phase=phase, args=args, tp=tp, ep=ep, batch=batch, context=context if decode else tokens,
                    kv_format=kv_format, sharding=sharding, tokens=batch if decode else batch * tokens,
                    chunks=chunks, ops=list(ops.values()) + coll)


def _prefill_rows(args: ModelArgs, layer: int, tokens: int) -> int:
    """Σ over prompt positions of the main-cache rows each query attends to."""
    return sum(attention_rows(args, layer, p + 1) for p in range(tokens)) if tokens <= 4096 else \
        _prefill_rows_closed(args, layer, tokens)


def _prefill_rows_closed(args: ModelArgs, layer: int, tokens: int) -> int:
    w, r = args.window_size, args.compress_ratios[layer]
    n = tokens
    window = sum(min(p, w) for p in range(1, min(n, w) + 1)) + max(0, n - w) * w
    if r == 0:
        return window
    if args.has_indexer(layer):
        cap = args.index_topk
        return window + sum(min(cap, p // r) for p in range(1, n + 1))
    return window + sum(p // r for p in range(1, n + 1))


def _prefill_index_keys(args: ModelArgs, layer: int, tokens: int) -> int:
    """Σ over prompt positions of the indexer keys each query scores."""
    if not args.has_indexer(layer):
        return 0
    r = args.compress_ratios[layer]
    return sum((p + 1) // r for p in range(tokens))


def _prefill_distinct_rows(args: ModelArgs, layer: int, tokens: int, chunk: int | None) -> int:
    """Main-cache rows a chunked prefill reads, each distinct row once per chunk (on-chip reuse in a chunk)."""
    chunk = chunk or tokens
    r = args.compress_ratios[layer]
    total = 0
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        total += min(end, (end - start) + args.window_size)
        if r:
            total += end // r
    return total


def _prefill_distinct_keys(args: ModelArgs, layer: int, tokens: int, chunk: int | None) -> int:
    if not args.has_indexer(layer):
        return 0
    chunk = chunk or tokens
    return sum(min(tokens, s + chunk) // args.compress_ratios[layer] for s in range(0, tokens, chunk))


def decode_step(args: ModelArgs, *, tp: int = 1, ep: int = 1, batch: int = 1, context: int = 4096,
                kv_format: str = "fp8", sharding: str = "ideal") -> StepCost:
    """Ops of one decode step: ``batch`` sequences, each with ``context`` cached tokens, produce one token each."""
    if context < 1:
        raise ConfigError(f"context {context}: a decode step needs at least one cached token")
    return _build(args, phase="decode", tp=tp, ep=ep, batch=batch, context=context, tokens=1, chunk=None,
                  kv_format=kv_format, sharding=sharding)


def prefill(args: ModelArgs, *, tokens: int, tp: int = 1, ep: int = 1, batch: int = 1, chunk: int | None = None,
            kv_format: str = "fp8", sharding: str = "ideal") -> StepCost:
    """Ops of a prefill of ``tokens`` prompt tokens per sequence, in chunks of ``chunk`` (one pass if None)."""
    if tokens < 1:
        raise ConfigError(f"tokens {tokens}: a prefill needs at least one token")
    if chunk is not None and chunk < 1:
        raise ConfigError(f"chunk {chunk}: must be >= 1")
    return _build(args, phase="prefill", tp=tp, ep=ep, batch=batch, context=0, tokens=tokens, chunk=chunk,
                  kv_format=kv_format, sharding=sharding)


__all__ = ["COMPONENTS", "SHARDINGS", "KV_FORMATS", "LATENCY_BOUND_OPS", "Op", "StepCost", "decode_step", "prefill",
           "weight_bytes_per_token", "kv_read_bytes", "kv_row_bytes", "index_key_bytes", "attention_rows",
           "index_keys", "expected_distinct_experts", "ep_load_imbalance", "op_of_tensor"]
