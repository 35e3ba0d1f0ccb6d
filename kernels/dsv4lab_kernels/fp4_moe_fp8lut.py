"""The grouped FP4 MoE on FP8 tensor cores, route ``fp8lut``: each packed E2M1 weight tile is turned into E4M3
bytes by a per-group byte table once per work item and multiplied with all the item's rows by FP8 MMAs (wgmma
E4M3 × E4M3 on sm_90); the activations are the reference's own E4M3 values and scales. :mod:`.fp4_moe_grouped`
allocates the buffers and calls :func:`gate_up` / :func:`down` here for this route.

**Work.** A work item is (sorted block of ``ROWS`` rows of one expert, N tile) (:func:`.moe_sort.expert_work_item`:
numbered expert by expert, tile by tile, block by block, so the programs that run together share each weight tile
and the expert's rows through L2); ``persistent`` launches one program per SM walking the items. The weight tile is
the MMA's first operand (``accᵀ[N, rows] = W · Xᵀ``), so the rows of a block are its N (16 … 128) and the weights
are decoded once for all of them. Per 128-wide K tile the packed bytes and their scales arrive by Triton's
asynchronous copies (``num_stages`` deep; a row's four scale bytes as one word), are decoded to E4M3 and staged
through shared memory into the MMA's operand; the block's activation rows (gathered by token: even columns then odd
ones, as ``quantize_activations(q_split=True)`` lays them out) are the second operand. No activation row is masked:
a padding row reads a row that exists and only reaches its own MMA column, which is never stored.

* **Gate/up**: an item is a block and the 128 columns of one h quantization block, computed as two halves of 64;
  each half is one MMA operand of 128 weight rows — gate's 64 then up's 64 (w3 addressed from w1 by their byte
  distance, so the copies stay 16-byte aligned), one warp group each at 8 warps — then split, rounded to bf16 and
  taken through the reference's activation (:func:`.swiglu.routed_swiglu`); after both halves h is quantized per
  row over its 128 columns and written in the layout down reads, its scales column block by column block.
* **Down**: an item is a block and 128 output columns; h's scales are read per sorted row, contiguously.

**Numerics (exact products).** A tile's weights are ``e2m1 · 2^(s − 127)`` with one scale byte ``s`` per 32 along
K. With ``top`` the largest scale byte of a reference block — one weight row's four groups of the K tile
(``ref="row"``) or the whole tile (``ref="tile"``: 128 weight rows × 128, precomputed per bank by :func:`tile_tops`)
— each weight is ``w = e4m3(e2m1 · 2^j) · 2^(top − 133)`` with ``j = s − top + 6``. For ``j`` in [−5, 6] (a block's
scales within :data:`LUT_MAX_SPREAD` = 11 binades) every ``e2m1 · 2^j`` is a normal E4M3 value or zero (0.5 · 2^-5
= 2^-6 is E4M3's smallest normal, 6 · 2^6 = 384 ≤ 448): the E4M3 weight is exact, and the activation ``x_q · s_x``
is exact by the reference's own rule. Per 128-wide K tile (the activation's scale block) the MMA sums the tile's
exact products ``e4m3 · x_q`` into a fresh partial, which is then **promoted**: multiplied by the powers of two
``2^(top − 133) · s_x`` (exact) and added to the fp32 accumulator. That is the ``fp8_mma`` accumulation model
(derived in :func:`dsv4lab.tools.verify.op_bounds.dot.promoted_fp8_model`: ``γ_128(2^-13)`` of ``Σ|terms|``
inside a tile, Hopper's FP8 MMA keeping ~14 bits of its running sum, the tiles' partials summed in fp32).
``ref="tile"`` costs one multiply–add per accumulator element and K tile, ``ref="row"`` one more; ``"auto"`` takes
``tile`` wherever the bank's scales allow it. A bank outside the window (:func:`lut_route_exact`, scale bytes 7 …
254) is refused: the backend then takes the ``fp8`` route (14 binades) or ``bf16``.

**The decode.** For a group with ``d = j + 5`` in [0, 11] the E4M3 bytes of the eight magnitudes are two 32-bit
words: ``LUT_LO + 8d · 0x01010100`` (codes 0–3; code 0 stays 0) and ``LUT_HI + 8d · 0x01010101`` (codes 4–7) — each
byte is its magnitude's E4M3 at ``d = 0`` plus ``d`` in the exponent field, never carrying (the largest is 0x7C).
``"asm"`` looks four weights up with one ``prmt`` (a byte permute indexed by four 3-bit codes) after gathering the
codes' magnitudes into its selector, and ORs the sign bits in: 13 SASS instructions per eight weights (inline PTX,
GPUs only; checked once per process against the portable decode on every byte and every ``d`` by
:func:`lut_decode_works`). One call takes four packed bytes and one table: the four must be consecutive bytes of one
row (then they lie in one 16-byte group), which the layout Triton gives the tile does — ``sizePerThread`` 16 along
the bytes here — and ``scripts/compile_prefill_moe.py`` checks in the TTGIR of every configuration it compiles. ``"portable"`` computes the same bytes element-wise with integer operations (the CPU
interpreter's; a GPU's fallback, ~3.7× the K loop's instructions); ``"auto"`` takes ``asm`` where it works.
``scripts/compile_prefill_moe.py`` compiles both stages for sm_90 on a machine without a GPU and counts the K loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import interpreting, pow2
from .fp8_gemm import pow2_exponent, quantize_block_fp8, to_bf16
from .moe_sort import expert_work_item
from .rowops import DeviceProbe, once_per_tensors
from .swiglu import routed_swiglu

ROUTE = "fp8lut"
LUT_MAX_SPREAD = 11
"""Binades a reference block's 1×32 scales may span for the E4M3 weights to be exact (``j`` in [−5, 6])."""
LUT_SCALE_BYTES = (7, 254)
"""Scale bytes the route takes: 255 is E8M0's NaN; below 7 the promotion factor ``2^(top − 133)`` is no fp32
normal (weights ~2^-120: none in a trained model)."""
REFS = ("auto", "row", "tile")
DECODES = ("auto", "asm", "portable")
LUT_LO = tl.constexpr(0x14100800)  # E4M3 of the codes 0..3 (0, 0.5, 1, 1.5) times 2^-5, byte i = code i
LUT_HI = tl.constexpr(0x24201C18)  # codes 4..7 (2, 3, 4, 6) times 2^-5


