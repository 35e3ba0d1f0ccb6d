"""Stage-isolated layer oracle: record the reference at the op boundary, replay every call on a backend.

Every replaceable op goes through ``ops.<op>`` (:class:`dsv4lab.core.model.ops.ReferenceOps`). :class:`OpRecorder` wraps
the reference's ops so that each call — nested calls of composite ops included — is captured with its inputs, its
output and the module it belongs to (``layers.3.attn.wq_a``; ops that take no weight inherit the module of the
call before them). :func:`replay` then feeds each recorded call's **reference inputs** to the backend's op, with the
backend's own modules of the same name (a backend may hold weights in its own layout), and checks the output
against the reference output with the op's error bound (:data:`~dsv4lab.tools.verify.op_bounds.OP_BOUNDS`): a stage's
inputs never carry the drift of the stages before it, so the verdict is about that stage's kernel alone.

Verdict per stage (a layer's calls of one op at one site): **bit-identical**, **within bound**, **defect** (the
worst element, its position, both values and the bound), **no bound defined** (an op without a row in
``OP_BOUNDS`` — a failure, never a pass) or **error** (the backend raised). The state-hygiene op
``reset_compressor_state`` is checked by poisoning a copy of each compressor's state and comparing the reset.

Ops that write state in place (:data:`~dsv4lab.tools.verify.op_outputs.IN_PLACE`: the decode step's ring write and
compressor step) are recorded with the module state they read (a snapshot) and what they wrote; a replay runs the
backend's op on private copies of that state and compares what it writes. Each call is judged under the
accumulation model of the kernel it takes, as the backend reports it (:func:`accumulation_of`).

The recording is a prefill followed by decode steps through the runner's decode paths — the eager forward and the
engine's static decode step (:mod:`dsv4lab.engine.decode_graph`, what the CUDA graphs replay) — so the fused ops
only the static step calls are replayed too. Stage names come from :data:`STAGE_NAMES` (op × module pattern →
name); an op at an unknown site is named ``"<op> (<module>)"``. A fused op a backend adds needs one row in each
table.
"""
from __future__ import annotations

import copy
import fnmatch
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.bounds import DEFAULT_ACCUMULATION, BoundCheck
from dsv4lab.tools.verify.op_bounds import OP_BOUNDS, check_outputs
from dsv4lab.tools.verify.op_outputs import IN_PLACE, private_arguments, snapshot, written

HELPERS = ("elementwise",)  # called by other ops for their transcendental steps: checked as part of those
STATE_OPS = ("reset_compressor_state",)  # state hygiene, checked by check_state_resets()

