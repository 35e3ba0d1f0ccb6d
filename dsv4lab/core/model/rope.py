"""Rotary embeddings of DeepSeek-V4 (spec §3.3).

Per layer: SWA layers use ``rope_theta`` without YaRN; CSA/HCA layers use ``compress_rope_theta`` with DeepSeek's
YaRN (frequency interpolation only — no magnitude scaling), evaluated with DeepSeek's own expression
(``smooth = 1 − ramp; f/factor·(1 − smooth) + f·smooth``). The same table serves the main query, the window
KV, the compressed KV (at each block's first position), and the indexer's queries and keys. Pairs are
**interleaved** (``x[2i], x[2i+1]``) on the **last** ``rope_head_dim`` dims; the attention output gets the
inverse rotation at the query position.
"""
from __future__ import annotations

import math

import torch

from dsv4lab.core.config import ModelArgs


def rope_frequencies(args: ModelArgs, layer: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-pair angular frequencies ``[rope_head_dim/2]`` of ``layer`` (YaRN applied on CSA/HCA layers)."""
    dim = args.rope_head_dim
    theta, yarn = args.rope_params(layer)
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    if yarn:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(args.beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
        # DeepSeek's expression, rounding for rounding: ``1 − (1 − ramp)`` is not ``ramp`` in fp32, and the
        # algebraically equal ``f/factor·ramp + f·(1−ramp)`` moves 1 in 8 frequencies by an ulp
        smooth = 1 - ramp
        freqs = freqs / args.rope_factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_table(args: ModelArgs, layer: int, n_positions: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``[n_positions, rope_head_dim/2]``; angles ``p·f_i`` computed in ``dtype``.

    DeepSeek builds the same table as ``torch.polar(ones, angles)``. Both round the cosine and sine of the same fp32
    angle, through different math-library paths: they differ by at most one fp32 ulp (about 5% of the entries on
    the CPU machines here, which ones depending on the library). Kept: it is the table the golden oracles were
    recorded with and the one the kernels read (tests/test_reference_fidelity.py::test_rope_table_is_within_one_ulp_of_deepseeks_polar)."""
    freqs = rope_frequencies(args, layer, dtype)
    angles = torch.outer(torch.arange(n_positions, dtype=dtype), freqs)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               interleaved: bool = True) -> torch.Tensor:
    """Rotate the last dim of ``x`` (``[..., 2m]``) by angles whose cos/sin broadcast to ``[..., m]``.

    Computed in the dtype of ``cos`` and returned in ``x.dtype`` (the reference rotates in fp32 and writes back).
    ``interleaved=False`` rotates (first half, second half) pairs instead — the NeoX layout, kept only so the
    fault catalogue can show what using it would do.
    """
    calc = cos.dtype
    xf = x.to(calc)
    if interleaved:
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = xf.shape[-1] // 2
        x0, x1 = xf[..., :half], xf[..., half:]
    if inverse:
        sin = -sin
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    out = torch.stack((r0, r1), dim=-1).flatten(-2) if interleaved else torch.cat((r0, r1), dim=-1)
    return out.to(x.dtype)
