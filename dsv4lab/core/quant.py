"""DeepSeek-V4 number formats: codecs, block scales and the quantization simulations of the reference.

Formats (spec §2.3):

* **FP4 E2M1** routed-expert weights: 16 codes (sign = bit 3), stored two per byte with element ``2c`` in the
  low nibble and ``2c+1`` in the high nibble (the file holds the bytes as I8), one E8M0 scale per 32 elements
  along K.
* **E8M0** scales: one byte, value ``2**(byte-127)``; byte 255 is NaN and never valid in a weight scale.
* **FP8 E4M3** dense weights with one E8M0 scale per 128×128 block (partial edge blocks included).
* Activations: per token, per 128-wide K block, E4M3 with a power-of-two scale (``act_quant_fp8``); the KV
  simulation (``fp8_qdq``, block 64) and the indexer's FP4 simulation (``fp4_qdq``, block 32).
* The paper's MI250 decode route: activations per 32 to INT8 (``act_quant_int8``) and E2M1 codes as ``2·value``
  in int8 (``E2M1_TIMES2_INT8``), exact.

Everything here is plain torch and runs on any device. Scales are powers of two computed exactly with
``frexp`` (no ``log2`` rounding at powers of two).
"""
from __future__ import annotations

import functools

import torch

from dsv4lab.core.errors import QuantError

# ---------------------------------------------------------------------------------------------- FP4 E2M1
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Code → value; code ``c`` and ``c | 8`` are negatives of each other."""
E2M1_MAX = 6.0
E2M1_TIMES2_INT8 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""Code → 2·value, exact in int8 (the paper's integer-dot decode route)."""
FP8_E4M3_MAX = 448.0
FP4_BLOCK = 32
FP8_WEIGHT_BLOCK = 128
ACT_BLOCK = 128


@functools.lru_cache(maxsize=None)
def _table(values: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    # cached tensors are made outside inference mode so autograd (training) may use them later too
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map E2M1 codes (0..15, any integer dtype) to their values."""
    return _table(E2M1_VALUES, dtype, str(codes.device))[codes.long() & 0xF]


def e2m1_encode(x: torch.Tensor, check_nan: bool = True) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code), saturating at ±6; returns uint8 codes.

    The sign is kept for values that round to zero (−0 has code 8), as hardware conversions do.
    ``check_nan=False`` skips the NaN check (a host sync) for callers that have masked NaNs already.
    """
    if check_nan and torch.isnan(x).any():
        raise QuantError("e2m1_encode: input contains NaN")
    a = x.abs().to(torch.float64)
    grid = _table(E2M1_VALUES[:8], torch.float64, str(x.device))
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    d_lo = a - grid[lo]
    d_hi = grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0) & (hi != lo))
    mag = torch.where(pick_hi, hi, lo)
    mag = torch.where(a >= E2M1_MAX, torch.full_like(mag, 7), mag)
    sign = (torch.signbit(x)).to(torch.int64) << 3
    return (mag | sign).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., K]`` (K even) two per byte: element 2c low nibble, 2c+1 high nibble → uint8 ``[..., K/2]``."""
    if codes.shape[-1] % 2:
        raise QuantError(f"pack_fp4: last dim {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`; accepts the file's int8 view or uint8 (or ``float4_e2m1fn_x2``)."""
    b = as_bytes(packed)
    out = torch.stack((b & 0xF, b >> 4), dim=-1)
    return out.flatten(-2)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a 1-byte tensor as uint8 (int8, fp8, e8m0 and fp4x2 storage alike)."""
    if t.element_size() != 1:
        raise QuantError(f"expected a 1-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------- E8M0 scales
def e8m0_decode(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or uint8) → ``2**(byte-127)``; byte 255 → NaN."""
    b = as_bytes(scale).to(torch.int32)
    # ldexp keeps every exponent exact, including the subnormal-range bytes 0..(127-126-23).
    val = torch.ldexp(torch.ones_like(b, dtype=torch.float64), (b - 127).to(torch.float64))
    val = torch.where(b == 255, torch.full_like(val, float("nan")), val)
    return val.to(dtype)