# (op, module pattern relative to the block, stage name); first match wins
STAGE_NAMES: list[tuple[str, str, str]] = [
    ("hc_pre_norm", "hc_attn_fn", "mHC pre + attn_norm (attention site, fused)"),
    ("hc_pre_norm", "hc_ffn_fn", "mHC pre + ffn_norm (MoE site, fused)"),
    # a sub-layer's hc_post fused with the next sub-layer's pre and norm; in the decode step the last one of a block
    # is fused with the next block's attention site (named at that block)
    ("hc_post_pre_norm", "hc_ffn_fn", "mHC post (attention site) + pre + ffn_norm (fused)"),
    ("hc_post_pre_norm", "hc_attn_fn", "mHC post (previous block's MoE site) + pre + attn_norm (fused)"),
    ("hc_pre", "hc_attn_fn", "mHC pre (attention site)"),
    ("hc_pre", "hc_ffn_fn", "mHC pre (MoE site)"),
    ("hc_post", "hc_ffn_fn", "mHC post (attention site)"),
    ("hc_post", "hc_attn_fn", "mHC post (previous block's MoE site)"),
    ("hc_post", "ffn*", "mHC post (MoE site)"),
    ("hc_head", "*", "mHC head"),
    ("rms_norm", "attn_norm", "attention input (attn_norm)"),
    ("rms_norm", "ffn_norm", "MoE input (ffn_norm)"),
    ("rms_norm", "attn.q_norm", "q norm"),
    ("rms_norm", "attn.kv_norm", "kv norm"),
    ("rms_norm", "attn.compressor.norm", "compressor entries norm"),
    ("rms_norm", "attn.indexer.compressor.norm", "indexer keys norm"),
    ("rms_norm", "norm", "final norm"),
    ("rms_norm", "enorm", "MTP embedding norm"),
    ("rms_norm", "hnorm", "MTP hidden norm"),
    ("linear", "attn.wq_a", "q projection (wq_a)"),
    ("linear", "attn.wq_b", "q projection (wq_b)"),
    ("head_rms_rope", "attn.wq_b", "q per-head RMS + RoPE (fused)"),
    ("head_rms", "attn.wq_b", "q per-head RMS"),
    ("rope", "attn.wq_b", "q after norm + RoPE"),
    ("linear", "attn.wkv", "kv projection (wkv)"),
    # projections of one input in one launch (dsv4lab.engine.decode_groups), named by their first member
    ("linear_group", "attn.wq_a", "q and kv projections (wq_a + wkv, one launch)"),
    ("linear_group", "attn.wq_b", "q and indexer q projections (wq_b + indexer wq_b, one launch)"),
    ("linear_group", "ffn.shared_experts*.w1", "shared expert w1 + w3 (one launch)"),
    ("linear_f32_group", "attn*compressor.wkv", "compressors' kv and gate projections (one launch)"),
    ("kv_norm_rope", "attn.kv_norm", "kv norm + RoPE + FP8 sim, ring write (fused)"),
    ("kv_norm_rope", "attn.compressor.norm", "compressor entries norm + RoPE + FP8 sim (fused)"),
    ("kv_norm_rope", "attn.indexer.compressor.norm", "indexer keys norm + RoPE (fused)"),
    ("rope", "attn.kv_norm", "kv after norm + RoPE"),
    ("linear_f32", "attn.compressor.wkv", "compressor kv projection"),
    ("linear_f32", "attn.compressor.wgate", "compressor gate projection"),
    ("compressor_step", "attn.compressor", "compressor decode step: ring, pooling, entry write (fused)"),
    ("compressor_pool", "attn.compressor*", "compressor pooling"),
    ("compressed_rope_position", "attn.compressor*", "compressor entries RoPE position"),
    ("rope", "attn.compressor*", "compressor entries (norm + RoPE)"),
    ("linear_f32", "attn.indexer.compressor.wkv", "indexer keys projection"),
    ("linear_f32", "attn.indexer.compressor.wgate", "indexer keys gate projection"),
    ("compressor_step", "attn.indexer.compressor", "indexer keys decode step: ring, pooling, entry write (fused)"),
    ("compressor_pool", "attn.indexer.compressor*", "indexer keys pooling"),
    ("compressed_rope_position", "attn.indexer.compressor*", "indexer keys RoPE position"),
    ("rope", "attn.indexer.compressor*", "indexer keys (norm + RoPE)"),
    ("linear", "attn.indexer.wq_b", "indexer q projection"),
    ("indexer_query", "*", "indexer q RoPE + Hadamard + FP4 sim (fused)"),
    ("rope", "attn.indexer.wq_b", "indexer q after RoPE"),
    ("linear", "attn.indexer.weights_proj", "indexer head weights"),
    ("indexer_select", "*", "indexer selection (scores + top-k)"),
    ("indexer_select_decode", "*", "indexer selection from the key cache (decode, fused)"),
    ("indexer_scores", "*", "indexer scores"),
    ("indexer_topk", "*", "indexer top-k"),
    ("sparse_attention", "*", "attention core (sparse attention)"),
    ("attention_from_caches", "*", "attention core (sparse attention)"),
    ("rope", "attn.attn_sink", "attention output (inverse RoPE)"),
    ("grouped_wo_a", "*", "attention output projection (wo_a)"),
    ("linear", "attn.wo_b", "attention output (wo_b)"),
    ("linear_f32", "ffn.gate", "router logits"),
    ("router_topk", "*", "router choice and weights (fused)"),
    ("router_scores", "*", "router scores"),
    ("routed_experts", "*", "routed experts (whole)"),
    ("moe_post_pre_norm", "*", "routed experts + MoE output + next mHC site (fused)"),
    ("attention_norms", "*", "q norm + kv norm, RoPE, FP8 sim, ring write (fused launch)"),
    ("query_heads", "*", "q per-head RMS + RoPE and indexer q RoPE + Hadamard + FP4 sim (fused launch)"),
    ("compressor_pair", "*", "indexer keys and compressed entries: both compressor steps (fused launch)"),
    ("projections", "attn*", "attention input projections: q/KV, compressors, indexer head weights (fused launch)"),
    ("projections", "ffn*", "MoE input projections: router logits, shared expert w1/w3 (fused launch)"),
    ("expert_down", "*", "shared expert: SwiGLU + w2 after its up projections"),
    ("moe_stage1", "*", "MoE stage 1 (w1 gate, w3 up projections)"),
    ("moe_activation", "*", "MoE activation (clamped SwiGLU × routing weight)"),
    ("swiglu", "ffn.experts", "MoE activation (clamped SwiGLU)"),
    ("moe_stage2", "*", "MoE stage 2 (w2 down projection)"),
    ("moe_combine", "*", "MoE combine"),
    ("moe_output", "*", "MoE output (routed + shared experts)"),
    ("expert_mlp", "*", "shared expert (whole)"),
    ("linear", "ffn.shared_experts*.w1", "shared expert w1"),
    ("linear", "ffn.shared_experts*.w3", "shared expert w3"),
    ("swiglu", "ffn.shared_experts*", "shared expert activation"),
    ("linear", "ffn.shared_experts*.w2", "shared expert w2"),
    ("linear_f32", "head", "head (logits)"),
    ("linear", "e_proj", "MTP embedding projection"),
    ("linear", "h_proj", "MTP hidden projection"),
]


