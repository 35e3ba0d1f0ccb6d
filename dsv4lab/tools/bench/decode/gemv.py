"""Decode suite, section ``gemv``: the decode projections (``fp8_gemv``) as the decode step launches them — every
FP8 and BF16 projection checked at 1 and 8 rows within the bound of its arithmetic (each own code path of
:data:`dsv4lab.engine.kernel_families.GEMV` and cuBLAS, plus the accumulation probe), then timed per batch with
weights rotating among copies past L2."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4lab.engine.dispatch import split_k_for
from dsv4lab.engine.kernel_families import GEMV, Variant
from dsv4lab.tools.bench.common import random_fp8_linear
from dsv4lab.tools.bench.decode.harness import ROTATE_BYTES, DecodeBench, run_mode
from dsv4lab.tools.verify.bounds import check_within_bound


@dataclass(frozen=True)
class GemvVariant:
    """One own-GEMV configuration of the GEMV family (:data:`~dsv4lab.engine.kernel_families.GEMV`), timed on
    every projection with K split to ~2 programs per SM at each shape."""

    variant: Variant

    @property
    def route(self) -> str:
        return self.variant.route

    @property
    def block_n(self) -> int:
        return self.variant.fields["block_n"]

    @property
    def block_k(self) -> int:
        return self.variant.fields["block_k"]

    @property
    def num_warps(self) -> int:
        return self.variant.fields["num_warps"]

    @property
    def num_stages(self) -> int:
        return self.variant.fields.get("num_stages", 3)

    @property
    def unroll(self) -> int:
        return self.variant.fields.get("unroll", 1)

    @property
    def prequant(self) -> bool:
        return self.variant.fields.get("prequant", False)

    @property
    def fma_rows(self) -> int:
        return self.variant.fields.get("fma_rows", 1)

    @property
    def structure(self) -> str:
        """What the bound check covers: the code path (geometries of one path differ only in fp32 order)."""
        return self.route + (f"-u{self.unroll}" if self.unroll > 1 else "") + ("-pq" if self.prequant else "") + (
            f"-r{self.fma_rows}" if self.fma_rows > 1 else "")

    def name(self, bn: int, split: int) -> str:
        return (f"{self.route}:n{bn}k{self.block_k}s{split}w{self.num_warps}p{self.num_stages}"
                + (f"u{self.unroll}" if self.unroll > 1 else "") + (":pq" if self.prequant else "")
                + (f":r{self.fma_rows}" if self.fma_rows > 1 else ""))

    def geometry(self, block_n: int, split_k: int):
        """Its :class:`~dsv4lab_kernels.fp8_gemv.GemvGeometry` at a shape's tile width and K split."""
        from dsv4lab_kernels import fp8_gemv as gemv
        return gemv.GemvGeometry(block_n=block_n, block_k=self.block_k, split_k=split_k, num_warps=self.num_warps,
                                 num_stages=self.num_stages, unroll=self.unroll, prequant=self.prequant,
                                 fma_rows=self.fma_rows)

    def applies(self, batch: int, aq: bool) -> bool:
        """Where the family says it applies (``prequant`` only quantizes rows once where there are several)."""
        return self.variant.applies(batch, aq)


def gemv_variants(smoke: bool, quick: bool) -> list[GemvVariant]:
    """The own GEMV's configurations of the run's list in :data:`~dsv4lab.engine.kernel_families.GEMV`: the
    ``fma`` route's tile shapes and unrolls (batch 1: bytes in flight per SM is what they trade), the ``dot`` route
    plain and with the rows quantized once (``prequant``, batch > 1), the ``fma`` route with 2 or 4 rows per
    weight tile (``fma_rows``: a verify step's rows); a quick run's seven are timed on 12 projections at batches 1
    and 8 (the ``fma_rows`` ones from 2 and 3 rows: at 8)."""
    return [GemvVariant(v) for v in GEMV.runs(run_mode(smoke, quick))]


def projections(a) -> dict[str, tuple[int, int, int, bool]]:
    """name → (N, K per group, groups, act_quant) of the decode step's FP8 projections, as it launches them: the
    sets of one input stacked (:mod:`dsv4lab.engine.decode_groups`; ``wq_b`` alone in HCA layers)."""
    G = a.o_groups
    idx_q = a.index_n_heads * a.index_head_dim
    return {"wq_a+wkv": (a.q_lora_rank + a.head_dim, a.dim, 1, True),
            "wq_b": (a.n_heads * a.head_dim, a.q_lora_rank, 1, True),
            "wq_b+idx_wq_b": (a.n_heads * a.head_dim + idx_q, a.q_lora_rank, 1, True),
            "wo_a": (G * a.o_lora_rank, a.wo_a_in_per_group, G, False),
            "wo_b": (a.dim, G * a.o_lora_rank, 1, True),
            "shared_w1+w3": (2 * a.moe_inter_dim, a.dim, 1, True),
            "shared_w2": (a.dim, a.moe_inter_dim, 1, True)}