def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponents (integers in [-127, 127]) → ``float8_e8m0fnu`` bytes."""
    e = exp.to(torch.int32)
    if e.numel() and (e.min() < -127 or e.max() > 127):
        raise QuantError(f"e8m0: exponent out of range [-127, 127] (got {int(e.min())}..{int(e.max())})")
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    return as_bytes(scale).to(torch.int32) - 127


def nan_scale_positions(scale: torch.Tensor) -> torch.Tensor:
    """Indices ``[n, ndim]`` of NaN (0xFF) bytes in an E8M0 scale tensor."""
    return (as_bytes(scale) == 255).nonzero()


def check_scale(scale: torch.Tensor, name: str) -> None:
    """Raise :class:`QuantError` naming ``name`` and the first position if any scale byte is 0xFF (NaN)."""
    bad = nan_scale_positions(scale)
    if len(bad):
        raise QuantError(f"{name}: {len(bad)} E8M0 scale byte(s) are 0xFF (NaN), first at index {bad[0].tolist()}")


def ceil_pow2_exponent(v: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(v))`` for positive finite ``v`` (int32)."""
    mant, exp = torch.frexp(v)  # v = mant · 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)


def div_exact(x: torch.Tensor, d: float) -> torch.Tensor:
    """``x / d`` correctly rounded on every device. (PyTorch's CUDA division by a Python scalar multiplies by the
    scalar's reciprocal: one ulp off for about 5% of ``amax/127`` — enough to flip an INT8 activation by one step
    and to make the GPU oracle disagree with a kernel that divides, as the paper's route does.)"""
    return x / torch.full((), d, dtype=x.dtype, device=x.device)


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The reference's power-of-two scale ``2**ceil(log2(amax/qmax))`` (same dtype as ``amax``)."""
    e = ceil_pow2_exponent(div_exact(amax, qmax))
    return torch.ldexp(torch.ones_like(amax), e.to(amax.dtype))