def stage_name(op: str, owner: str) -> tuple[str, str]:
    """``(block, stage)`` of a call of ``op`` at module ``owner`` (``"layers.3.attn.wq_a"`` →
    ``("layers.3", "q projection (wq_a)")``)."""
    parts = owner.split(".")
    if parts[0] in ("layers", "mtp") and len(parts) > 1 and parts[1].isdigit():
        block, rel = ".".join(parts[:2]), ".".join(parts[2:])
    else:
        block, rel = "model", owner
    for o, pattern, name in STAGE_NAMES:
        if o == op and fnmatch.fnmatchcase(rel, pattern):
            return block, name
    return block, f"{op} ({rel or 'model'})"


def recorded_ops(ops) -> list[str]:
    """The ops of ``ops`` to record: the public methods of its class hierarchy that belong to the ops interface
    (:class:`ReferenceOps` or :data:`OP_BOUNDS`), except helpers and state hygiene."""
    names = {n for cls in type(ops).__mro__ if issubclass(cls, ReferenceOps)
             for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)}
    # bookkeeping methods some backends have (report, summary, variants) are not ops of the interface
    return sorted(n for n in names if n not in HELPERS + STATE_OPS and (hasattr(ReferenceOps, n) or n in OP_BOUNDS))


@dataclass
class OpCall:
    """One recorded call: ``index`` in call order, ``depth`` 0 for calls the model makes, ``parent`` for calls a
    composite op makes; ``forward`` counts the model's forward calls (0: the prefill, 1: a decode step ...) and
    ``path`` names the decode path of that forward (``prefill``, ``eager`` or ``static``). ``out`` is the tuple of
    outputs of an op that writes in place (:func:`~dsv4lab.tools.verify.op_outputs.written`), whose module state before
    the call is ``state`` (:func:`~dsv4lab.tools.verify.op_outputs.snapshot`)."""

    index: int
    op: str
    owner: str
    block: str
    stage: str
    depth: int
    parent: int | None
    forward: int
    args: tuple
    kwargs: dict
    out: Any = None
    path: str = "prefill"
    state: dict = field(default_factory=dict)


def _module_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for mname, m in model.named_modules():
        names[id(m)] = mname
        for bname, b in m._buffers.items():
            if b is not None:
                names.setdefault(id(b), f"{mname}.{bname}" if mname else bname)
    return names


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, tuple):
        return tuple(_clone(x) for x in v)
    return v


