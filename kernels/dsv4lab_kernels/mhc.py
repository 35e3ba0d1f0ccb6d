"""mHC (manifold-constrained hyper-connections) around every sub-layer: one launch per site at decode sizes, two
for many rows.

The residual is ``n`` streams ``X [rows, n, D]``. Before a sub-layer, :func:`hc_pre_norm` mixes them into the
sub-layer's normed input: the ``(2+n)·n`` mixing logits are a projection of the flattened ``n·D`` values onto
``fn``, scaled by their RMS; ``pre``/``post`` are sigmoids of the first ``2n``, ``comb`` is the Sinkhorn
normalisation of the last ``n·n``; ``u = Σ_j pre_j X_j`` and the sub-layer gets ``RMSNorm(u)``. After it,
:func:`hc_post` writes ``X'_k = post_k·out + Σ_j comb_jk X_j`` back. The launches for many rows (prefill chunks):

* **mix** — grid ``(row blocks, splits of D)``: each program takes ``D/splits`` columns of all ``n`` streams and
  writes their partial projections onto ``fn`` and partial sum of squares (the projection reads ``fn``, 1.6 MB at
  Flash width, so it is spread over many programs). With ``post`` it first forms ``X'`` of its columns from the
  previous sub-layer's output and stores it — :func:`hc_post_pre_norm` is the end of one sub-layer and the start
  of the next in the same two launches.
* **finish** — one program per row: the partial sums in a fixed order, the logits, the sigmoids, Sinkhorn's
  ``iters`` iterations on the ``n×n`` matrix, ``u`` and its RMSNorm (``u`` is recomputed in the second pass over
  the columns rather than stored and re-read: no barrier, the same bits).

:func:`hc_post` alone (the end of a block) is the mix launch without the projection, and :func:`hc_head` (the final
collapse of the streams) the two launches with only the ``pre`` row group and no norm.

**Decode rows** (at most :data:`SITE_MAX_ROWS`): one launch per site, grid ``(splits of D, rows)``. Each program does
the mix of its columns of one row (``X'`` with ``post``, then its partial projections onto ``fn`` — the 1.6 MB of
fp32 mixing weights at Flash width are read by all ~128 programs at once), stores them, and takes a ticket from the
row's counter (an atomic add after a barrier, so every store of the program is made before it); the program that
draws the last ticket finishes the row alone (:mod:`.tickets`): it sums the partials in split order (the same order
whichever program finishes), computes ``pre``/``post``, Sinkhorn and the RMSNorm of ``u`` (``u`` written once, then
scaled in place from the row it just wrote), and resets the counter. No sum depends on which program came last:
replay equals eager, bit for bit.

**Numerics and bound.** Every reduction the reference evaluates in float64 (the projection, the sums of squares,
the stream sums, Sinkhorn's normalisations) is evaluated in float64 here, and every value the reference rounds to
fp32 or to bf16 is rounded there (the products ``pre_j·X_j`` and ``post_k·out`` in fp32, as the reference
multiplies in fp32). The products entering the fp64 sums are exact (bf16 × fp32 or fp32 × fp32), so kernel and
reference are two fp64 evaluations of one formula: their sums differ by at most ``γ_n(fp64)·Σ|terms|`` (n = the
terms: ``n·D`` for the projection), ~1e-16 relative; the sigmoids, the softmax and the divisions of Sinkhorn add
a few fp64 ulps each (its normalisations are diagonal scalings of the matrix: they do not amplify a relative
perturbation, which only the 40 roundings of the iteration add to, ≤ 40 ulps). All of it is ~1e-14 relative,
far below half an fp32 ulp (6e-8): ``post``, ``comb`` and ``pre`` equal the reference's fp32 values except where
the exact value lies within that distance of an fp32 rounding boundary — then **one fp32 ulp**. ``u``, ``X'`` and
the normed input are rounded once more to bf16, so the same argument gives **one bf16 ulp** of the output, plus in
the rare case above the propagation of one fp32 ulp of ``pre``/``comb``: ``4·u_fp32·Σ_j|pre_j X_j|`` (then times
``|w|·rsqrt(ms)`` through the norm), which the tests add to the bound as ``γ_4(fp32)·Σ|terms|``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .norm_rope_quant import f64_bits
from .rowops import LAUNCH_EXACT, DeviceProbe, f64_to_act, interpreting, rsqrt_f32, sigmoid_f64, to_act
from .fp4_moe_decode import MoeOutput
from .fp4_moe_decode_kernels import moe_output_columns
from .tickets import counters, take_ticket
from .launch import pdl_args, pdl_prologue


SITE_MAX_ROWS = 16
"""Rows up to which a site runs as the one-launch decode kernel (above: the two-launch mix/finish pair)."""


@dataclass(frozen=True)
class MhcSiteGeometry:
    """The one-launch decode kernel: ``splits`` programs across ``D`` per row (each a multiple of ``block_d``
    columns, stepped ``block_d`` at a time), the finishing program's column step ``block_dn``, warps per program;
    ``split_tail``: two programs finish a row at once — the last to draw its ticket the pre gates and the RMSNormed
    input, the one before it (which waits for the last ticket) the post gates and the Sinkhorn — instead of the
    last doing both in turn (a site with Sinkhorn, ≥ 2 programs per row, on a GPU: the interpreter runs programs
    one after another, so a program cannot wait for a later one there)."""

    splits: int = 128
    block_d: int = 32
    block_dn: int = 2048
    num_warps: int = 8
    split_tail: bool = False  # the Sinkhorn in the next-to-last program, beside the last one's rows (see _site)

    @classmethod
    def for_rows(cls, rows: int, D: int) -> "MhcSiteGeometry":
        if interpreting():  # few, large programs: the interpreter pays per program
            return cls(splits=2, block_d=64, block_dn=512, num_warps=4)
        # about 256 programs in all: the fp32 mixing weights are read by every row's programs (from L2 after the
        # first), so more rows take fewer, wider column slices
        splits = max(4, min(128, 256 // max(rows, 1)))
        return cls(splits=splits, block_d=32)


@dataclass(frozen=True)
class MhcGeometry:
    """Rows per mix program, columns per step, programs across ``D`` (splits), warps."""

    block_m: int = 1
    block_d: int = 32
    splits: int = 64
    num_warps: int = 4

    @classmethod
    def for_rows(cls, rows: int, D: int) -> "MhcGeometry":
        if interpreting():  # few, large programs: the interpreter pays per program
            return cls(block_m=min(8, triton.next_power_of_2(max(rows, 1))), block_d=64, splits=1)
        block_m = 1 if rows <= 8 else 4
        splits = max(1, min(64, triton.cdiv(D, 32), triton.cdiv(512, triton.cdiv(rows, block_m))))
        return cls(block_m=block_m, block_d=32 if block_m == 1 else 16, splits=splits)


# ============================================================================================ mix
@triton.jit
def _mhc_mix_kernel(x_ptr, out_ptr, post_ptr, comb_ptr, xn_ptr, fn_ptr, part_ptr, M, D, NMIX, SPLITS,
                    sx_m, sx_s, so_m, sxn_m, sxn_s, sfn, APPLY_POST: tl.constexpr, MIX: tl.constexpr,
                    ROUND_BF16: tl.constexpr, HC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_J: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    per = tl.cdiv(tl.cdiv(D, SPLITS), BLOCK_D) * BLOCK_D
    d_lo = split * per
    d_hi = tl.minimum(d_lo + per, D)
    s = tl.arange(0, HC)
    j = tl.arange(0, BLOCK_J)
    if APPLY_POST:
        post = tl.load(post_ptr + rows64[:, None] * HC + s[None, :], mask=row_ok[:, None], other=0.0)
        cidx = rows64[:, None, None] * (HC * HC) + s[None, :, None] * HC + s[None, None, :]  # comb[row, j, k]
        comb = tl.load(comb_ptr + cidx, mask=row_ok[:, None, None], other=0.0).to(tl.float64)
    acc = tl.zeros((BLOCK_M, BLOCK_J), tl.float64)
    sq = tl.zeros((BLOCK_M,), tl.float64)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < d_hi
        m3 = row_ok[:, None, None] & dm[None, None, :]
        x = tl.load(x_ptr + rows64[:, None, None] * sx_m + s[None, :, None] * sx_s + d[None, None, :], mask=m3,
                    other=0.0).to(tl.float32)
        if APPLY_POST:
            o = tl.load(out_ptr + rows64[:, None] * so_m + d[None, :], mask=row_ok[:, None] & dm[None, :],
                        other=0.0).to(tl.float32)
            # Σ_j comb[j, k]·X[j, d]: exact products, summed in fp64 and rounded once (the reference's einsum)
            mixed = tl.sum(comb[:, :, :, None] * x.to(tl.float64)[:, :, None, :], axis=1).to(tl.float32)
            x = to_act(post[:, :, None] * o[:, None, :] + mixed, ROUND_BF16)
            tl.store(xn_ptr + rows64[:, None, None] * sxn_m + s[None, :, None] * sxn_s + d[None, None, :],
                     x.to(xn_ptr.dtype.element_ty), mask=m3)
        if MIX:
            x64 = x.to(tl.float64)
            sq += tl.sum(tl.sum(x64 * x64, axis=2), axis=1)
            f = tl.load(fn_ptr + j[:, None, None] * sfn + s[None, :, None] * D + d[None, None, :],
                        mask=(j < NMIX)[:, None, None] & dm[None, None, :], other=0.0).to(tl.float64)
            acc += tl.sum(tl.sum(x64[:, None, :, :] * f[None, :, :, :], axis=3), axis=2)
    if MIX:
        base = (rows64 * SPLITS + split) * (NMIX + 1)
        tl.store(part_ptr + base[:, None] + j[None, :], acc, mask=row_ok[:, None] & (j < NMIX)[None, :])
        tl.store(part_ptr + base + NMIX, sq, mask=row_ok)


# ============================================================================================ prefill: many rows
# The mix above spreads one row's projection over many programs: right for a few decode rows, but at prefill sizes
# every program of 4 rows re-reads the whole mixing matrix (1.6 MB at Flash width, fp32 → fp64 on every load) and
# multiplies by broadcasting a [rows, 32, n, d] product through registers. The rows kernel below is the same sum
# as a GEMM: a block of BLOCK_M rows times the matrix, one fp64 product-and-sum per stream and column step (by
# broadcasting: triton 3.6 cannot lower an fp64 ``tl.dot``) — the matrix
# is read once per row block — and each program covers a slice of D (``splits``), its partials summed in split
# order by the same finish kernel. fp64 throughout: the bound of the module docstring is unchanged.


@dataclass(frozen=True)
class MhcRowsGeometry:
    """Rows per program, columns per step of each stream (the dot's K), programs across ``D`` (0: enough for
    about two programs per SM), warps."""

    block_m: int = 16
    block_d: int = 16
    splits: int = 0
    num_warps: int = 8

    @property
    def name(self) -> str:
        return f"m{self.block_m}d{self.block_d}w{self.num_warps}" + (f"s{self.splits}" if self.splits else "")

    def resolve(self, rows: int, D: int, device) -> "MhcRowsGeometry":
        """The geometry with ``splits`` fixed for ``rows`` rows of width ``D``."""
        if self.splits:
            return self
        if interpreting():  # few, large programs: the interpreter pays per program
            return MhcRowsGeometry(block_m=min(64, max(16, triton.next_power_of_2(rows))), block_d=min(64, max(
                16, triton.next_power_of_2(D))), splits=1)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if torch.device(
            device).type == "cuda" else 1
        blocks = triton.cdiv(rows, self.block_m)
        splits = max(1, min(triton.cdiv(D, self.block_d), triton.cdiv(2 * sms, blocks)))
        return MhcRowsGeometry(self.block_m, self.block_d, splits, self.num_warps)


# The geometries the prefill benchmark times (``bench kernels --suite prefill``, glue section); the backend runs the
# one it measured fastest (``choices.mhc_rows_geometry``). Modelled from the SASS of Triton 3.6 (mix without the
# post step, loop instructions per step / fp64 FMAs): m16d16w8 357/132, m32d8w8 270/132 (148 registers),
# m16d8w4 273/132 (156), m64d4w4 441/264 (255).
ROWS_GEOMETRIES = {g.name: g for g in (MhcRowsGeometry(16, 16, 0, 8), MhcRowsGeometry(32, 8, 0, 8),
                                       MhcRowsGeometry(16, 8, 0, 4), MhcRowsGeometry(64, 4, 0, 4))}


@triton.jit
def _mhc_mix_rows_kernel(x_ptr, out_ptr, post_ptr, comb_ptr, xn_ptr, fn_ptr, part_ptr, M, D, NMIX, SPLITS,
                         sx_m, sx_s, so_m, sxn_m, sxn_s, sfn, APPLY_POST: tl.constexpr, MIX: tl.constexpr,
                         ROUND_BF16: tl.constexpr, HC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_J: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    per = tl.cdiv(tl.cdiv(D, SPLITS), BLOCK_D) * BLOCK_D
    d_lo = split * per
    d_hi = tl.minimum(d_lo + per, D)
    s = tl.arange(0, HC)
    j = tl.arange(0, BLOCK_J)
    # one fp64 accumulator per (logit, row, column) of the tile, summed over the columns once after the loop: the
    # loop is FMAs only (a sum over the tile's columns in every step made it shuffle-bound — SASS, Triton 3.6). The
    # logit axis leads so that it lies in each thread's registers and the columns across its lanes: a thread then
    # widens each X element to fp64 once for all its logits (with the logits across lanes, every FMA paid its own
    # fp32→fp64 conversion, a quarter-rate instruction: 140 conversions for 132 FMAs per step — SASS, Triton 3.6)
    acc3 = tl.zeros((BLOCK_J, BLOCK_M, BLOCK_D), tl.float64)
    sq2 = tl.zeros((BLOCK_M, BLOCK_D), tl.float64)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < d_hi
        m2 = row_ok[:, None] & dm[None, :]
        if APPLY_POST:
            o = tl.load(out_ptr + rows64[:, None] * so_m + d[None, :], mask=m2, other=0.0).to(tl.float32)
            if HC == 4:  # every preset: the four streams as four tiles, mixed by FMAs in each thread's registers
                xs = x_ptr + rows64[:, None] * sx_m + d[None, :]
                x0 = tl.load(xs, mask=m2, other=0.0).to(tl.float32).to(tl.float64)
                x1 = tl.load(xs + sx_s, mask=m2, other=0.0).to(tl.float32).to(tl.float64)
                x2 = tl.load(xs + 2 * sx_s, mask=m2, other=0.0).to(tl.float32).to(tl.float64)
                x3 = tl.load(xs + 3 * sx_s, mask=m2, other=0.0).to(tl.float32).to(tl.float64)
            else:  # a sum over the streams' axis: warp shuffles in every step
                x_all = tl.load(x_ptr + rows64[:, None, None] * sx_m + s[None, :, None] * sx_s + d[None, None, :],
                                mask=row_ok[:, None, None] & dm[None, None, :], other=0.0).to(tl.float32).to(tl.float64)
        for k in tl.static_range(HC):
            if APPLY_POST:
                # X'_k = post_k·out + Σ_j comb[j, k]·X_j: exact products, summed in fp64 and rounded once
                post_k = tl.load(post_ptr + rows64 * HC + k, mask=row_ok, other=0.0)
                if HC == 4:
                    cb = comb_ptr + rows64 * (HC * HC) + k  # comb[row, j, k] at j·HC + k
                    mixed = (tl.load(cb, mask=row_ok, other=0.0).to(tl.float64)[:, None] * x0
                             + tl.load(cb + HC, mask=row_ok, other=0.0).to(tl.float64)[:, None] * x1
                             + tl.load(cb + 2 * HC, mask=row_ok, other=0.0).to(tl.float64)[:, None] * x2
                             + tl.load(cb + 3 * HC, mask=row_ok, other=0.0).to(tl.float64)[:, None] * x3
                             ).to(tl.float32)
                else:
                    comb_k = tl.load(comb_ptr + rows64[:, None] * (HC * HC) + s[None, :] * HC + k,
                                     mask=row_ok[:, None], other=0.0).to(tl.float64)
                    mixed = tl.sum(comb_k[:, :, None] * x_all, axis=1).to(tl.float32)
                xk = to_act(post_k[:, None] * o + mixed, ROUND_BF16)
                tl.store(xn_ptr + rows64[:, None] * sxn_m + k * sxn_s + d[None, :],
                         xk.to(xn_ptr.dtype.element_ty), mask=m2)
            else:
                xk = tl.load(x_ptr + rows64[:, None] * sx_m + k * sx_s + d[None, :], mask=m2,
                             other=0.0).to(tl.float32)
            if MIX:
                x64 = xk.to(tl.float64)
                sq2 += x64 * x64
                f = tl.load(fn_ptr + j[:, None] * sfn + k * D + d[None, :], mask=(j < NMIX)[:, None] & dm[None, :],
                            other=0.0).to(tl.float64)
                # [mix logits, k-slice] · [k-slice, rows] in fp64 by broadcasting: an fp64 ``tl.dot`` does not
                # lower to LLVM on triton 3.6. With the sum over the slice in every step this took 26.9 ms per
                # 4,096-row chunk on the H200 against 8.85 ms on the decode kernels (bba68f2,
                # data/results/h200/prefill_kernels.json). The matrix arrives in fp64 (``_mix_rows`` widens it):
                # loaded as fp32, every thread widened each of its 32 logits' values per step — the conversions
                # outnumbered the FMAs (SASS, Triton 3.6)
                acc3 += f[:, None, :] * x64[None, :, :]
    if MIX:
        acc = tl.sum(acc3, axis=2)  # [logit, row]
        sq = tl.sum(sq2, axis=1)
        base = (rows64 * SPLITS + split) * (NMIX + 1)
        tl.store(part_ptr + base[None, :] + j[:, None], acc, mask=row_ok[None, :] & (j < NMIX)[:, None])
        tl.store(part_ptr + base + NMIX, sq, mask=row_ok)


def _mix_rows(X, out, post, comb, fn, apply_post: bool, nmix: int, geo: MhcRowsGeometry):
    """:func:`_mix` on the rows kernel; returns ``(X' or None, partials or None, splits)``."""
    M, HC, D = _check(X)
    Xr = X.reshape(M, HC, D)
    geo = geo.resolve(M, D, X.device)
    xn = torch.empty_like(Xr) if apply_post else Xr
    mix = fn is not None
    if mix:  # fp32 → fp64 is exact; widened once here, not once per use in every thread (see the kernel)
        fn = fn.to(torch.float64)
    part = torch.empty(M, geo.splits, nmix + 1, dtype=torch.float64, device=X.device) if mix else xn
    if M:
        outr = out.reshape(M, D) if apply_post else Xr
        _mhc_mix_rows_kernel[(triton.cdiv(M, geo.block_m), geo.splits)](
            Xr, outr, post.reshape(M, HC).float().contiguous() if apply_post else Xr,
            comb.reshape(M, HC, HC).float().contiguous() if apply_post else Xr, xn,
            fn if mix else Xr, part, M, D, nmix, geo.splits, Xr.stride(0), Xr.stride(1), outr.stride(0),
            xn.stride(0), xn.stride(1), fn.stride(0) if mix else 0, APPLY_POST=apply_post, MIX=mix,
            ROUND_BF16=X.dtype == torch.bfloat16, HC=HC, BLOCK_M=geo.block_m, BLOCK_D=geo.block_d,
            BLOCK_J=max(16, triton.next_power_of_2(max(nmix, 1))), num_warps=geo.num_warps, **LAUNCH_EXACT)
    return (xn if apply_post else None), (part if mix else None), geo.splits


def hc_pre_norm_rows(X, fn, base, scale, norm_weight, iters: int, norm_eps: float, hc_eps: float,
                     geometry: MhcRowsGeometry | None = None):
    """:func:`hc_pre_norm` for many rows (the mix on the rows kernel); the same results."""
    M, HC, D = _check(X)
    _, part, splits = _mix_rows(X, None, None, None, fn, False, (2 + HC) * HC, geometry or MhcRowsGeometry())
    return _finish(X.reshape(M, HC, D), part, base, scale, norm_weight, False, iters, norm_eps, hc_eps,
                   X.shape[:-2], splits)


def hc_post_pre_norm_rows(out, X, post, comb, fn, base, scale, norm_weight, iters: int, norm_eps: float,
                          hc_eps: float, geometry: MhcRowsGeometry | None = None):
    """:func:`hc_post_pre_norm` for many rows; the same results."""
    M, HC, D = _check(X)
    xn, part, splits = _mix_rows(X, out, post, comb, fn, True, (2 + HC) * HC, geometry or MhcRowsGeometry())
    return (xn.view(X.shape), *_finish(xn, part, base, scale, norm_weight, False, iters, norm_eps, hc_eps,
                                        X.shape[:-2], splits))


def hc_post_rows(out, X, post, comb, geometry: MhcRowsGeometry | None = None):
    """:func:`hc_post` for many rows; the same results."""
    xn, _, _ = _mix_rows(X, out, post, comb, None, True, 0, geometry or MhcRowsGeometry())
    return xn.view(X.shape)


def _probe_rows_kernel(dev: torch.device) -> bool | str:
    g = torch.Generator(device=dev).manual_seed(0)
    M, HC, D = 70, 4, 160
    X = torch.randn(M, HC, D, device=dev, generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + HC) * HC, HC * D, device=dev, generator=g) * (HC * D) ** -0.5
    _, got, splits = _mix_rows(X, None, None, None, fn, False, (2 + HC) * HC,
                               MhcRowsGeometry(block_m=16, block_d=16, splits=2))  # the default tile
    _, want = _mix(X, None, None, None, fn, False, (2 + HC) * HC, MhcGeometry(block_m=1, splits=1))
    ok = torch.allclose(got.sum(1), want[:, 0], rtol=1e-12, atol=1e-12)
    return True if ok else "the rows kernel's partial sums differ from the decode mix's"