# ---------------------------------------------------------------------------------------------- FP4 weights
def fp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                block: int = FP4_BLOCK) -> torch.Tensor:
    """Packed E2M1 ``[N, K/2]`` with E8M0 ``[N, K/block]`` → ``[N, K]`` in ``dtype`` (exact in fp32/fp64)."""
    n, half_k = packed.shape[-2:]
    k = 2 * half_k
    if scale.shape[-2:] != (n, k // block) or k % block:
        raise QuantError(f"fp4_dequant: weight {tuple(packed.shape)} needs scale [{n}, {k // block}], "
                         f"got {tuple(scale.shape)}")
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    vals = e2m1_decode(unpack_fp4(packed), calc)
    s = e8m0_decode(scale, calc).repeat_interleave(block, dim=-1)
    return (vals * s).to(dtype)


def fp4_quantize(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[N, K]`` to packed E2M1 (int8 ``[N, K/2]``, as in the file) and E8M0 ``[N, K/block]``.

    Scale ``2**ceil(log2(amax/6))`` per group, so every group uses the top of the E2M1 range.
    """
    n, k = w.shape
    if k % block:
        raise QuantError(f"fp4_quantize: K={k} is not a multiple of the group size {block}")
    wf = w.to(torch.float32).reshape(n, k // block, block)
    amax = wf.abs().amax(-1).clamp_min(E2M1_MAX * 2.0 ** -126)
    exp = ceil_pow2_exponent(div_exact(amax, E2M1_MAX)).clamp(-127, 127)
    s = torch.ldexp(torch.ones_like(amax), exp.to(torch.float32))
    codes = e2m1_encode((wf / s[..., None]).reshape(n, k))
    return pack_fp4(codes).view(torch.int8), e8m0_from_exponent(exp)


# ---------------------------------------------------------------------------------------------- FP8 weights
def fp8_block_dequant(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                      block: int = FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """E4M3 ``[N, K]`` with E8M0 ``[ceil(N/128), ceil(K/128)]`` block scales → ``[N, K]`` (partial blocks ok)."""
    n, k = w.shape
    want = (-(-n // block), -(-k // block))
    if tuple(scale.shape) != want:
        raise QuantError(f"fp8_block_dequant: weight {(n, k)} needs scale {list(want)}, got {list(scale.shape)}")
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    s = e8m0_decode(scale, calc)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.to(calc) * s).to(dtype)


def fp8_block_quantize(w: torch.Tensor, block: int = FP8_WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[N, K]`` to E4M3 with one power-of-two E8M0 scale per 128×128 block (edges partial)."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wf = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    wf[:n, :k] = w.to(torch.float32)
    blocks = wf.reshape(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    exp = ceil_pow2_exponent(div_exact(amax, FP8_E4M3_MAX)).clamp(-127, 127)
    s = torch.ldexp(torch.ones_like(amax), exp.to(torch.float32))
    q = (blocks / s[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(nb * block, kb * block)[:n, :k].to(torch.float8_e4m3fn)
    return q, e8m0_from_exponent(exp)


# ---------------------------------------------------------------------------------------------- activations
def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    k = x.shape[-1]
    if k % block:
        raise QuantError(f"activation width {k} is not a multiple of the block {block}")
    return x.reshape(*x.shape[:-1], k // block, block)


def _calc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def act_quant_fp8(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per ``block`` along K: E4M3 values and power-of-two scales (``amax`` floored at 1e-4).

    Returns ``(x_q float8_e4m3fn [..., K], scale [..., ceil(K/block)])`` with ``x ≈ x_q · scale``; scales are in
    the calculation dtype (fp32, or fp64 for fp64 inputs) and are exact powers of two (E8M0-representable).
    DeepSeek-V4's widths are multiples of 128; for other widths (small test models) the last block is partial,
    consistent with the partial edge blocks of the 128×128 weight scales.
    """
    calc = _calc_dtype(x)
    k = x.shape[-1]
    pad = -k % block
    xc = x.to(calc)
    if pad:
        xc = torch.nn.functional.pad(xc, (0, pad))
    xb = _blocked(xc, block)
    s = pow2_scale(xb.abs().amax(-1).clamp_min(1e-4), FP8_E4M3_MAX)
    q = (xb / s[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :k], s


def act_qdq_fp8(x: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """Quantize-dequantize simulation of :func:`act_quant_fp8`, in the calculation dtype."""
    q, s = act_quant_fp8(x, block)
    return q.to(s.dtype) * s.repeat_interleave(block, -1)[..., : q.shape[-1]]


def fp8_qdq(v: torch.Tensor, block: int = 64) -> torch.Tensor:
    """KV FP8 simulation (spec §3.4): E4M3 round trip with a power-of-two scale per ``block``; returns ``v.dtype``."""
    calc = _calc_dtype(v)
    vb = _blocked(v.to(calc), block)
    s = pow2_scale(vb.abs().amax(-1).clamp_min(1e-4), FP8_E4M3_MAX)[..., None]
    q = (vb / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(calc)
    return (q * s).flatten(-2).to(v.dtype)


def fp4_qdq(v: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Indexer FP4 simulation (spec §3.5): E2M1 round trip (RNE) with a power-of-two scale per ``block``."""
    calc = _calc_dtype(v)
    vb = _blocked(v.to(calc), block)
    s = pow2_scale(vb.abs().amax(-1).clamp_min(E2M1_MAX * 2.0 ** -126), E2M1_MAX)[..., None]
    nan = torch.isnan(vb)  # NaN propagates (a poisoned input must stay visible), it is not encoded
    codes = e2m1_encode((vb / s).clamp(-E2M1_MAX, E2M1_MAX).masked_fill(nan, 0.0), check_nan=False)  # sync-free
    q = e2m1_decode(codes, calc)
    return (q * s).masked_fill(nan, float("nan")).flatten(-2).to(v.dtype)


def act_quant_int8(x: torch.Tensor, block: int = FP4_BLOCK, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's decode route: per ``block`` (32) elements, int8 values and an fp32 scale ``amax/127``.

    With ``pow2=True`` the scale is rounded up to a power of two (cheaper to apply, slightly less precise).
    Returns ``(q int8 [..., K], scale float32 [..., K/block])`` with ``x ≈ q · scale``.
    """
    xb = _blocked(x.to(torch.float32), block)
    amax = xb.abs().amax(-1).clamp_min(1e-8)
    s = pow2_scale(amax, 127.0) if pow2 else div_exact(amax, 127.0)
    q = torch.round(xb / s[..., None]).clamp(-127, 127).to(torch.int8)
    return q.flatten(-2), s


# ---------------------------------------------------------------------------------------------- Hadamard
@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (natural order, ±1 entries, unscaled)."""
    if n <= 0 or n & (n - 1):
        raise QuantError(f"Hadamard order {n} is not a power of two")
    with torch.inference_mode(False):  # cached: must stay usable by autograd after an inference-mode first call
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return h.to(dtype=dtype, device=device)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_n · n^-0.5`` over the last dim (H symmetric), evaluated in fp64 (correctly rounded to fp32 first,
    as an fp32 transform would be, then to ``x.dtype``) so it does not depend on batch shape or kernel."""
    n = x.shape[-1]
    h = hadamard_matrix(n, torch.float64, str(x.device))
    return (x.to(torch.float64) @ h * n ** -0.5).to(_calc_dtype(x)).to(x.dtype)


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "functools", "torch")]