class OpRecorder:
    """Records every op call of ``ops`` (instance attributes wrap the methods; :meth:`remove` restores them).

    Args:
        ops: the reference ops object of a runner.
        model: the runner's model (to name the modules and weights an op receives).
    """

    def __init__(self, ops, model: nn.Module):
        self.ops = ops
        self.calls: list[OpCall] = []
        self.forward_index = 0
        self.path = "prefill"
        self._model = model
        self.refresh_names()
        self._context = "model"
        self._stack: list[int] = []
        self._saved: dict[str, Any] = {}
        for op in recorded_ops(ops):
            self._saved[op] = ops.__dict__.get(op)
            setattr(ops, op, self._wrap(op, getattr(ops, op)))

    def remove(self) -> None:
        for op, prev in self._saved.items():
            if prev is None:
                self.ops.__dict__.pop(op, None)
            else:
                setattr(self.ops, op, prev)
        self._saved = {}

    def refresh_names(self) -> None:
        """Name the model's modules and buffers as they are now. The static decode step regroups projections (new
        buffer views) when it is first built; the named objects are held so that no later tensor can take the
        ``id`` of a freed one and be named after it."""
        self._names = _module_names(self._model)
        self._named = [m for _, m in self._model.named_modules()] + list(self._model.buffers())

    def _owner(self, args, kwargs) -> str | None:
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, tuple) and v and isinstance(v[0], tuple) and len(v[0]) == 2 and isinstance(v[0][0], str):
                v = v[0][1]  # the calls of ``projections``: named by the first call's weights
            if isinstance(v, tuple) and v and isinstance(v[0], nn.Module):
                v = v[0]  # a group of projections is named by its first member
            name = self._names.get(id(v)) if isinstance(v, (nn.Module, torch.Tensor)) else None
            if name is not None:
                return name[: -len(".weight")] if name.endswith(".weight") else name
        return None

    def _wrap(self, op: str, fn: Callable):
        def recorded(*args, **kwargs):
            owner = self._owner(args, kwargs)
            if owner is None:
                owner = self._context
            self._context = owner
            block, stage = stage_name(op, owner)
            call = OpCall(len(self.calls), op, owner, block, stage, len(self._stack),
                          self._stack[-1] if self._stack else None, self.forward_index,
                          tuple(_clone(a) for a in args), {k: _clone(v) for k, v in kwargs.items()}, path=self.path,
                          state=snapshot(op, args, kwargs))
            self.calls.append(call)
            self._stack.append(call.index)
            try:
                out = fn(*args, **kwargs)
            finally:
                self._stack.pop()
                self._context = owner  # the parts of a composite op do not set the context of the calls after it
            call.out = _clone(written(op, args, kwargs, out) if op in IN_PLACE else out)
            return out
        recorded.__name__ = op
        return recorded


DECODE_PATHS = ("eager", "static")
"""The decode paths a recording's decode steps take in turn: the eager forward (the same ops as a prefill, at one
row) and the engine's static decode step (its fused ops: the ring write, the compressor step, the indexer's
selection from the key cache, attention from the caches)."""


def record_reference(runner, input_ids: list[int], decode_steps: int = len(DECODE_PATHS),
                     decode_paths: tuple[str, ...] = DECODE_PATHS) -> list[OpCall]:
    """Run ``input_ids`` through the reference ``runner`` as a prefill of all but the last ``decode_steps``
    tokens followed by that many single-token decode steps, step ``i`` through ``decode_paths[i % len]`` (so
    replay exercises prefill- and decode-sized calls, and the static step's fused ops), recording every op call.
    The runner's decode path is restored afterwards."""
    ids = list(input_ids)
    n_prefill = max(1, len(ids) - decode_steps)
    rec = OpRecorder(runner.ops, runner.model)
    saved = runner.decode_path
    try:
        runner.prefill(ids[:n_prefill], slots=[0], logits="all")
        for i, p in enumerate(range(n_prefill, len(ids))):
            rec.forward_index += 1
            rec.path = runner.decode_path = decode_paths[i % len(decode_paths)]
            rec.refresh_names()
            runner.forward(torch.tensor([ids[p:p + 1]]), p, slots=[0])
    finally:
        runner.decode_path = saved
        rec.remove()
        runner.reset([0])
    return rec.calls


# ============================================================================================ replay
@dataclass
class CallCheck:
    """The replay of one call: a :class:`BoundCheck` per output, or why there is none."""

    call: OpCall
    checks: list[BoundCheck] = field(default_factory=list)
    verdict: str = ""  # bit-identical | within bound | defect | no bound defined | error | bound defect
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict in ("bit-identical", "within bound")

    def worst(self) -> BoundCheck | None:
        return max(self.checks, key=lambda c: (not c.ok, c.max_ratio), default=None)