def bf16_projections(a) -> dict[str, tuple[int, int]]:
    """name → (N, K) of the decode step's BF16 weights projected to fp32: the router, every compressor's
    ``wkv``/``wgate`` of a CSA layer (main ratio 4 and the indexer's, stacked) and of an HCA layer, the indexer's
    head weights (a bf16 output, the same GEMV) and the LM head (first: the largest, measured before any budget
    cut)."""
    csa = 2 * (2 * a.head_dim) + 2 * (2 * a.index_head_dim)  # ratio 4 overlaps: 2× the channels, kv and score
    hca = 2 * a.head_dim
    return {"head": (a.vocab_size, a.dim), "router": (a.n_routed_experts, a.dim), "compressors_csa": (csa, a.dim),
            "compressors_hca": (hca, a.dim), "idx_weights": (a.index_n_heads, a.dim)}


def projection_shapes(a) -> dict[str, tuple[int, int, int, str, bool]]:
    """The benchmark's row name of each projection (``fp8_gemv_<name>``, ``bf16_gemv_<name>``) → ``(N, K per group,
    groups, weight format, act_quant)``: the key of its tuned entries (:func:`~dsv4lab.engine.dispatch.shape_key`)."""
    shapes = {f"fp8_gemv_{n}": (N, Kg, G, "fp8", aq) for n, (N, Kg, G, aq) in projections(a).items()}
    shapes.update({f"bf16_gemv_{n}": (N, K, 1, "bf16", False) for n, (N, K) in bf16_projections(a).items()})
    return shapes


def gemv_bound(out, x, weight, scale, route: str, act_quant: bool = True, groups: int = 1, out_dtype=None,
               name: str = ""):
    """``out`` of a projection (own kernel route ``"fma"``/``"dot"``, or ``"cublas"``) against the exact
    reference within ``γ(c·K)·Σ|xq·w| + 1 ulp(out dtype)``, K per group, fp32 accumulation, the route's ``c`` —
    except cuBLAS's FP8 GEMM, held to the blocked ``fp8_mma`` model (``γ_128`` of a ~14-bit accumulator inside
    each 128-wide K block, the blocks in fp32: :data:`~dsv4lab.tools.verify.bounds.BLOCKED`)."""
    from dsv4lab_kernels import fp8_gemv as gemv
    out_dtype = out_dtype or out.dtype
    x = x.to(weight.device)  # the exact reference where the weight lives (fp64 on the GPU: the head is 0.5 G terms)
    ref = gemv.reference_fp8_gemv(x, weight, scale, act_quant, torch.float64, groups)
    mag = gemv.reference_magnitude(x, weight, scale, act_quant, groups)
    K = weight.shape[1]
    if route == "cublas" and scale is not None:
        return check_within_bound(out.cpu(), ref.to(torch.float32).to(out_dtype), mag, terms=K,
                                  acc_dtype=gemv.CUBLAS_FP8_ACC, out_dtype=out_dtype, name=name or "gemv[cublas fp8]")
    c = gemv.ACCUMULATION[route][1]
    return check_within_bound(out.cpu(), ref.to(torch.float32).to(out_dtype), mag, terms=K, c=c * K,
                              acc_dtype=torch.float32, out_dtype=out_dtype, name=name or f"gemv[{route}]")