# ============================================================================================ decode
@triton.jit
def group_tables(d):
    """The two table words of each group with exponent offset ``d`` (int32, [0, 11])."""
    step = d << 3
    return LUT_LO + step * 0x01010100, LUT_HI + step * 0x01010101


# Four packed bytes ($2: weights 2c in the low nibbles, 2c+1 in the high ones) and their group's table words ($3:
# codes 0-3, $7: codes 4-7; $4-$6 and $8-$10 repeat them, one per byte of the pack) → the E4M3 bytes of the four
# low-nibble weights ($0) and the four high-nibble weights ($1). The magnitudes of byte i's two nibbles are gathered
# into selector nibble i (low nibbles: bits 0-15, high: 16-31), one prmt per four weights reads the table, and
# each sign bit is moved to bit 7 of its byte.
# (a tl.constexpr: a @jit function may read no other global)
_DECODE_E4M3_PTX = tl.constexpr("""
{
.reg .b32 s4, s8, a, b, lo, hi, sel;
shr.b32 s4, $2, 4;
shr.b32 s8, $2, 8;
and.b32 a, $2, 0x00070007;
and.b32 b, s4, 0x00700070;
or.b32 lo, a, b;
and.b32 a, s4, 0x00070007;
and.b32 b, s8, 0x00700070;
or.b32 hi, a, b;
prmt.b32 sel, lo, hi, 0x6420;
prmt.b32 lo, $3, $7, sel;
shr.b32 sel, sel, 16;
prmt.b32 hi, $3, $7, sel;
shl.b32 a, $2, 4;
and.b32 a, a, 0x80808080;
or.b32 $0, lo, a;
and.b32 b, $2, 0x80808080;
or.b32 $1, hi, b;
}
""")


@triton.jit
def _nibble_e4m3(code, sign, d):
    """The E4M3 byte of one E2M1 magnitude ``code`` (0..7) times ``2^(d − 5)``; ``sign`` is 0 or 0x80."""
    mag = tl.where(code == 1, 0, code << 2) + 8 + (d << 3)  # code 1 (0.5) has no mantissa bit in E4M3
    return tl.where(code == 0, 0, mag) | sign