def _as_tuple(v):
    return v if isinstance(v, tuple) else (v,)


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach(), b.detach().to(a.device)
        if a.is_floating_point():
            return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num()))
        return bool(torch.equal(a, b))
    return a == b


def default_accumulation(device) -> str:
    """fp32 with round-to-nearest on a CPU (Triton's interpreter is numpy), fp32 that may truncate on a GPU."""
    return "fp32" if torch.device(device).type == "cpu" else DEFAULT_ACCUMULATION


def accumulation_of(ops, op: str, args: tuple = (), device="cpu", kwargs: dict | None = None) -> str:
    """The accumulation model under which ``ops.<op>(*args, **kwargs)`` is judged, as the backend states it.

    A backend answers with a method ``accumulation_for(op, *args, **kwargs) -> str`` — the model of the kernel that
    very call takes, from the kernels' own tables (the Triton backend: the decode GEMV route or cuBLAS as its
    measured dispatch picks, the MoE route, the prefill GEMMs, CUDA-core glue), so a route switched by the dispatch
    is judged by its own bound — or an attribute ``accumulation`` (a name, or a dict op → name, ``"*"`` for the
    rest). A backend that states nothing (the reference and its variants) is judged under
    :func:`default_accumulation`. A composite op is judged under the loosest accumulation of its parts.
    """
    fn = getattr(ops, "accumulation_for", None)
    if callable(fn):
        stated = fn(op, *args, **(kwargs or {}))
        if stated is not None:
            return stated
    acc = getattr(ops, "accumulation", None)
    if isinstance(acc, dict) and acc.get(op, acc.get("*")) is not None:
        return acc.get(op, acc.get("*"))
    if isinstance(acc, str):
        return acc
    return default_accumulation(device)


def _substitute(v, objects: dict[str, Any], names: dict[int, str], device):
    if isinstance(v, (nn.Module, torch.Tensor)) and id(v) in names:
        return objects.get(names[id(v)], v)
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, tuple):
        return tuple(_substitute(x, objects, names, device) for x in v)
    return v


def bound_of(call: OpCall, numerics, acc):
    """The expectation(s) of a recorded call's outputs under the accumulation ``acc`` (its op's bound, computed
    from the reference's inputs and, for an op that writes in place, the state the call saw)."""
    args, kwargs = private_arguments(call.op, call.args, call.kwargs, call.state or None)
    return OP_BOUNDS[call.op](numerics, acc, *args, **kwargs)


def output_names(call: OpCall) -> list[str]:
    """One name per output of a recorded call (``"layers.3 q projection (wq_a)"``, ``… #1`` for further ones)."""
    n = len(_as_tuple(call.out))
    return [f"{call.block} {call.stage}" + (f" #{i}" if n > 1 else "") for i in range(n)]


def replay_call(call: OpCall, backend_ops, numerics, reference_names, backend_objects, device) -> CallCheck:
    """Replay one recorded call on ``backend_ops`` and judge its output with the op's bound (an op that writes in
    place runs on private copies of the state the reference call saw and is judged on what it wrote)."""
    res = CallCheck(call)
    fn = getattr(backend_ops, call.op, None)
    if fn is None:
        res.verdict, res.message = "error", f"the backend has no op {call.op}"
        return res
    args = tuple(_substitute(a, backend_objects, reference_names, device) for a in call.args)
    kwargs = {k: _substitute(v, backend_objects, reference_names, device) for k, v in call.kwargs.items()}
    args, kwargs = private_arguments(call.op, args, kwargs, call.state or None)
    try:
        with torch.inference_mode():
            out = fn(*args, **kwargs)
    except Exception as e:  # a crashing kernel is a failed stage, reported with its message
        res.verdict, res.message = "error", f"{type(e).__name__}: {e}"
        return res
    outs = written(call.op, args, kwargs, out) if call.op in IN_PLACE else _as_tuple(out)
    refs = _as_tuple(call.out)
    if len(outs) != len(refs):
        res.verdict, res.message = "defect", f"{len(outs)} outputs, the reference has {len(refs)}"
        return res
    if all(_bitwise_equal(o, r) for o, r in zip(outs, refs)):
        res.verdict = "bit-identical"
        return res
    bound_fn = OP_BOUNDS.get(call.op)
    if bound_fn is None:
        res.verdict, res.message = "no bound defined", f"op {call.op} has no entry in verify.op_bounds.OP_BOUNDS"
        return res
    with torch.inference_mode():
        acc = accumulation_of(backend_ops, call.op, args, device, kwargs)
        expects = bound_of(call, numerics, acc)
    res.checks = check_outputs(outs, refs, expects, output_names(call))
    if any(c.bound_defect for c in res.checks):
        res.verdict = "bound defect"
    else:
        res.verdict = "within bound" if all(c.ok for c in res.checks) else "defect"
    return res