_ROWS_PROBE = DeviceProbe(_probe_rows_kernel)


def rows_kernel_works(device) -> bool:
    """Whether the rows kernel compiles here (fp64 throughout) and gives the decode mix's partial sums (both
    fp64: equal to ~1e-15 relative) — checked once per process on a small random case; the interpreter always
    runs it. The backend falls back to the decode mix where it does not (see :func:`rows_kernel_status`)."""
    if interpreting() or torch.device(device).type != "cuda":
        return True
    return _ROWS_PROBE.works(device)


def rows_kernel_status(device) -> str:
    """Why :func:`rows_kernel_works` said what it said (for logs and benchmark records)."""
    if interpreting() or torch.device(device).type != "cuda":
        return "interpreter"
    return _ROWS_PROBE.status(device)


# ============================================================================================ finish
@triton.jit
def _partial_sum(part_ptr, row, SPLITS, NPART, offs, mask):
    """Σ over the splits, in split order, of ``part[row, :, offs]`` (fp64)."""
    total = tl.load(part_ptr + row * SPLITS * NPART + offs, mask=mask, other=0.0)
    for sp in range(1, SPLITS):
        total += tl.load(part_ptr + (row * SPLITS + sp) * NPART + offs, mask=mask, other=0.0)
    return total


@triton.jit
def _stream_sum(x_ptr, row, sx_m, sx_s, pre, d, dm, s, ROUND_BF16: tl.constexpr):
    """``u = Σ_j pre_j·X_j`` on columns ``d``: fp32 products, an fp64 sum, rounded to fp32 then to act."""
    x = tl.load(x_ptr + row * sx_m + s[:, None] * sx_s + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    return f64_to_act(tl.sum((pre[:, None] * x).to(tl.float64), axis=0), ROUND_BF16)


@triton.jit
def _mhc_finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_ptr, comb_ptr, D, NMIX, SPLITS,
                       ITERS, norm_eps, hc_eps_bits, sx_m, sx_s, sy_m, HEAD: tl.constexpr, NORM: tl.constexpr,
                       ROUND_BF16: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    NPART = NMIX + 1
    s = tl.arange(0, HC)
    eps64 = hc_eps_bits.to(tl.float64, bitcast=True)
    eps32 = eps64.to(tl.float32)
    ms = (_partial_sum(part_ptr, row, SPLITS, NPART, NMIX, True) / (HC * D)).to(tl.float32)
    r = rsqrt_f32(ms, norm_eps)  # mixing logits = projection · rsqrt(mean of the n·D squares + eps)
    s0 = tl.load(scale_ptr)
    m_pre = _partial_sum(part_ptr, row, SPLITS, NPART, s, s < HC).to(tl.float32) * r
    pre = sigmoid_f64((m_pre * s0 + tl.load(base_ptr + s)).to(tl.float64)).to(tl.float32) + eps32
    if not HEAD:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        m_post = _partial_sum(part_ptr, row, SPLITS, NPART, HC + s, s < HC).to(tl.float32) * r
        post = 2.0 * sigmoid_f64((m_post * s1 + tl.load(base_ptr + HC + s)).to(tl.float64)).to(tl.float32)
        cc = 2 * HC + s[:, None] * HC + s[None, :]
        m_comb = _partial_sum(part_ptr, row, SPLITS, NPART, cc, cc < NMIX).to(tl.float32) * r
        c = _sinkhorn(m_comb * s2 + tl.load(base_ptr + cc), ITERS, eps64)
        tl.store(post_ptr + row * HC + s, post)
        tl.store(comb_ptr + row * (HC * HC) + s[:, None] * HC + s[None, :], c.to(tl.float32))
    if NORM:
        sq = tl.zeros((BLOCK_D,), tl.float64)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            u = _stream_sum(x_ptr, row, sx_m, sx_s, pre, d, d < D, s, ROUND_BF16).to(tl.float64)
            sq += u * u
        rn = rsqrt_f32((tl.sum(sq, axis=0) / D).to(tl.float32), norm_eps)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        u = _stream_sum(x_ptr, row, sx_m, sx_s, pre, d, d < D, s, ROUND_BF16)
        if NORM:
            u = to_act(tl.load(w_ptr + d, mask=d < D, other=0.0) * (u * rn), ROUND_BF16)
        tl.store(y_ptr + row * sy_m + d, u.to(y_ptr.dtype.element_ty), mask=d < D)


# ============================================================================================ one launch per site
@triton.jit
def _mhc_site_kernel(x_ptr, out_ptr, post_ptr, comb_ptr, xn_ptr, fn_ptr, part_ptr, cnt_ptr, base_ptr, scale_ptr,
                     w_ptr, y_ptr, post_out_ptr, comb_out_ptr, slot_ptr, idx_ptr, sh_ptr, D, NMIX, SPLITS, PER,
                     ITERS, norm_eps, hc_eps_bits, sx_m, sx_s, so_m, sxn_m, sxn_s, sfn, sy_m, M, n_shared,
                     expert_offset, n_local, APPLY_POST: tl.constexpr, HEAD: tl.constexpr,
                     NORM: tl.constexpr, ROUND_BF16: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DN: tl.constexpr,
                     SPLIT_TAIL: tl.constexpr = False, MOE_OUT: tl.constexpr = False, TOPK: tl.constexpr = 1,
                     PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    split = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    NPART = NMIX + 1
    s = tl.arange(0, HC)
    j = tl.arange(0, BLOCK_J)
    d_lo = split * PER
    d_hi = tl.minimum(d_lo + PER, D)
    if APPLY_POST:
        post = tl.load(post_ptr + row * HC + s)
        comb = tl.load(comb_ptr + row * (HC * HC) + s[:, None] * HC + s[None, :]).to(tl.float64)  # comb[j, k]
    # ---- the mix of this program's columns: X' (with post), partial projections and sum of squares (fp64)
    acc = tl.zeros((BLOCK_J,), tl.float64)
    sq = tl.zeros((BLOCK_D,), tl.float64)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < d_hi
        x = tl.load(x_ptr + row * sx_m + s[:, None] * sx_s + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
        if APPLY_POST:
            if MOE_OUT:  # the sub-layer's output from the MoE's parts (its combine and output launches fused here)
                o = moe_output_columns(slot_ptr, idx_ptr, sh_ptr, row, d, dm, D, M, n_shared, expert_offset, n_local,
                                     TOPK, ROUND_BF16)
            else:
                o = tl.load(out_ptr + row * so_m + d, mask=dm, other=0.0).to(tl.float32)
            # Σ_j comb[j, k]·X[j, d]: exact products, summed in fp64 and rounded once (the reference's einsum)
            mixed = tl.sum(comb[:, :, None] * x.to(tl.float64)[:, None, :], axis=0).to(tl.float32)
            x = to_act(post[:, None] * o[None, :] + mixed, ROUND_BF16)
            tl.store(xn_ptr + row * sxn_m + s[:, None] * sxn_s + d[None, :], x.to(xn_ptr.dtype.element_ty),
                     mask=dm[None, :])
        x64 = x.to(tl.float64)
        sq += tl.sum(x64 * x64, axis=0)
        f = tl.load(fn_ptr + j[:, None, None] * sfn + s[None, :, None] * D + d[None, None, :],
                    mask=(j < NMIX)[:, None, None] & dm[None, None, :], other=0.0).to(tl.float64)
        acc += tl.sum(tl.sum(f * x64[None, :, :], axis=2), axis=1)
    pbase = part_ptr + row * SPLITS * NPART
    tl.store(pbase + split * NPART + j, acc, mask=j < NMIX)
    tl.store(pbase + split * NPART + NMIX, tl.sum(sq, axis=0))
    ticket = take_ticket(cnt_ptr + row)
    if SPLIT_TAIL:  # the last two programs finish together: the rows here, the Sinkhorn in the one before
        if ticket == SPLITS - 1:
            r = _mean_square_rsqrt(pbase, SPLITS, NPART, NMIX, D, norm_eps, HC, BLOCK_S)
            _site_rows(x_ptr, xn_ptr, pbase, base_ptr, scale_ptr, w_ptr, y_ptr, r, row, D, SPLITS, NPART, norm_eps,
                       hc_eps_bits, sx_m, sx_s, sxn_m, sxn_s, sy_m, APPLY_POST, NORM, ROUND_BF16, HC, BLOCK_S,
                       BLOCK_DN)
            _finish_tail(cnt_ptr + row, SPLITS)
        if ticket == SPLITS - 2:
            _await_tickets(cnt_ptr + row, SPLITS)
            r = _mean_square_rsqrt(pbase, SPLITS, NPART, NMIX, D, norm_eps, HC, BLOCK_S)
            _site_mix_gates(pbase, base_ptr, scale_ptr, post_out_ptr, comb_out_ptr, r, row, SPLITS, NPART, ITERS,
                            hc_eps_bits, HC, BLOCK_S)
            _finish_tail(cnt_ptr + row, SPLITS)
    else:
        if ticket == SPLITS - 1:
            # ---- the last program of the row: partials summed in split order, gates, RMSNorm of u, Sinkhorn
            r = _mean_square_rsqrt(pbase, SPLITS, NPART, NMIX, D, norm_eps, HC, BLOCK_S)
            _site_rows(x_ptr, xn_ptr, pbase, base_ptr, scale_ptr, w_ptr, y_ptr, r, row, D, SPLITS, NPART, norm_eps,
                       hc_eps_bits, sx_m, sx_s, sxn_m, sxn_s, sy_m, APPLY_POST, NORM, ROUND_BF16, HC, BLOCK_S,
                       BLOCK_DN)
            if not HEAD:
                _site_mix_gates(pbase, base_ptr, scale_ptr, post_out_ptr, comb_out_ptr, r, row, SPLITS, NPART,
                                ITERS, hc_eps_bits, HC, BLOCK_S)
            tl.store(cnt_ptr + row, 0)  # the row's counter, ready for the next launch


@triton.jit
def _mean_square_rsqrt(pbase, SPLITS, NPART, NMIX, D, norm_eps, HC: tl.constexpr, BLOCK_S: tl.constexpr):
    """``rsqrt(mean square + eps)`` of the row's streams from the programs' partial sums, in split order."""
    sp = tl.arange(0, BLOCK_S)
    ms = tl.sum(tl.load(pbase + sp * NPART + NMIX, mask=sp < SPLITS, other=0.0, cache_modifier=".cg"), axis=0)
    return rsqrt_f32((ms / (HC * D)).to(tl.float32), norm_eps)  # logits = projection · rsqrt(mean square + eps)


@triton.jit
def _site_rows(x_ptr, xn_ptr, pbase, base_ptr, scale_ptr, w_ptr, y_ptr, r, row, D, SPLITS, NPART, norm_eps,
               hc_eps_bits, sx_m, sx_s, sxn_m, sxn_s, sy_m, APPLY_POST: tl.constexpr, NORM: tl.constexpr,
               ROUND_BF16: tl.constexpr, HC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DN: tl.constexpr):
    """The pre gates from the partials (``r``: :func:`_mean_square_rsqrt`) and the sub-layer's input
    ``u = Σ pre·X`` (RMSNormed with ``NORM``)."""
    src_ptr = xn_ptr if APPLY_POST else x_ptr
    s_m = sxn_m if APPLY_POST else sx_m
    s_s = sxn_s if APPLY_POST else sx_s
    s = tl.arange(0, HC)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < SPLITS
    eps32 = hc_eps_bits.to(tl.float64, bitcast=True).to(tl.float32)
    s0 = tl.load(scale_ptr)
    m_pre = tl.sum(tl.load(pbase + sp[None, :] * NPART + s[:, None], mask=sp_ok[None, :], other=0.0,
                           cache_modifier=".cg"), axis=1).to(tl.float32) * r
    pre = sigmoid_f64((m_pre * s0 + tl.load(base_ptr + s)).to(tl.float64)).to(tl.float32) + eps32
    if NORM:
        sqn = tl.zeros((BLOCK_DN,), tl.float64)
        for d0 in range(0, D, BLOCK_DN):  # u rounded as the reference, written, its squares summed
            d = d0 + tl.arange(0, BLOCK_DN)
            xs = tl.load(src_ptr + row * s_m + s[:, None] * s_s + d[None, :], mask=(d < D)[None, :], other=0.0,
                         cache_modifier=".cg").to(tl.float32)
            u = f64_to_act(tl.sum((pre[:, None] * xs).to(tl.float64), axis=0), ROUND_BF16)
            tl.store(y_ptr + row * sy_m + d, u.to(y_ptr.dtype.element_ty), mask=d < D)
            u64 = u.to(tl.float64)
            sqn += u64 * u64
        rn = rsqrt_f32((tl.sum(sqn, axis=0) / D).to(tl.float32), norm_eps)
        tl.debug_barrier()  # u of every column written before any thread reads another's back
        for d0 in range(0, D, BLOCK_DN):
            d = d0 + tl.arange(0, BLOCK_DN)
            u = tl.load(y_ptr + row * sy_m + d, mask=d < D, other=0.0).to(tl.float32)
            yv = to_act(tl.load(w_ptr + d, mask=d < D, other=0.0) * (u * rn), ROUND_BF16)
            tl.store(y_ptr + row * sy_m + d, yv.to(y_ptr.dtype.element_ty), mask=d < D)
    else:
        for d0 in range(0, D, BLOCK_DN):
            d = d0 + tl.arange(0, BLOCK_DN)
            xs = tl.load(src_ptr + row * s_m + s[:, None] * s_s + d[None, :], mask=(d < D)[None, :], other=0.0,
                         cache_modifier=".cg").to(tl.float32)
            u = f64_to_act(tl.sum((pre[:, None] * xs).to(tl.float64), axis=0), ROUND_BF16)
            tl.store(y_ptr + row * sy_m + d, u.to(y_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _site_mix_gates(pbase, base_ptr, scale_ptr, post_out_ptr, comb_out_ptr, r, row, SPLITS, NPART, ITERS,
                    hc_eps_bits, HC: tl.constexpr, BLOCK_S: tl.constexpr):
    """The next site's ``post`` gates and ``comb`` matrix (Sinkhorn) from the partials (``r``:
    :func:`_mean_square_rsqrt`)."""
    s = tl.arange(0, HC)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < SPLITS
    eps64 = hc_eps_bits.to(tl.float64, bitcast=True)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    m_post = tl.sum(tl.load(pbase + sp[None, :] * NPART + HC + s[:, None], mask=sp_ok[None, :], other=0.0,
                            cache_modifier=".cg"), axis=1).to(tl.float32) * r
    post_n = 2.0 * sigmoid_f64((m_post * s1 + tl.load(base_ptr + HC + s)).to(tl.float64)).to(tl.float32)
    cc = 2 * HC + s[:, None] * HC + s[None, :]
    m_comb = tl.sum(tl.load(pbase + sp[None, None, :] * NPART + cc[:, :, None], mask=sp_ok[None, None, :],
                            other=0.0, cache_modifier=".cg"), axis=2).to(tl.float32) * r
    c = _sinkhorn(m_comb * s2 + tl.load(base_ptr + cc), ITERS, eps64)
    tl.store(post_out_ptr + row * HC + s, post_n)
    tl.store(comb_out_ptr + row * (HC * HC) + s[:, None] * HC + s[None, :], c.to(tl.float32))


@triton.jit
def _sinkhorn(logits, ITERS, eps64):
    """``comb`` from its logits (fp32): row softmax (+eps), column normalisation, then ``ITERS−1`` × (rows,
    columns), all in fp64 (the reference's order)."""
    c = logits.to(tl.float64)
    e = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = e * (1.0 / tl.sum(e, axis=1))[:, None] + eps64
    c = c / (tl.sum(c, axis=0)[None, :] + eps64)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + eps64)
        c = c / (tl.sum(c, axis=0)[None, :] + eps64)
    return c


@triton.jit
def _await_tickets(cnt_ptr, SPLITS):
    """Wait until every program of the row has drawn its ticket (its partials then visible: acquire). Bounded: a
    scheduler that never ran the last program would give a wrong ``comb`` (which the tests catch), not a hang."""
    n = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    spins = 0
    while (n < SPLITS) & (spins < 1 << 24):
        n = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        spins += 1


@triton.jit
def _finish_tail(cnt_ptr, SPLITS):
    """The second of the two finishing programs resets the row's counter for the next launch."""
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == SPLITS + 1:
        tl.store(cnt_ptr, 0)


def site_counters(device: torch.device, rows: int) -> torch.Tensor:
    """The per-row ticket counters of the one-launch kernel (:mod:`.tickets`' shared workspace)."""
    return counters(device, rows)


def _site(X, out, post, comb, fn, base, scale, norm_weight, head: bool, iters: int, norm_eps: float, hc_eps: float,
          geo: MhcSiteGeometry, moe: MoeOutput | None = None):
    """One launch of :func:`_mhc_site_kernel`: returns ``(X' or None, y [M, D], post [M, n], comb [M, n, n])``;
    ``moe`` instead of ``out``: the sub-layer's output summed from the MoE's parts in the kernel."""
    M, HC, D = _check(X)
    Xr = X.reshape(M, HC, D)
    apply_post = out is not None or moe is not None
    if moe is not None:
        moe.check(M, D, X.dtype)
        slots, idx, shared = moe.slots.contiguous(), moe.idx.contiguous(), moe.shared.contiguous()
    nmix = HC if head else (2 + HC) * HC
    xn = torch.empty_like(Xr) if apply_post else Xr
    y = torch.empty(M, D, dtype=X.dtype, device=X.device)
    post_n = torch.empty(M, HC, dtype=torch.float32, device=X.device)
    comb_n = torch.empty(M, HC, HC, dtype=torch.float32, device=X.device)
    if M:
        block_d = min(geo.block_d, triton.next_power_of_2(D))
        per = triton.cdiv(triton.cdiv(D, geo.splits), block_d) * block_d
        splits = triton.cdiv(D, per)
        part = torch.empty(M, splits, nmix + 1, dtype=torch.float64, device=X.device)
        outr = out.reshape(M, D) if out is not None else Xr
        norm = norm_weight is not None
        _mhc_site_kernel[(splits, M)](
            Xr, outr, post.reshape(M, HC).float().contiguous() if apply_post else Xr,
            comb.reshape(M, HC, HC).float().contiguous() if apply_post else Xr, xn, fn, part,
            site_counters(X.device, M), base.float().contiguous(), scale.float().contiguous(),
            norm_weight if norm else base, y, post_n, comb_n, slots if moe else Xr, idx if moe else Xr,
            shared if moe else Xr, D, nmix, splits, per, iters, float(norm_eps), f64_bits(hc_eps), Xr.stride(0),
            Xr.stride(1), outr.stride(0), xn.stride(0), xn.stride(1), fn.stride(0), y.stride(0), M,
            shared.shape[0] if moe else 0, moe.expert_offset if moe else 0, moe.n_local if moe else 0,
            APPLY_POST=apply_post, HEAD=head, NORM=norm, ROUND_BF16=X.dtype == torch.bfloat16, HC=HC,
            BLOCK_D=block_d, BLOCK_J=max(2, triton.next_power_of_2(nmix)),
            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_DN=min(geo.block_dn, triton.next_power_of_2(D)),
            SPLIT_TAIL=geo.split_tail and not head and splits >= 2 and not interpreting(),
            MOE_OUT=moe is not None, TOPK=idx.shape[1] if moe else 1,
            num_warps=geo.num_warps, **LAUNCH_EXACT, **pdl_args(Xr.device))
    return (xn if apply_post else None), y, post_n, comb_n


# ============================================================================================ launchers
def _check(X: torch.Tensor) -> tuple[int, int, int]:
    if X.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"mHC kernels take bf16 or fp32 streams, got {X.dtype}")
    HC, D = X.shape[-2:]
    assert HC & (HC - 1) == 0, f"mHC: {HC} streams (a power of two is required)"
    assert X.stride(-1) == 1, "mHC: streams contiguous along D"
    return X.numel() // (HC * D), HC, D


def _mix(X, out, post, comb, fn, apply_post: bool, nmix: int, geo: MhcGeometry):
    """One mix launch; returns ``(X' or None, partials or None)``."""
    M, HC, D = _check(X)
    Xr = X.reshape(M, HC, D)
    xn = torch.empty_like(Xr) if apply_post else Xr
    mix = fn is not None
    if mix:  # fp32 → fp64 is exact; widened once here, not once per use in every thread (see the kernel)
        fn = fn.to(torch.float64)
    part = torch.empty(M, geo.splits, nmix + 1, dtype=torch.float64, device=X.device) if mix else xn
    if M:
        outr = out.reshape(M, D) if apply_post else Xr
        _mhc_mix_kernel[(triton.cdiv(M, geo.block_m), geo.splits)](
            Xr, outr, post.reshape(M, HC).contiguous() if apply_post else Xr,
            comb.reshape(M, HC, HC).contiguous() if apply_post else Xr, xn,
            fn if mix else Xr, part, M, D, nmix, geo.splits, Xr.stride(0), Xr.stride(1), outr.stride(0),
            xn.stride(0), xn.stride(1), fn.stride(0) if mix else 0, APPLY_POST=apply_post, MIX=mix,
            ROUND_BF16=X.dtype == torch.bfloat16, HC=HC, BLOCK_M=geo.block_m, BLOCK_D=geo.block_d,
            BLOCK_J=max(2, triton.next_power_of_2(nmix)), num_warps=geo.num_warps, **LAUNCH_EXACT,
            **pdl_args(Xr.device))
    return (xn if apply_post else None), (part if mix else None)


def _finish(Xr, part, base, scale, norm_weight, head: bool, iters: int, norm_eps: float, hc_eps: float,
            lead: tuple, splits: int):
    M, HC, D = Xr.shape
    nmix = HC if head else (2 + HC) * HC
    y = torch.empty(M, D, dtype=Xr.dtype, device=Xr.device)
    post = torch.empty(M, HC, dtype=torch.float32, device=Xr.device)
    comb = torch.empty(M, HC, HC, dtype=torch.float32, device=Xr.device)
    if M:
        norm = norm_weight is not None
        _mhc_finish_kernel[(M,)](Xr, part, base.float().contiguous(), scale.float().contiguous(),
                                 norm_weight if norm else base, y, post, comb, D, nmix, splits, iters,
                                 float(norm_eps), f64_bits(hc_eps), Xr.stride(0), Xr.stride(1), y.stride(0),
                                 HEAD=head, NORM=norm, ROUND_BF16=Xr.dtype == torch.bfloat16, HC=HC,
                                 BLOCK_D=min(1024, triton.next_power_of_2(D)), num_warps=4, **LAUNCH_EXACT,
                                 **pdl_args(Xr.device))
    return y.view(*lead, D), post.view(*lead, HC), comb.view(*lead, HC, HC)


def _one_launch(rows: int, geometry) -> bool:
    """The one-launch site kernel: decode row counts, unless the caller asked for the mix/finish pair."""
    return isinstance(geometry, MhcSiteGeometry) or (geometry is None and 0 < rows <= SITE_MAX_ROWS)


def _site_geometry(rows: int, D: int, geometry) -> MhcSiteGeometry:
    return geometry if isinstance(geometry, MhcSiteGeometry) else MhcSiteGeometry.for_rows(rows, D)


def hc_pre_norm(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm_weight: torch.Tensor, iters: int, norm_eps: float, hc_eps: float,
                geometry: MhcGeometry | MhcSiteGeometry | None = None):
    """``X [..., n, D]`` → ``(RMSNorm(Σ_j pre_j X_j) [..., D], post [..., n], comb [..., n, n])`` for one site's
    ``fn [(2+n)·n, n·D]``, ``base``, ``scale [3]`` and the sub-layer's norm weight."""
    M, HC, D = _check(X)
    if _one_launch(M, geometry):
        _, y, post, comb = _site(X, None, None, None, fn, base, scale, norm_weight, False, iters, norm_eps, hc_eps,
                                 _site_geometry(M, D, geometry))
        return y.view(*X.shape[:-2], D), post.view(*X.shape[:-2], HC), comb.view(*X.shape[:-2], HC, HC)
    geo = geometry or MhcGeometry.for_rows(M, D)
    _, part = _mix(X, None, None, None, fn, False, (2 + HC) * HC, geo)
    return _finish(X.reshape(M, HC, D), part, base, scale, norm_weight, False, iters, norm_eps, hc_eps,
                   X.shape[:-2], geo.splits)


def hc_post_pre_norm(out: torch.Tensor | None, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, iters: int,
                     norm_eps: float, hc_eps: float, geometry: MhcGeometry | MhcSiteGeometry | None = None,
                     moe: MoeOutput | None = None):
    """:func:`hc_post` of one sub-layer and :func:`hc_pre_norm` of the next: ``(X', x, post', comb')``. ``moe``
    (with ``out`` None; the one-launch site only): the sub-layer is a MoE whose output the site sums from its
    parts (:class:`MoeOutput`) — the MoE's combine and output launches fused into the site, the same bits."""
    M, HC, D = _check(X)
    if (moe is None) == (out is None):
        raise ValueError("hc_post_pre_norm: give the sub-layer's output or the MoE's parts, not both")
    if moe is not None and not _one_launch(M, geometry):
        raise ValueError(f"hc_post_pre_norm: the MoE's parts are summed by the one-launch site only "
                         f"(≤ {SITE_MAX_ROWS} rows, an MhcSiteGeometry), got {M} rows")
    if _one_launch(M, geometry):
        xn, y, post_n, comb_n = _site(X, out, post, comb, fn, base, scale, norm_weight, False, iters, norm_eps,
                                      hc_eps, _site_geometry(M, D, geometry), moe)
        lead = X.shape[:-2]
        return xn.view(X.shape), y.view(*lead, D), post_n.view(*lead, HC), comb_n.view(*lead, HC, HC)
    geo = geometry or MhcGeometry.for_rows(M, D)
    xn, part = _mix(X, out, post, comb, fn, True, (2 + HC) * HC, geo)
    return (xn.view(X.shape), *_finish(xn, part, base, scale, norm_weight, False, iters, norm_eps, hc_eps,
                                        X.shape[:-2], geo.splits))


def hc_post(out: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            geometry: MhcGeometry | None = None) -> torch.Tensor:
    """``X'_k = post_k·out + Σ_j comb_jk·X_j``: ``out [..., D]``, ``X [..., n, D]`` → ``X.dtype``."""
    M, HC, D = _check(X)
    geo = geometry or MhcGeometry.for_rows(M, D)
    xn, _ = _mix(X, out, post.float(), comb.float(), None, True, 0, geo)
    return xn.view(X.shape)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, geometry: MhcGeometry | MhcSiteGeometry | None = None) -> torch.Tensor:
    """The final collapse ``Σ_j (sigmoid(m_j·scale + base_j) + eps)·X_j`` with ``fn [n, n·D]`` → ``X.dtype``."""
    M, HC, D = _check(X)
    if _one_launch(M, geometry):
        y = _site(X, None, None, None, fn, base, scale, None, True, 1, norm_eps, hc_eps,
                  _site_geometry(M, D, geometry))[1]
        return y.view(*X.shape[:-2], D)
    geo = geometry or MhcGeometry.for_rows(M, D)
    _, part = _mix(X, None, None, None, fn, False, HC, geo)
    return _finish(X.reshape(M, HC, D), part, base, scale, None, True, 1, norm_eps, hc_eps, X.shape[:-2],
                   geo.splits)[0]


__all__ = ["MhcGeometry", "MhcSiteGeometry", "SITE_MAX_ROWS", "site_counters", "hc_pre_norm", "hc_post_pre_norm",
           "hc_post", "hc_head"]
