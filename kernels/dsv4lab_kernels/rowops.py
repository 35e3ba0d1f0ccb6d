"""Device helpers shared by the glue kernels (``mhc``, ``norm_rope_quant``, ``compressor_decode``, ``router``,
``indexer_decode``): the reference's rounding points, written once.

The reference (:mod:`dsv4lab.core.model.ops`) evaluates every reduction and transcendental in float64 and rounds at
DeepSeek's fp32/bf16 boundaries. The glue's reductions are short (at most a few thousand terms per row), so the
kernels do the same: products that are exact in fp64 (bf16 × fp32, fp32 × fp32) are summed in fp64, transcendentals
are taken in fp64, and results are rounded to fp32 and then to bf16 exactly where the reference rounds. Two fp64
evaluations of one formula differ by a few fp64 ulps, far below half an fp32 ulp, so a glue kernel reproduces the
reference bit for bit except where the exact value lies within ~1e-14 (relative) of an fp32 rounding boundary —
the per-op bounds in each kernel module's docstring cover that case.

fp64 → bf16 goes through fp32 (as torch converts), and fp32 → bf16 through :func:`round_to_bf16` (the interpreter's
cast truncates). Element-wise fp32 arithmetic that must match torch's separately rounded operations (RoPE) is
launched with ``enable_fp_fusion=False`` so no multiply–add is contracted into an FMA.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from .formats import interpreting, round_to_bf16

LAUNCH_EXACT = dict(enable_fp_fusion=False)
"""Launch options of kernels whose fp32 element-wise arithmetic must round like torch's (no FMA contraction)."""


def device_key(device) -> str:
    """One name per GPU for the once-per-process probes: ``"cuda"`` and ``"cuda:0"`` are the same device when 0 is
    the current one (a probe run through one spelling must be found through the other)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


class DeviceProbe:
    """A capability checked once per process and GPU (:func:`device_key`): ``probe(device)`` returns True, or a
    sentence saying why not; an exception it raises (a kernel the GPU compiler rejects) is recorded as the reason.
    The caller falls back to a slower path wherever :meth:`works` is False."""

    def __init__(self, probe, ok_word: str = "works"):
        self._probe = probe
        self._ok_word = ok_word
        self._state: dict[str, object] = {}

    def works(self, device) -> bool:
        key = device_key(device)
        if key not in self._state:
            try:
                self._state[key] = self._probe(torch.device(key))
            except Exception as err:  # noqa: BLE001 — any failure means: use the fallback, and say why
                self._state[key] = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        return self._state[key] is True

    def status(self, device) -> str:
        """Why :meth:`works` said what it said (for logs and benchmark records)."""
        state = self._state.get(device_key(device))
        return "not probed" if state is None else (self._ok_word if state is True else str(state))


_TENSOR_ANSWERS: dict[tuple, tuple[list, object]] = {}


def once_per_tensors(kind, tensors, compute):
    """``compute(tensors)`` once per ``kind`` and set of tensors (a bank's scales checked for an exact route, or
    tensors derived from them). Keyed by address and shape, and valid only while those very tensors are alive (weak
    references): memory freed by one set and reused by the next must not answer for it."""
    key = (kind,) + tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)
    hit = _TENSOR_ANSWERS.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], tensors)):
        return hit[1]
    answer = compute(tensors)
    _TENSOR_ANSWERS[key] = ([weakref.ref(t) for t in tensors], answer)
    weakref.finalize(tensors[0], _TENSOR_ANSWERS.pop, key, None)  # an answer may hold tensors: freed with its set
    return answer


@triton.jit
def to_act(v, ROUND_BF16: tl.constexpr):
    """Round fp32 ``v`` where the reference rounds to its activation dtype (bf16); unchanged for fp32 activations."""
    if ROUND_BF16:
        return round_to_bf16(v)
    else:
        return v


@triton.jit
def f64_to_act(v, ROUND_BF16: tl.constexpr):
    """fp64 → fp32 (round to nearest) → the activation dtype, the conversion chain torch applies."""
    return to_act(v.to(tl.float32), ROUND_BF16)


@triton.jit
def rsqrt_f32(ms, eps):
    """The reference's ``elementwise(rsqrt, ms + eps)`` for fp32 ``ms``: the sum in fp32, the root in fp64, the result
    rounded to fp32."""
    return (1.0 / tl.sqrt((ms + eps).to(tl.float64))).to(tl.float32)


@triton.jit
def sigmoid_f64(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def log1p_f64(y):
    """``log(1 + y)`` for ``y ≥ 0`` to a few fp64 ulps (Goldberg's correction: ``log(u)·y/(u−1)`` with ``u = 1 + y``),
    where a plain ``log(1 + y)`` would lose every digit of a tiny ``y``."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def rotate_pair(x0, x1, cos, sin, INVERSE: tl.constexpr):
    """Interleaved RoPE of one pair in fp32, term for term as :func:`dsv4lab.core.model.rope.apply_rope` (launch with
    :data:`LAUNCH_EXACT` so the products are rounded separately, as in torch)."""
    if INVERSE:
        sin = -sin
    return x0 * cos - x1 * sin, x0 * sin + x1 * cos


@triton.jit
def fwht_rows(x, ROWS: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """Unnormalised Walsh–Hadamard transform of each row of ``x [ROWS, N]`` (natural order, ``x @ H_N``) as
    ``log2 N`` butterfly stages. In fp64 the sums of bf16 inputs are exact, so this equals the reference's fp64
    matmul by the ±1 matrix."""
    for s in tl.static_range(LOG2N):  # stage s pairs elements 2^s apart
        y = tl.permute(tl.reshape(x, (ROWS, N >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, N))
    return x


@triton.jit
def fp4_qdq_blocks(v):
    """The indexer's FP4 simulation of ``v [A, NB, 32]`` (fp32): per 32-block scale ``2^ceil(log2(amax/6))``
    (``amax ≥ 6·2^-126``), E2M1 round to nearest even with saturation at ±6, times the scale — as
    :func:`dsv4lab.core.quant.fp4_qdq`, including a NaN in a block making the whole block NaN."""
    a = tl.abs(v)
    amax = tl.maximum(tl.max(a, axis=2), 6.0 * 1.1754943508222875e-38)  # 6·2^-126
    has_nan = tl.max((v != v).to(tl.int32), axis=2) > 0
    bits = amax.to(tl.int32, bitcast=True)
    # amax/6 = (M/1.5)·2^(E-2): ceil(log2) is E-2 when M ≤ 1.5 and E-1 above (the fp32 quotient keeps the order)
    e = ((bits >> 23) & 0xFF) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    s = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(v * inv[:, :, None], -6.0), 6.0)
    ay = tl.abs(y)
    ey = tl.maximum(((ay.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 0)  # exponent, subnormal quantum 0.5
    up = ((128 - ey) << 23).to(tl.float32, bitcast=True)  # 2^(1-e): one mantissa bit becomes an integer step
    down = ((ey + 126) << 23).to(tl.float32, bitcast=True)  # 2^(e-1)
    q = ((ay * up + 12582912.0) - 12582912.0) * down
    q = tl.where(y.to(tl.int32, bitcast=True) < 0, -q, q)  # the sign bit is kept, also on zero (code 8 = −0)
    out = q * s[:, :, None]
    return tl.where(has_nan[:, :, None], float("nan"), out)


__all__ = ["LAUNCH_EXACT", "interpreting", "device_key", "to_act", "f64_to_act", "rsqrt_f32", "sigmoid_f64", "log1p_f64", "rotate_pair",
           "fwht_rows", "fp4_qdq_blocks", "round_to_bf16"]