@dataclass
class StageVerdict:
    """All replayed calls of one stage (one op at one site of one block)."""

    block: str
    stage: str
    op: str
    calls: list[CallCheck] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        order = ("error", "no bound defined", "bound defect", "defect", "within bound", "bit-identical")
        return min((c.verdict for c in self.calls), key=order.index)

    @property
    def ok(self) -> bool:
        return self.verdict in ("bit-identical", "within bound")

    def worst(self) -> tuple[CallCheck | None, BoundCheck | None]:
        best = (None, None, (-1, -1.0))
        for c in self.calls:
            w = c.worst()
            key = (0 if c.ok else 1, w.max_ratio if w else (float("inf") if not c.ok else 0.0))
            if key > best[2]:
                best = (c, w, key)
        return best[0], best[1]

    def to_dict(self) -> dict:
        call, chk = self.worst()
        d = dict(block=self.block, stage=self.stage, op=self.op, verdict=self.verdict, ok=self.ok,
                 n_calls=len(self.calls), max_ratio=chk.max_ratio if chk else 0.0)
        if call is not None and not call.ok:
            d["message"] = call.message
        if chk is not None:
            d.update(worst=chk.worst, rule=chk.rule, call=call.call.index, forward=call.call.forward,
                     line=chk.line())
        return d

    def line(self) -> str:
        call, chk = self.worst()
        extra = ""
        if chk is not None and self.verdict != "bit-identical":
            w = chk.worst
            extra = f"max error/bound {chk.max_ratio:.3g}"
            if not self.ok and w and w.get("out") is not None:
                extra += (f"; worst at {w['index']} (call {call.call.index}): out={w['out']:.6g} "
                          f"ref={w['ref']:.6g} bound ±{w['bound']:.3g} [{chk.rule}]")
            elif not self.ok and w:
                extra += f"; {w}"
        if call is not None and call.message:
            extra = (extra + "; " if extra else "") + call.message
        if chk is not None and chk.bound_defect:
            extra += f"; {chk.bound_defect}"
        flag = "ok  " if self.ok else "FAIL"
        return f"{flag} {self.block:<9} {self.stage:<48} {self.verdict}{(' — ' + extra) if extra else ''}"


@dataclass
class StageReport:
    stages: list[StageVerdict]
    first: StageVerdict | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.first is None

    def to_dict(self) -> dict:
        return dict(ok=self.ok, first=self.first.to_dict() if self.first else None, seconds=self.seconds,
                    stages=[s.to_dict() for s in self.stages])


def _first_defect(checks: list[CallCheck]) -> CallCheck | None:
    """The first failing call in call order, descending into the calls a failing composite made (the W2 read of
    a fused MoE is named as "stage 2", not as the whole MoE)."""
    by_parent: dict[int, list[CallCheck]] = {}
    for c in checks:
        if c.call.parent is not None:
            by_parent.setdefault(c.call.parent, []).append(c)
    first = next((c for c in checks if not c.ok and c.call.depth == 0), None) or next(
        (c for c in checks if not c.ok), None)
    while first is not None:
        inner = next((c for c in by_parent.get(first.call.index, []) if not c.ok), None)
        if inner is None:
            return first
        first = inner
    return None


