"""Device-side number formats shared by the kernel families: E8M0 scales, E2M1 codes, E4M3 activation rounding.

Every helper is exact (bit manipulation and power-of-two scaling, no ``log2``/``exp2`` approximations) and gives
the same bits on NVIDIA, AMD and Triton's CPU interpreter. The interpreter's own fp32 → float8e4nv cast does not
carry a rounding into the exponent (127.1 becomes 64, not 128), so activations are rounded to the E4M3 grid in
fp32 arithmetic here and cast to fp8 only once they are exactly representable; likewise its fp32 → bf16 cast
truncates, so results are rounded to BF16 with :func:`round_to_bf16` before any bf16 cast.

Host-side twins of these codecs (the oracles) are in :mod:`dsv4lab.core.quant`.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5·2^23: (v + M) − M rounds |v| < 2^22 to the nearest integer, ties even


@triton.jit
def pow2(e):
    """``2**e`` as fp32 for integer ``e`` in [-126, 127] (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(b):
    """E8M0 bytes (as int32 0..254) → ``2**(b-127)``; byte 0 is the subnormal 2^-127."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pair_to_f32_scaled(b):
    """Packed bytes (int32 0..255) → the two E2M1 codes (element 2c low nibble, 2c+1 high) as ``value · 2^-14``
    in fp32, exactly.

    The three magnitude bits of a code are placed at fp16 bits 11..9 (the exponent's low two bits and the top
    mantissa bit), so the fp16 reading is ``value · 2^-14`` for normal and subnormal codes alike (code 1 = 0.5
    lands on the fp16 subnormal 2^-15). Callers fold the 2^14 into the per-group scale.
    """
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return (lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def e2m1_pair_times2_int(b):
    """Packed bytes (int32 0..255) → the two codes as ``2·value`` int32 in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}
    (the paper's INT8 route: exact in int8)."""
    m_lo = b & 7
    m_hi = (b >> 4) & 7
    e_lo = m_lo >> 1
    e_hi = m_hi >> 1
    v_lo = tl.where(e_lo == 0, m_lo & 1, (2 + (m_lo & 1)) << tl.maximum(e_lo - 1, 0))
    v_hi = tl.where(e_hi == 0, m_hi & 1, (2 + (m_hi & 1)) << tl.maximum(e_hi - 1, 0))
    return tl.where((b & 8) != 0, -v_lo, v_lo), tl.where((b & 0x80) != 0, -v_hi, v_hi)


@triton.jit
def round_to_bf16(v):
    """Round fp32 ``v`` to the nearest BF16 value (ties to even), returned as fp32 — exactly representable, so a
    following ``.to(tl.bfloat16)`` is exact. (The interpreter's fp32 → bf16 cast truncates.)"""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    # a NaN stays a NaN (the bias would carry a NaN with a high payload — CUDA's 0x7FFFFFFF — into −0)
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def fp8_act_exponent(amax):
    """Exact ``ceil(log2(amax / 448))`` for positive normal fp32 ``amax`` (the reference's activation scale).

    With ``amax = M·2^E`` (M in [1, 2)) and ``448 = 1.75·2^8``: ``amax/448 ≤ 2^(E-8)`` iff ``M ≤ 1.75``.
    """
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    return e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def round_to_e4m3(v):
    """Round fp32 ``v`` (already clamped to ±448) to the nearest E4M3 value, ties to even; returned as fp32."""
    bits = tl.abs(v).to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # E4M3 subnormals share the quantum of exponent -6
    up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3-e): 3 mantissa bits become integer steps
    down = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e-3)
    return ((v * up + RNE_MAGIC) - RNE_MAGIC) * down


@triton.jit
def quantize_fp8_block(x, amax, ACT_QUANT: tl.constexpr):
    """The reference's activation quantization of one 128-wide block: ``e4m3(x / s) · s`` with
    ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, returned as exact fp32 values (``x`` unchanged if off).

    Written out in one function (not through :func:`fp8_act_exponent` / :func:`round_to_e4m3`): every nested
    jit call costs the CPU interpreter a few milliseconds, and this runs once per token per K block.
    """
    if ACT_QUANT:
        abits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
        ex = ((abits >> 23) & 0xFF) - 135 + ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)  # fp8_act_exponent
        xs = x * ((127 - ex) << 23).to(tl.float32, bitcast=True)
        xs = tl.minimum(tl.maximum(xs, -448.0), 448.0)
        bits = tl.abs(xs).to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        q = ((xs * ((130 - e) << 23).to(tl.float32, bitcast=True) + RNE_MAGIC) - RNE_MAGIC) \
            * ((e + 124) << 23).to(tl.float32, bitcast=True)
        return q * ((ex + 127) << 23).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def int8_group_scale(amax):
    """The paper's per-32 INT8 activation scale ``max(amax, 1e-8) / 127`` (fp32, correctly rounded as
    :func:`dsv4lab.core.quant.act_quant_int8`)."""
    a = tl.maximum(amax, 1e-8)
    return tl.math.div_rn(a, tl.full(a.shape, 127.0, tl.float32))


@triton.jit
def quantize_int8(x, s):
    """``clamp(rint(x / s), ±127)`` as int32 (``s`` broadcast to ``x``'s shape by the caller)."""
    q = (tl.math.div_rn(x, s) + RNE_MAGIC) - RNE_MAGIC
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)


__all__ = ["RNE_MAGIC", "pow2", "round_to_bf16", "e8m0_to_f32", "e2m1_pair_to_f32_scaled", "e2m1_pair_times2_int",
           "fp8_act_exponent", "round_to_e4m3", "quantize_fp8_block", "int8_group_scale", "quantize_int8"]


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``): bf16/fp8 dots must then be fed fp32 operands,
    launch geometries favour few large programs, and device-only paths (inline PTX, cuBLAS) are off. The one
    definition for the kernel modules (the engine, which must import without Triton, keeps its own)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