def accumulation_probe(n: int, k: int, rows: int, device, bf16_weight: bool = False):
    """Inputs that separate an fp32 accumulator from a narrower one: ``x`` all ones; in every 128-block of each
    weight row one product of ±64 (the sign alternating by block, so they cancel) and 127 of 2^-9 — 2^15 times
    smaller, lost by an accumulator of ≤ 14 significant bits and kept by fp32. Exact result ``(K/128)·127·2^-9``."""
    w = torch.full((n, k), 2.0 ** -9, device=device)
    blk = torch.arange(0, k, 128, device=device)
    pos = blk[None, :] + (torch.arange(n, device=device) % 128)[:, None]  # the big term moves across lanes
    sign = torch.where((torch.arange(len(blk), device=device) % 2) == 0, 64.0, -64.0)
    w.scatter_(1, pos.clamp(max=k - 1), sign.expand(n, -1).contiguous())
    x = torch.ones(rows, k, device=device, dtype=torch.bfloat16)
    if bf16_weight:
        return x, w.to(torch.bfloat16), None
    scale = torch.full((-(-n // 128), -(-k // 128)), 127, dtype=torch.uint8, device=device)
    return x, w.to(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


def check_gemv(b: DecodeBench, a, gen, variants) -> dict[str, bool]:
    """Every FP8 and BF16 projection at 1 and 8 rows with each own code path (route × unroll × prequant: its
    first geometry; others of the path differ only in the order of fp32 sums) and with cuBLAS, plus the
    accumulation probe, within the bound of its arithmetic (own routes: fp32, ``γ(c·K)``; cuBLAS bf16: ``γ(4K)``;
    cuBLAS FP8: ``fp8_mma``). Returns ``{"<proj>:<structure>": passed}``; also records which block-scale layout
    ``torch._scaled_mm`` accepted (``b.cublas``)."""
    from dsv4lab_kernels import fp8_gemv as gemv
    dev = b.device
    ok: dict[str, bool] = {}
    shapes = [(name, N, Kg, G, aq, True) for name, (N, Kg, G, aq) in projections(a).items()]
    shapes += [(name, N, K, 1, False, False) for name, (N, K) in bf16_projections(a).items()]
    if b.smoke:
        shapes = [(n, min(N, 256), min(K, 384), G, aq, f8) for n, N, K, G, aq, f8 in shapes[:2]]
    for name, N, Kg, G, aq, f8 in shapes:
        if b.over_budget(f"gemv checks {name}"):
            break
        if f8:
            lin = random_fp8_linear(N, Kg, dev, gen, act_quant=aq)
            weight, scale = lin.weight, lin.scale
        else:
            weight = (torch.randn(N, Kg, device=dev, generator=gen) * Kg ** -0.5).to(torch.bfloat16)
            scale = None
        out_dtype = torch.bfloat16 if f8 else torch.float32
        first: dict[str, GemvVariant] = {}
        for v in variants:  # each path's first timed geometry: its compile is reused
            if v.applies(8, aq and f8):
                first.setdefault(v.structure, v)
        cublas_ok = b.cuda and G == 1 and (not f8 or (aq and b.cublas.get("used")))
        impls = list(first) + (["cublas"] if cublas_ok else [])
        for impl in impls:
            key = f"{name}:{impl}"
            v = first.get(impl)
            geo = None if v is None else v.geometry(min(v.block_n, N // G), 4)
            results = []
            for rows in (8,) if v is not None and v.prequant else (1, 3, 8) if v is not None and v.fma_rows > 1 \
                    else (1, 8):  # (a program of fma_rows with one row masked)
                x = (torch.randn(rows, Kg * G, device=dev, generator=gen) * 2).to(torch.bfloat16)
                results.append((x, weight, scale, rows))
            px, pw, ps = accumulation_probe(N, Kg * G if G == 1 else Kg, 1, dev, bf16_weight=not f8)
            if G == 1 and (aq or not f8) and (v is None or not v.prequant):  # quantized ones, or a bf16 one
                results.append((px, pw, ps, "probe"))
            good = True
            for x, w_, s_, tag in results:
                label = f"gemv:{key}:{'M' + str(tag) if tag != 'probe' else 'probe'}"

                def run(x=x, w_=w_, s_=s_, v=v, geo=geo):
                    if v is None:
                        return gemv.cublas_linear(x, w_, s_, aq, out_dtype, mm_out_dtype=cublas_mm_out(b))
                    return gemv.fp8_gemv(x, w_, s_, aq, out_dtype, G, v.route, geo)
                route = "cublas" if v is None else v.route
                res = b.guard(label, lambda: gemv_bound(run(), x, w_, s_, route, aq, G, out_dtype, label))
                good &= res is not None and b.record_bound(res, shape=[N, Kg, G], impl=impl)
            ok[key] = good
        del weight, scale
    return ok


def probe_scaled_mm(b: DecodeBench) -> None:
    """Which block-scale layouts ``torch._scaled_mm`` accepts on this GPU and torch (recorded in the JSON):
    1×128 activation × 128×128 weight scales (fp32) with an fp32 and a bf16 output."""
    from dsv4lab_kernels import fp8_gemv as gemv
    if not b.cuda:
        return
    x = torch.randn(16, 256, device=b.device).to(torch.bfloat16)
    w = torch.randn(128, 256, device=b.device).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.full((1, 2), 127, dtype=torch.uint8, device=b.device).view(torch.float8_e8m0fnu)
    q, sx = gemv.act_quant_fp8(x, 16)
    sw = gemv.e8m0_scales_f32(s)
    for out_dtype in (torch.float32, torch.bfloat16):
        key = f"blockwise_1x128_128x128_out_{str(out_dtype).replace('torch.', '')}"
        try:
            torch._scaled_mm(q, w.t(), scale_a=sx, scale_b=sw.t(), out_dtype=out_dtype)
            torch.cuda.synchronize()
            b.cublas[key] = "accepted"
        except Exception as err:  # noqa: BLE001 — recorded: what this torch/cuBLAS accepts is the finding
            b.cublas[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    accepted = [d for d in ("float32", "bfloat16") if b.cublas.get(f"blockwise_1x128_128x128_out_{d}") == "accepted"]
    b.cublas["used"] = accepted[0] if accepted else None
    b.log(f"torch._scaled_mm block scaling: {b.cublas}")


def cublas_mm_out(b: DecodeBench):
    """The output dtype of the block-scaled ``_scaled_mm`` this torch accepts (fp32 preferred: one rounding,
    ours); probed by :func:`probe_scaled_mm`."""
    return torch.bfloat16 if b.cublas.get("used") == "bfloat16" else torch.float32


# ============================================================================================ GEMV
def bench_gemv(b: DecodeBench, a, gen, checks: dict[str, bool], batches, variants) -> None:
    """Every projection × batch: the own GEMV variants whose route passed here and cuBLAS where it passed."""
    from dsv4lab_kernels import fp8_gemv as gemv
    dev = b.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if b.cuda else 4
    shapes = [(f"fp8_gemv_{name}", N, Kg, G, aq, True) for name, (N, Kg, G, aq) in projections(a).items()]
    shapes += [(f"bf16_gemv_{name}", N, K, 1, False, False) for name, (N, K) in bf16_projections(a).items()]
    if b.smoke:
        shapes = [(n, min(N, 256), min(K, 384), G, aq, f8) for n, N, K, G, aq, f8 in shapes[:2]]
    for kernel, N, Kg, G, aq, f8 in shapes:
        name = kernel.split("_gemv_")[1]
        if b.over_budget(f"gemv {name}"):
            return
        K = Kg * G
        w_bytes = N * Kg * (1 if f8 else 2) + ((-(-N // 128)) * (-(-Kg // 128)) if f8 else 0)
        n_rot = 1 if b.smoke else max(2, min(32, ROTATE_BYTES // w_bytes))
        if f8:
            lins = [random_fp8_linear(N, Kg, dev, gen, act_quant=aq) for _ in range(n_rot)]
            ws = [(lin.weight, lin.scale) for lin in lins]
            sw32 = [gemv.e8m0_scales_f32(lin.scale) for lin in lins]
        else:
            ws = [((torch.randn(N, Kg, device=dev, generator=gen) * Kg ** -0.5).to(torch.bfloat16), None)
                  for _ in range(n_rot)]
        out_dtype = torch.bfloat16 if f8 else torch.float32
        for T in batches:
            xs = [(torch.randn(T, K, device=dev, generator=gen) * 2).to(torch.bfloat16) for _ in range(n_rot)]
            nbytes = w_bytes + T * K * 2 + T * N * (2 if f8 else 4)
            for v in variants:
                if not checks.get(f"{name}:{v.structure}") or not v.applies(T, aq and f8):
                    continue
                bn_ = min(v.block_n, N // G) if G > 1 else v.block_n
                split = split_k_for(N, Kg, bn_, v.block_k, 2 * sms)
                geo = v.geometry(bn_, split)
                calls = [lambda r=r, geo=geo, route=v.route: gemv.fp8_gemv(xs[r], ws[r][0], ws[r][1], aq, out_dtype,
                                                                           G, route, geo) for r in range(n_rot)]
                t = b.guard(f"gemv {name} {v.name(bn_, split)} b{T}", lambda: b.time_graph_us(calls))
                if t is not None:
                    b.add(kernel, v.name(bn_, split), T, t, nbytes, route=v.route, impl="triton",
                          choice=dict(impl="triton", route=v.route, block_n=bn_, block_k=v.block_k, split_k=split,
                                      num_warps=v.num_warps, num_stages=v.num_stages, unroll=v.unroll,
                                      prequant=v.prequant, **({"fma_rows": v.fma_rows} if v.fma_rows > 1 else {})))
            if checks.get(f"{name}:cublas"):
                if f8:
                    calls = [lambda r=r: gemv.cublas_linear(xs[r], ws[r][0], ws[r][1], aq, out_dtype,
                                                            weight_scale_f32=sw32[r], mm_out_dtype=cublas_mm_out(b))
                             for r in range(n_rot)]
                    variant = "cublas_scaled_mm_blockwise"
                else:
                    calls = [lambda r=r: gemv.cublas_linear(xs[r], ws[r][0], None, False, out_dtype)
                             for r in range(n_rot)]
                    variant = "cublas_mm_f32out"
                t = b.guard(f"gemv {name} cublas b{T}", lambda: b.time_graph_us(calls))
                if t is not None:
                    b.add(kernel, variant, T, t, nbytes, route="cublas", impl="cublas",
                          choice=dict(impl="cublas", cublas_out=str(cublas_mm_out(b)).replace("torch.", "")
                                      if f8 else "float32"))
            elif b.cuda and G == 1 and T == batches[0]:
                b.skipped.append(f"{kernel}: cuBLAS not timed ({'failed its bound' if f'{name}:cublas' in checks else 'not applicable'})")
        del ws