def replay(calls: list[OpCall], backend_runner, reference_runner, progress: Callable[[str], None] | None = None,
           ops_filter: Callable[[OpCall], bool] | None = None) -> StageReport:
    """Replay every recorded call on ``backend_runner.ops`` and group the verdicts by stage (forward order)."""
    t0 = time.perf_counter()
    names = _module_names(reference_runner.model)
    backend_objects: dict[str, Any] = {}
    for mname, m in backend_runner.model.named_modules():
        backend_objects[mname] = m
        for bname, b in m._buffers.items():
            if b is not None:
                backend_objects.setdefault(f"{mname}.{bname}" if mname else bname, b)
    nm = reference_runner.ops.numerics
    device = backend_runner.device
    stages: dict[tuple[str, str, str], StageVerdict] = {}
    checks: list[CallCheck] = []
    part: list[CallCheck] = []  # the calls of the current (forward, block), reported when it is done

    def report_part():
        if progress is not None and part:
            c = part[0].call
            bad = sum(not x.ok for x in part)
            step = "prefill" if c.forward == 0 else f"decode step {c.forward}, {c.path}"
            progress(f"  replayed {c.block} ({step}): "
                     f"{len(part)} calls, {bad} failing")
        part.clear()

    for call in calls:
        if ops_filter is not None and not ops_filter(call):
            continue
        if part and (part[0].call.forward, part[0].call.block) != (call.forward, call.block):
            report_part()
        chk = replay_call(call, backend_runner.ops, nm, names, backend_objects, device)
        part.append(chk)
        checks.append(chk)
        key = (call.block, call.stage, call.op)
        if key not in stages:
            stages[key] = StageVerdict(call.block, call.stage, call.op)
        stages[key].calls.append(chk)
    report_part()
    for st in check_state_resets(backend_runner, reference_runner):
        stages[(st.block, st.stage, st.op)] = st
        checks.extend(st.calls)
    ordered = list(stages.values())
    if progress is not None:
        for s in ordered:
            progress(s.line())
    bad = _first_defect(checks)
    first = None
    if bad is not None:
        first = stages[(bad.call.block, bad.call.stage, bad.call.op)]
    return StageReport(ordered, first, time.perf_counter() - t0)


# ============================================================================================ state hygiene
def check_state_resets(backend_runner, reference_runner) -> list[StageVerdict]:
    """For each compressor: poison a copy of its pooling state, reset one slot through the backend and through
    the reference, and require the same state (a stale state corrupts the next sequence's first entry)."""
    out = []
    ref_mods = dict(reference_runner.model.named_modules())
    for name, comp in backend_runner.model.named_modules():
        if getattr(comp, "kv_ring", None) is None or name not in ref_mods:
            continue
        states = []
        for ops, mod in ((backend_runner.ops, comp), (reference_runner.ops, ref_mods[name])):
            c = copy.copy(mod)
            g = torch.Generator().manual_seed(0)
            c.kv_ring = torch.randn(mod.kv_ring.shape, generator=g).to(mod.kv_ring)
            c.score_ring = torch.randn(mod.score_ring.shape, generator=g).to(mod.score_ring)
            ops.reset_compressor_state(c, torch.tensor([0], device=mod.kv_ring.device))
            states.append((c.kv_ring, c.score_ring))
        same = all(_bitwise_equal(a, b) for a, b in zip(*states))
        block, _ = stage_name("reset_compressor_state", name)
        label = "indexer keys state reset" if ".indexer." in name else "compressor state reset"
        call = OpCall(-1, "reset_compressor_state", name, block, label, 0, None, 0, (), {})
        chk = CallCheck(call, verdict="bit-identical" if same else "defect",
                        message="" if same else "the reset left stale pooling state in the slot")
        out.append(StageVerdict(block, label, "reset_compressor_state", [chk]))
    return out


def verify_stages(backend_runner, reference_runner, input_ids: list[int], decode_steps: int = len(DECODE_PATHS),
                  progress: Callable[[str], None] | None = None,
                  decode_paths: tuple[str, ...] = DECODE_PATHS) -> StageReport:
    """Record ``reference_runner`` on ``input_ids`` (a prefill, then ``decode_steps`` decode steps through the
    ``decode_paths`` in turn) and replay every stage on ``backend_runner`` (same checkpoint, same numerics)."""
    calls = record_reference(reference_runner, input_ids, decode_steps, decode_paths)
    return replay(calls, backend_runner, reference_runner, progress)


__all__ = ["OpRecorder", "OpCall", "record_reference", "replay", "replay_call", "verify_stages", "StageReport",
           "StageVerdict", "CallCheck", "stage_name", "STAGE_NAMES", "DECODE_PATHS", "check_state_resets", "bound_of",
           "output_names",
           "accumulation_of", "default_accumulation"]