@triton.jit
def decode_tile(wb, d, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Packed bytes ``wb [BLOCK_N, BLOCK_K/2]`` (uint8) and the exponent offsets ``d [BLOCK_N, BLOCK_K/32]`` (int32)
    of their groups → the even-column (low nibble) and odd-column (high nibble) weights as E4M3
    ``[BLOCK_N, BLOCK_K/2]`` each, bit-identical whichever ``ASM``."""
    G: tl.constexpr = BLOCK_K // 32
    if ASM:
        lut_lo, lut_hi = group_tables(d)
        lut_lo = tl.reshape(tl.broadcast_to(lut_lo[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, BLOCK_K // 2))
        lut_hi = tl.reshape(tl.broadcast_to(lut_hi[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, BLOCK_K // 2))
        lo, hi = tl.inline_asm_elementwise(_DECODE_E4M3_PTX, "=r,=r,r,r,r,r,r,r,r,r,r", [wb, lut_lo, lut_hi],
                                           dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        dd = tl.reshape(tl.broadcast_to(d[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, BLOCK_K // 2))
        b = wb.to(tl.int32)
        lo = _nibble_e4m3(b & 7, (b & 8) << 4, dd).to(tl.uint8)
        hi = _nibble_e4m3((b >> 4) & 7, b & 0x80, dd).to(tl.uint8)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter computes fp8 dots wrongly: feed it fp32 (the values are exact in fp32)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


# ============================================================================================ one K tile
@triton.jit
def _load_rows(x_ptr, xs_ptr, xrow, srow, k0, K, stride_xm, stride_xsr, stride_xsk, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr):
    """The block's activation rows for the K tile at ``k0``: the even and odd columns ``[BLOCK_K/2, ROWS]`` (E4M3,
    split layout; row ``xrow`` of ``x``) and their scales ``[ROWS]`` of the tile's 128-column block (entry ``srow``
    of the scale table). No row is masked: a padding row reads a row that exists (token 0, or a sorted row whose
    contents are garbage), which only ever reaches its own MMA column, and that column is never stored — so the
    copies need no per-row predicate and the scale loads pair up. ``EVEN_K``: ``K`` is a multiple of ``BLOCK_K``
    (no column mask either)."""
    kj = tl.arange(0, BLOCK_K // 2)
    x_rows = x_ptr + xrow[None, :].to(tl.int64) * stride_xm + (k0 // 2 + kj)[:, None]
    if EVEN_K:
        xe = tl.load(x_rows)
        xo = tl.load(x_rows + K // 2)
    else:
        m = ((k0 // 2 + kj) < K // 2)[:, None]
        xe = tl.load(x_rows, mask=m, other=0.0)
        xo = tl.load(x_rows + K // 2, mask=m, other=0.0)
    sx = tl.load(xs_ptr + (k0 // 128) * stride_xsk + srow * stride_xsr)
    return xe, xo, sx


@triton.jit
def _tile_product(acc, w_rows, s_rows, a_ok, k0, K, xe, xo, sx, top_ptr, BLOCK_A: tl.constexpr,
                  BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                  TILE_REF: tl.constexpr, UPCAST: tl.constexpr):
    """``acc[BLOCK_A, ROWS] += W · X_tileᵀ`` for the K tile at ``k0``, where weight row ``a`` starts at the packed
    bytes ``w_rows[a]`` and the scale bytes ``s_rows[a]`` (``a_ok``: the row exists): the weights decoded to E4M3
    once, two FP8 MMAs (even and odd columns) into a fresh partial, promoted to ``acc`` with the scales (see the
    module docstring). ``TILE_REF``: the tile's reference scale is read at ``top_ptr`` (:func:`tile_tops`), else
    each row's is its largest scale in the tile."""
    G: tl.constexpr = BLOCK_K // 32
    kj = tl.arange(0, BLOCK_K // 2)
    gi = tl.arange(0, G)
    if EVEN_K:
        wb = tl.load(w_rows[:, None] + (k0 // 2 + kj)[None, :], mask=a_ok[:, None], other=0)
        if BLOCK_K == 128:  # the four scale bytes of a row's tile as one aligned word (a copy the pipeline takes)
            word = tl.load((s_rows + k0 // 32).to(tl.pointer_type(tl.int32)), mask=a_ok, other=0)
            sc = (word[:, None] >> (8 * gi)[None, :]) & 0xFF
        else:
            sc = tl.load(s_rows[:, None] + k0 // 32 + gi[None, :], mask=a_ok[:, None], other=0).to(tl.int32)
    else:
        wb = tl.load(w_rows[:, None] + (k0 // 2 + kj)[None, :],
                     mask=a_ok[:, None] & ((k0 // 2 + kj) < K // 2)[None, :], other=0)
        sc = tl.load(s_rows[:, None] + k0 // 32 + gi[None, :], mask=a_ok[:, None] & ((k0 + 32 * gi) < K)[None, :],
                     other=0).to(tl.int32)  # 0: never the top
    if TILE_REF:
        top = tl.load(top_ptr + k0 // BLOCK_K)
        d = sc - top + 11
    else:
        top = tl.max(sc, axis=1)
        d = sc - top[:, None] + 11
    w_lo, w_hi = decode_tile(wb, d, BLOCK_A, BLOCK_K, ASM)
    part = _mma(w_lo, xe, tl.zeros((BLOCK_A, ROWS), dtype=tl.float32), UPCAST)
    part = _mma(w_hi, xo, part, UPCAST)
    unit = pow2(tl.maximum(top - 133, -126))  # 2^(top − 127 − 6): the E4M3 weights' unit (rows of a padded tile: 0)
    # E8M0's NaN byte as the reference block's top: every weight of the block is NaN there, so its products are
    # (a bank refuses such bytes, :func:`lut_route_exact`, unless they mark experts never read: the decode's)
    unit = tl.where(top == 255, float("nan"), unit)
    if TILE_REF:
        acc += part * (unit * sx)[None, :]
    else:
        acc += part * (unit[:, None] * sx[None, :])
    return acc


@triton.jit
def project_rows(x_ptr, xs_ptr, xrow, srow, w_rows, s_rows, a_ok, top_ptr, K, stride_xm, stride_xsr, stride_xsk,
                 BLOCK_A: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr,
                 ASM: tl.constexpr, TILE_REF: tl.constexpr, UPCAST: tl.constexpr):
    """``accᵀ[BLOCK_A, ROWS] = W · Xᵀ`` over all of ``K``: the weight rows at ``w_rows`` / ``s_rows`` (``a_ok``:
    the row exists) against the activation rows ``xrow`` (scales at entry ``srow`` of the scale table), tile by
    tile (:func:`_load_rows`, :func:`_tile_product`) — the K loop of every kernel of the route, the grouped
    prefill's and the decode's (:mod:`.fp4_moe_decode_fp8lut`)."""
    acc = tl.zeros((BLOCK_A, ROWS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xe, xo, sx = _load_rows(x_ptr, xs_ptr, xrow, srow, k0, K, stride_xm, stride_xsr, stride_xsk, BLOCK_K, EVEN_K)
        acc = _tile_product(acc, w_rows, s_rows, a_ok, k0, K, xe, xo, sx, top_ptr, BLOCK_A, BLOCK_K, ROWS, EVEN_K,
                            ASM, TILE_REF, UPCAST)
    return acc


# ============================================================================================ stage 1: gate/up
@triton.jit
def gate_up_tile(x_ptr, xs_ptr, w1_ptr, s1_ptr, w3_delta, s3_delta, top_ptr, e, tok, rows, valid, slot, rw,
                 out0_ptr, out1_ptr, i0, D, I, limit, stride_xm, stride_xsr, stride_xsk, stride_we, stride_wn,
                 stride_se, stride_sn, stride_o0, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, FUSE: tl.constexpr, ASM: tl.constexpr, TILE_REF: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The ``HALF`` columns ``i0 …`` of gate and up for the block's rows as one MMA operand of ``2·HALF`` weight
    rows (the grouped prefill's item computes two such halves, the decode's program one —
    :mod:`.fp4_moe_decode_fp8lut`; gate's rows first, then up's: the two warp groups of an 8-warp program take one
    each; w3 and its scales are addressed as w1's plus the byte distances ``w3_delta`` / ``s3_delta``, so every row
    pointer keeps the 16-byte alignment the asynchronous copies need). ``FUSE``: returns h (fp32, bf16 values; 0
    outside the valid entries); else stores g and u at each slot's row and returns 0."""
    a = tl.arange(0, 2 * HALF)
    col = i0 + a % HALF
    a_ok = col < I
    up = (a >= HALF).to(tl.int64)
    w_rows = w1_ptr + (e.to(tl.int64) * stride_we + col.to(tl.int64) * stride_wn + up * w3_delta)
    s_rows = s1_ptr + (e.to(tl.int64) * stride_se + col.to(tl.int64) * stride_sn + up * s3_delta)
    acc = project_rows(x_ptr, xs_ptr, tok, rows, w_rows, s_rows, a_ok, top_ptr, D, stride_xm, stride_xsr, stride_xsk,
                       2 * HALF, BLOCK_K, ROWS, EVEN_K, ASM, TILE_REF, UPCAST)
    g, u = tl.split(tl.permute(tl.reshape(acc, (2, HALF, ROWS)), (1, 2, 0)))
    # the reference's Linear outputs bf16: round g and u before the activation
    g = to_bf16(g).to(tl.float32)
    u = to_bf16(u).to(tl.float32)
    rn = i0 + tl.arange(0, HALF)
    keep = (rn < I)[:, None] & valid[None, :]
    if FUSE:
        h = routed_swiglu(g, u, rw, limit, keep)
    else:
        off = slot[None, :].to(tl.int64) * stride_o0 + rn[:, None]
        tl.store(out0_ptr + off, g, mask=keep)
        tl.store(out1_ptr + off, u, mask=keep)
        h = tl.zeros((HALF, ROWS), dtype=tl.float32)
    return h


@triton.jit
def _store_h(out_ptr, h, ex, rows, valid, i0, I, stride_o, HALF: tl.constexpr):
    """h's columns ``i0 …`` quantized to E4M3 with the rows' scales ``2^ex``, stored at the sorted rows in the split
    layout stage 2 reads (even columns, then odd ones)."""
    rn = i0 + tl.arange(0, HALF)
    split = (rn % 2) * (I // 2) + rn // 2
    tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_o + split[:, None], quantize_block_fp8(h, ex[None, :]),
             mask=(rn < I)[:, None] & valid[None, :])


@triton.jit
def _gate_up_kernel(x_ptr, xs_ptr, w1_ptr, s1_ptr, w3_delta, s3_delta, tops_ptr, sorted_ptr, block_expert_ptr,
                    first_block_ptr, expert_blocks_ptr, used_blocks_ptr, rw_ptr, out0_ptr, out1_ptr, D, I, TOPK,
                    limit, stride_xm, stride_xsr, stride_xsk, stride_we, stride_wn, stride_se, stride_sn,
                    stride_te, stride_tn, stride_o0, stride_o1r, stride_o1k, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FUSE: tl.constexpr,
                    ASM: tl.constexpr, TILE_REF: tl.constexpr, UPCAST: tl.constexpr):
    """Gate/up: a work item is a sorted block and ``BLOCK_N`` (the 128-column quantization block of h) columns,
    computed as two halves (:func:`gate_up_tile`). The activation scales are read per sorted row (``xs`` is the
    table :func:`sorted_scales` makes). ``FUSE``: h quantized per row over the item's columns (``out0`` E4M3 at
    the sorted row, split layout; ``out1`` its scale, row stride ``stride_o1r``, column stride ``stride_o1k``); else
    g and u (bf16-rounded fp32) at each slot's row of ``out0`` / ``out1``."""
    HALF: tl.constexpr = BLOCK_N // 2
    n_tiles = tl.cdiv(I, BLOCK_N)
    total = tl.load(used_blocks_ptr) * n_tiles
    for w in range(tl.program_id(0), total, tl.num_programs(0)):  # one item per program unless persistent
        blk, tile, e = expert_work_item(w, n_tiles, block_expert_ptr, first_block_ptr, expert_blocks_ptr)
        rows = blk * ROWS + tl.arange(0, ROWS)
        slot = tl.load(sorted_ptr + rows)
        valid = slot >= 0
        tok = tl.where(valid, slot // TOPK, 0)
        if FUSE:
            rw = tl.load(rw_ptr + slot, mask=valid, other=0.0)
        else:
            rw = tl.zeros((ROWS,), dtype=tl.float32)
        top = tops_ptr + e.to(tl.int64) * stride_te + (2 * tile) * stride_tn
        h0 = gate_up_tile(x_ptr, xs_ptr, w1_ptr, s1_ptr, w3_delta, s3_delta, top, e, tok, rows, valid, slot, rw,
                          out0_ptr, out1_ptr, tile * BLOCK_N, D, I, limit, stride_xm, stride_xsr, stride_xsk,
                          stride_we, stride_wn, stride_se, stride_sn, stride_o0, HALF, ROWS, BLOCK_K, EVEN_K, FUSE,
                          ASM, TILE_REF, UPCAST)
        h1 = gate_up_tile(x_ptr, xs_ptr, w1_ptr, s1_ptr, w3_delta, s3_delta, top + stride_tn, e, tok, rows, valid,
                          slot, rw, out0_ptr, out1_ptr, tile * BLOCK_N + HALF, D, I, limit, stride_xm, stride_xsr,
                          stride_xsk, stride_we, stride_wn, stride_se, stride_sn, stride_o0, HALF, ROWS, BLOCK_K,
                          EVEN_K, FUSE, ASM, TILE_REF, UPCAST)
        if FUSE:
            # the FP8 quantization of h per row over the item's 128 columns (both halves)
            ex = pow2_exponent(tl.maximum(tl.max(tl.abs(h0), axis=0), tl.max(tl.abs(h1), axis=0)))
            _store_h(out0_ptr, h0, ex, rows, valid, tile * BLOCK_N, I, stride_o0, HALF)
            _store_h(out0_ptr, h1, ex, rows, valid, tile * BLOCK_N + HALF, I, stride_o0, HALF)
            tl.store(out1_ptr + rows.to(tl.int64) * stride_o1r + tile * stride_o1k, pow2(ex), mask=valid)


# ============================================================================================ stage 2: down
@triton.jit
def _down_kernel(x_ptr, xs_ptr, w2_ptr, s2_ptr, tops_ptr, sorted_ptr, block_expert_ptr, first_block_ptr,
                 expert_blocks_ptr, used_blocks_ptr, out_ptr, D, I, stride_xm, stride_xsr, stride_xsk, stride_we,
                 stride_wn, stride_se, stride_sn, stride_te, stride_tn, stride_o, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, X_SORTED: tl.constexpr,
                 ASM: tl.constexpr, TILE_REF: tl.constexpr, UPCAST: tl.constexpr):
    """Down: each slot's bf16 output row. ``X_SORTED``: h and its scales are indexed by sorted row (stage 1's
    output), else by slot."""
    n_tiles = tl.cdiv(D, BLOCK_N)
    total = tl.load(used_blocks_ptr) * n_tiles
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        blk, tile, e = expert_work_item(w, n_tiles, block_expert_ptr, first_block_ptr, expert_blocks_ptr)
        rows = blk * ROWS + tl.arange(0, ROWS)
        slot = tl.load(sorted_ptr + rows)
        valid = slot >= 0
        if X_SORTED:
            xrow = rows
        else:
            xrow = tl.where(valid, slot, 0)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < D
        w_rows = w2_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64) * stride_wn
        s_rows = s2_ptr + e.to(tl.int64) * stride_se + rn.to(tl.int64) * stride_sn
        top = tops_ptr + e.to(tl.int64) * stride_te + tile * stride_tn
        acc = project_rows(x_ptr, xs_ptr, xrow, xrow, w_rows, s_rows, n_ok, top, I, stride_xm, stride_xsr, stride_xsk,
                           BLOCK_N, BLOCK_K, ROWS, EVEN_K, ASM, TILE_REF, UPCAST)
        off = slot[None, :].to(tl.int64) * stride_o + rn[:, None]
        tl.store(out_ptr + off, to_bf16(acc), mask=n_ok[:, None] & valid[None, :])


@triton.jit
def _sorted_scales_kernel(xs_ptr, sorted_ptr, out_ptr, n_rows, n_kb, TOPK, stride_xs, BLOCK_R: tl.constexpr,
                          BLOCK_KB: tl.constexpr):
    """``out[kb, r]`` = the activation scale of sorted row ``r``'s token in K block ``kb`` (0 on padding rows)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1) * BLOCK_KB + tl.arange(0, BLOCK_KB)
    r_ok = r < n_rows
    slot = tl.load(sorted_ptr + r, mask=r_ok, other=-1)
    valid = slot >= 0
    tok = tl.where(valid, slot // TOPK, 0)
    kb_ok = kb < n_kb
    v = tl.load(xs_ptr + tok[:, None].to(tl.int64) * stride_xs + kb[None, :], mask=valid[:, None] & kb_ok[None, :],
                other=0.0)
    tl.store(out_ptr + kb[None, :].to(tl.int64) * n_rows + r[:, None], v, mask=r_ok[:, None] & kb_ok[None, :])


# ============================================================================================ host side
def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _block_extremes(scales, block_n: int, block_k: int,
                    nan_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest and smallest scale byte of every ``block_n × block_k`` block (edge blocks partial), taken over
    the same block of each of ``scales`` (``[E, N, K/32]`` each; gate/up's tiles hold w1's and w3's rows):
    ``(top, low)`` int16 ``[E, ceil(N/block_n), ceil(K/block_k)]``. ``nan_scales``: E8M0's NaN byte (255) left
    out (a block of NaN bytes only: top −1, low 1000)."""
    tops, lows = [], []
    per = block_k // 32
    for t in scales:
        s = _u8(t).to(torch.int16)
        E, N, G = s.shape
        pad = (0, -G % per, 0, -N % block_n)
        shape = (E, -(-N // block_n), block_n, -(-G // per), per)
        nan = s == 255 if nan_scales else torch.zeros_like(s, dtype=torch.bool)
        tops.append(torch.nn.functional.pad(s.masked_fill(nan, -1), pad, value=-1).view(shape).amax((2, 4)))
        lows.append(torch.nn.functional.pad(s.masked_fill(nan, 1000), pad, value=1000).view(shape).amin((2, 4)))
    return torch.stack(tops).amax(0), torch.stack(lows).amin(0)


def _exact(scales, block_n: int, block_k: int, nan_scales: bool = False) -> bool:
    top, low = _block_extremes(scales, block_n, block_k, nan_scales)
    empty = top < 0  # NaN bytes only (nan_scales): every weight NaN, nothing to round
    lo_byte, hi_byte = LUT_SCALE_BYTES
    return bool((empty | ((top - low <= LUT_MAX_SPREAD) & (low >= lo_byte) & (top <= hi_byte))).all())


def lut_route_exact(bank, block_k: int = 128, nan_scales: bool = False) -> bool:
    """Whether the bank's weights are exact as the route's E4M3 values with one reference per weight row and
    ``block_k``-wide K tile (``ref="row"``), scale bytes within :data:`LUT_SCALE_BYTES`: the route applies.
    ``nan_scales``: E8M0's NaN byte (255) is allowed beside them — a row's tile holding one computes NaN, as the
    reference does (the decode's use: experts poisoned or absent, never picked)."""
    return once_per_tensors(("fp8lut", block_k, nan_scales), [bank.w1_scale, bank.w3_scale, bank.w2_scale],
                            lambda ts: all(_exact([t], 1, block_k, nan_scales) for t in ts))


def tile_tops(scales, block_n: int, block_k: int) -> tuple[torch.Tensor, bool]:
    """One reference per tile (``ref="tile"``): the largest scale byte of every ``block_n × block_k`` tile of
    ``scales`` (int32 ``[E, N/block_n, K/block_k]``, ~1.5 MB for a Flash layer's three; gate/up's tiles hold w1's
    and w3's rows), and whether every tile is within the window. Computed once per set of scale tensors."""
    def compute(ts):
        top, low = _block_extremes(ts, block_n, block_k)
        lo_byte, hi_byte = LUT_SCALE_BYTES
        exact = bool(((top - low <= LUT_MAX_SPREAD) & (low >= lo_byte) & (top <= hi_byte)).all())
        return top.to(torch.int32).contiguous(), exact
    return once_per_tensors(("fp8lut_tops", block_n, block_k), list(scales), compute)


def scale_reference(ref: str, scales, block_n: int, block_k: int) -> tuple[bool, torch.Tensor]:
    """Resolve a geometry's ``lut_ref`` for one stage: (one reference per tile?, the tile tops — a placeholder for
    ``row``)."""
    if ref not in REFS:
        raise ValueError(f"unknown fp8lut reference {ref!r}; known: {', '.join(REFS)}")
    if ref == "row":
        return False, torch.zeros(1, 1, 1, dtype=torch.int32, device=scales[0].device)
    tops, exact = tile_tops(scales, block_n, block_k)
    if ref == "tile" and not exact:
        raise ValueError(f"fp8lut ref 'tile': some {block_n}×{block_k} weight tile's scales span more than "
                         f"{LUT_MAX_SPREAD} binades; use 'row' or 'auto'")
    return exact, tops


def sorted_scales(xs: torch.Tensor, routing) -> torch.Tensor:
    """The activation scales ``xs [T, nkb]`` (fp32) of each sorted row's token: ``[n_rows, nkb]`` stored K block by
    K block (strides ``(1, n_rows)``: a block's rows are contiguous), 0 on padding rows."""
    n_rows, nkb = routing.sorted_slots.shape[0], xs.shape[1]
    out = torch.empty(nkb, n_rows, dtype=torch.float32, device=xs.device).t()
    if n_rows:
        _sorted_scales_kernel[(triton.cdiv(n_rows, 64), triton.cdiv(nkb, 32))](
            xs, routing.sorted_slots, out, n_rows, nkb, routing.top_k, xs.stride(0), BLOCK_R=64, BLOCK_KB=32)
    return out


def gate_up(xv, xs, bank, routing, geo, rw, out0, out1, limit: float, fuse: bool, grid, device) -> None:
    """Launch stage 1 (see :func:`.fp4_moe_grouped.gate_up`, which allocates the outputs: ``out1`` of the fused
    form is h's scale, ``[n_rows, I/128]`` stored column block by column block)."""
    I, D = bank.inter, bank.dim
    w1, w3, s1, s3 = (_u8(getattr(bank, n)) for n in ("w1", "w3", "w1_scale", "w3_scale"))
    tile_ref, tops = scale_reference(geo.lut_ref, (bank.w1_scale, bank.w3_scale), geo.block_n1 // 2, geo.block_k1)
    table = sorted_scales(xs, routing)
    so1 = (out1.stride(0), out1.stride(1)) if fuse else (0, 0)
    _gate_up_kernel[grid](xv, table, w1, s1, w3.data_ptr() - w1.data_ptr(), s3.data_ptr() - s1.data_ptr(), tops,
                          routing.sorted_slots, routing.block_expert, routing.expert_first_block,
                          routing.expert_blocks, routing.used_blocks, rw, out0, out1, D, I, routing.top_k,
                          float(limit), xv.stride(0), table.stride(0), table.stride(1), w1.stride(0), w1.stride(1),
                          s1.stride(0), s1.stride(1), tops.stride(0), tops.stride(1), out0.stride(0), *so1,
                          ROWS=routing.rows, BLOCK_N=geo.block_n1, BLOCK_K=geo.block_k1,
                          EVEN_K=D % geo.block_k1 == 0, FUSE=fuse, ASM=decode_asm(geo.decode, device),
                          TILE_REF=tile_ref, UPCAST=interpreting(), num_warps=geo.warps1, num_stages=geo.stages1)


def down(hv, hs, bank, routing, geo, out, x_sorted: bool, grid) -> None:
    """Launch stage 2 (see :func:`.fp4_moe_grouped.down`): ``hs [rows of hv, I/128]`` in any strides."""
    I, D = bank.inter, bank.dim
    w2, s2 = _u8(bank.w2), _u8(bank.w2_scale)
    tile_ref, tops = scale_reference(geo.lut_ref, (bank.w2_scale,), geo.block_n2, geo.block_k2)
    _down_kernel[grid](hv, hs, w2, s2, tops, routing.sorted_slots, routing.block_expert, routing.expert_first_block,
                       routing.expert_blocks, routing.used_blocks, out, D, I, hv.stride(0), hs.stride(0),
                       hs.stride(1), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), tops.stride(0),
                       tops.stride(1), out.stride(0), ROWS=routing.rows, BLOCK_N=geo.block_n2,
                       BLOCK_K=geo.block_k2, EVEN_K=I % geo.block_k2 == 0, X_SORTED=x_sorted,
                       ASM=decode_asm(geo.decode, hv.device), TILE_REF=tile_ref, UPCAST=interpreting(),
                       num_warps=geo.warps2, num_stages=geo.stages2)


@triton.jit
def _decode_probe_kernel(w_ptr, d_ptr, lo_ptr, hi_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         ASM: tl.constexpr):
    rn = tl.arange(0, BLOCK_N)
    kj = tl.arange(0, BLOCK_K // 2)
    wb = tl.load(w_ptr + rn[:, None] * (BLOCK_K // 2) + kj[None, :])
    d = tl.load(d_ptr + rn[:, None] * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)[None, :])
    lo, hi = decode_tile(wb, d, BLOCK_N, BLOCK_K, ASM)
    tl.store(lo_ptr + rn[:, None] * (BLOCK_K // 2) + kj[None, :], lo.to(tl.uint8, bitcast=True))
    tl.store(hi_ptr + rn[:, None] * (BLOCK_K // 2) + kj[None, :], hi.to(tl.uint8, bitcast=True))


def decode_probe_inputs(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value under every exponent offset: 64 rows of 64 bytes (one 128-wide K tile), row ``n`` with
    offset ``n % 12`` in all four groups and bytes ``64·(n // 12) … + 63`` (mod 256): each offset meets every byte."""
    n = torch.arange(64, device=device)
    w = ((n // 12)[:, None] * 64 + torch.arange(64, device=device)[None, :]).remainder(256).to(torch.uint8)
    d = (n % 12)[:, None].expand(64, 4).to(torch.int32).contiguous()
    return w, d


def decode(w: torch.Tensor, d: torch.Tensor, asm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`decode_tile` on one tile ``w [N, 64]`` (uint8) with offsets ``d [N, 4]``: the E4M3 bytes of the
    even and odd columns (uint8 ``[N, 64]`` each)."""
    lo, hi = (torch.empty_like(w) for _ in range(2))
    _decode_probe_kernel[(1,)](w, d, lo, hi, BLOCK_N=w.shape[0], BLOCK_K=128, ASM=asm)
    return lo, hi


def _probe_lut_decode(dev: torch.device) -> bool | str:
    w, d = decode_probe_inputs(dev)
    got, want = decode(w, d, True), decode(w, d, False)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    return True if same else "the inline-PTX table decode differs from the portable decode"


_LUT_PROBE = DeviceProbe(_probe_lut_decode)


def lut_decode_works(device) -> bool:
    """Whether the inline-PTX decode compiles and gives the portable decode's bytes on ``device`` (every byte, every
    offset), checked once per process (never in the CPU interpreter)."""
    if torch.device(device).type != "cuda" or interpreting():
        return False
    return _LUT_PROBE.works(device)


def lut_decode_status(device) -> str:
    """Why :func:`lut_decode_works` said what it said (for logs and benchmark records)."""
    return _LUT_PROBE.status(device)


def decode_asm(decode_name: str, device) -> bool:
    """Resolve a geometry's ``decode`` for this route: True to run the inline-PTX decode."""
    if decode_name not in DECODES:
        raise ValueError(f"unknown fp8lut decode {decode_name!r}; known: {', '.join(DECODES)}")
    if decode_name == "portable":
        return False
    works = lut_decode_works(device)
    if decode_name == "asm" and not works:
        raise ValueError(f"fp8lut decode 'asm' is not usable here ({lut_decode_status(device)})")
    return works


__all__ = ["ROUTE", "LUT_MAX_SPREAD", "LUT_SCALE_BYTES", "REFS", "DECODES", "group_tables", "decode_tile",
           "project_rows", "gate_up_tile", "lut_route_exact", "tile_tops", "scale_reference", "sorted_scales",
           "gate_up", "down", "decode_probe_inputs", "decode", "lut_decode_works", "lut_decode_status", "decode_asm"]
