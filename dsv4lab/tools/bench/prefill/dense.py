"""Prefill suite, section ``dense``: the FP8 projections (quantizer, Triton block GEMM per configuration, cuBLAS,
the whole projection on each backend), the weight-stationary GEMM of bf16 activations beside cuBLAS, and the fused
shared expert — each checked within its bound at real widths first."""
from __future__ import annotations

import torch

from dsv4lab.core.model.linear import Linear
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_families import PREFILL_GEMM, WEIGHT_GEMM
from dsv4lab.engine.triton_prefill import linear_magnitude
from dsv4lab.tools.bench.common import random_fp8_linear
from dsv4lab.tools.bench.prefill.harness import PrefillBench, named_configs


def random_bf16_linear(n: int, k: int, device, gen):
    """A BF16 ``Linear`` (``k`` → ``n``) with weights of the model's scale (router, compressor, head)."""
    lin = Linear(k, n, "bf16")
    lin._buffers["weight"] = (torch.randn(n, k, device=device, generator=gen) * k ** -0.5).to(torch.bfloat16)
    return lin


def dense_projections(a) -> dict[str, tuple[int, int]]:
    """``name: (N, K)`` of the FP8 projections a prefill runs per layer (the indexer's wq_b in CSA layers)."""
    return {"wq_a": (a.q_lora_rank, a.dim), "wq_b": (a.n_heads * a.head_dim, a.q_lora_rank),
            "wkv": (a.head_dim, a.dim), "wo_b": (a.dim, a.o_groups * a.o_lora_rank),
            "indexer.wq_b": (a.index_n_heads * a.index_head_dim, a.q_lora_rank),
            "shared.w1": (a.moe_inter_dim, a.dim), "shared.w2": (a.dim, a.moe_inter_dim)}


def bf16_projections(a) -> dict[str, tuple[int, int]]:
    """``name: (N, K)`` of the BF16-weight projections of a prefill (``linear_f32`` except ``weights_proj``)."""
    return {"compressor.wkv": (2 * a.head_dim, a.dim), "indexer.compressor.wkv": (2 * a.index_head_dim, a.dim),
            "gate": (a.n_routed_experts, a.dim), "indexer.weights_proj": (a.index_n_heads, a.dim),
            "head": (a.vocab_size, a.dim)}


def check_dense(b: PrefillBench, a, gen, passed: set[str], plan: dict) -> None:
    """FP8 projections (Triton configs, cuBLAS), the weight-stationary GEMM, the fused shared expert."""
    from dsv4lab_kernels import fp8_gemm as fg
    ref = ReferenceOps(Numerics())
    dev = b.device
    M = 64 if b.smoke else 301  # odd: cuBLAS's row padding is exercised
    lin = random_fp8_linear(a.q_lora_rank, a.dim, dev, gen)
    x = (torch.randn(M, a.dim, device=dev, generator=gen) * 2).to(torch.bfloat16)
    want, mag = ref.linear(x, lin), linear_magnitude(x, lin, True)
    for cfg in plan["gemm"]:
        name = f"fp8_gemm:{cfg}"
        if b.guard(name, lambda: b.check_bound(name, fg.fp8_linear(x, lin.weight, lin.scale, config=cfg), want, mag,
                                               a.dim, "tc_fp8", torch.bfloat16)):
            passed.add(name)
    if b.cuda and fg.cublas_block_fp8_available(dev):
        if b.guard("fp8_gemm:cublas", lambda: b.check_bound("fp8_gemm:cublas", fg.fp8_linear(
                x, lin.weight, lin.scale, backend="cublas"), want, mag, a.dim, "tc_fp8", torch.bfloat16)):
            passed.add("fp8_gemm:cublas")
    elif b.cuda:
        b.log(f"cuBLAS block-scaled FP8: {fg.cublas_unavailable_reason(dev)}")
    # grouped wo_a: bf16 activations × FP8 weight upcast in registers
    G = a.o_groups
    wo_a = random_fp8_linear(G * a.o_lora_rank, a.wo_a_in_per_group, dev, gen, act_quant=False)
    o = torch.randn(1, M, G, a.wo_a_in_per_group, device=dev, generator=gen).to(torch.bfloat16)
    want = ref.grouped_wo_a(o, wo_a, G)
    w3 = wo_a.dequantized(torch.float64).view(G, -1, a.wo_a_in_per_group)
    mag = torch.einsum("bsgd,grd->bsgr", o.double().abs(), w3.abs())
    for cfg in plan["weight"]:
        name = f"weight_gemm:{cfg}"
        if b.guard(name, lambda: b.check_bound(name, fg.weight_gemm(
                o.reshape(M, G, -1), wo_a.weight, wo_a.scale, torch.bfloat16, G, config=cfg).view(want.shape), want,
                mag, a.wo_a_in_per_group, "tc_bf16", torch.bfloat16)):
            passed.add(name)
    # linear_f32 of a BF16 weight (fp32 out)
    lb = random_bf16_linear(2 * a.head_dim, a.dim, dev, gen)
    name = "weight_gemm_f32"
    want_f32, mag_f32 = ref.linear_f32(x, lb), linear_magnitude(x, lb, False)
    if b.guard(name, lambda: b.check_bound(name, fg.weight_gemm(x, lb.weight, None, torch.float32), want_f32,
                                           mag_f32, a.dim, "tc_bf16", torch.float32)):
        passed.add(name)
    # both on cuBLAS (bf16 tensor cores, fp32 output rounded once), as the backend dispatches them
    if b.cuda and fg.cublas_bf16_available(dev):
        def check_cublas_bf16() -> bool:
            y = fg.cublas_weight_gemm(o.reshape(M, G, -1), wo_a.weight, wo_a.scale, torch.bfloat16, G)
            ok = b.check_bound("weight_gemm:cublas:wo_a", y.view(want.shape), want, mag, a.wo_a_in_per_group,
                               "tc_bf16", torch.bfloat16)
            return b.check_bound("weight_gemm:cublas:f32", fg.cublas_weight_gemm(x, lb.weight, None, torch.float32),
                                 want_f32, mag_f32, a.dim, "tc_bf16", torch.float32) and ok
        if b.guard("weight_gemm:cublas", check_cublas_bf16):
            passed.add("weight_gemm:cublas")
    elif b.cuda:
        b.log(f"cuBLAS bf16 with fp32 output: {fg.cublas_bf16_reason(dev)}")
    # the fused shared expert, stage by stage
    w1, w3_, w2 = (random_fp8_linear(n, k, dev, gen) for n, k in ((a.moe_inter_dim, a.dim), (a.moe_inter_dim, a.dim),
                                                                  (a.dim, a.moe_inter_dim)))
    limit = a.swiglu_limit

    def check_shared() -> bool:
        g, u = fg.fp8_gate_up(x, w1.weight, w1.scale, w3_.weight, w3_.scale, limit, fuse=False)
        ok = b.check_bound("shared:gate", g, ref.linear(x, w1).float(), linear_magnitude(x, w1, True), a.dim,
                           "tc_fp8", torch.bfloat16)
        ok = b.check_bound("shared:up", u, ref.linear(x, w3_).float(), linear_magnitude(x, w3_, True), a.dim,
                           "tc_fp8", torch.bfloat16) and ok
        h = ref.swiglu(g, u, limit, shared=True).to(torch.bfloat16)
        composed = ref.linear(h, w2)
        for backend in ("triton", "cublas") if b.cuda else ("triton",):
            y = fg.fp8_swiglu_mlp(x, w1.weight, w1.scale, w3_.weight, w3_.scale, w2.weight, w2.scale, limit,
                                  backend=backend)
            ok = b.check_bound(f"shared:fused[{backend}]", y, composed, linear_magnitude(h, w2, True),
                               a.moe_inter_dim, "tc_fp8", torch.bfloat16) and ok
        return ok
    if b.guard("shared_expert", check_shared):
        passed.add("shared_expert")


def bench_dense(b: PrefillBench, a, gen, passed: set[str], T: int) -> None:
    """FP8 projections (quantizer, Triton per config, cuBLAS, whole projection per backend), BF16-activation
    GEMMs beside cuBLAS bf16, and the shared expert."""
    from dsv4lab_kernels import fp8_gemm as fg
    dev = b.device
    cublas = b.cuda and "fp8_gemm:cublas" in passed
    configs = [c for c in named_configs(PREFILL_GEMM, True) if f"fp8_gemm:{c}" in passed]
    for name, (n, k) in dense_projections(a).items():
        if b.over_budget(f"fp8 {name} @{T}"):
            return
        lin = random_fp8_linear(n, k, dev, gen)
        x = torch.randn(T, k, device=dev, generator=gen).to(torch.bfloat16)
        flops, meta = 2.0 * T * n * k, dict(tokens=T, n=n, k=k)
        t = b.time_events_us(lambda: fg.quantize_activations(x), name="act_quant", flush_l2=True)
        b.add("fp8_gemm", f"{name}:act_quant", t, 0.0, "copy", gbps=round(3 * T * k / (t * 1e-6) / 1e9, 1), **meta)
        qa = fg.quantize_activations(x)
        for cfg in configs:
            t = b.time_events_us(lambda: fg.fp8_block_gemm(qa["q"], qa["scale"], lin.weight, lin.scale, config=cfg),
                                 name=f"fp8:{cfg}", flush_l2=True)
            b.add("fp8_gemm", f"{name}:triton:{cfg}", t, flops, "fp8", **meta)
        if cublas and fg.cublas_eligible(T, n, k):
            qc, sw = fg.quantize_activations(x, scale_cols=True), fg.weight_scale_f32(lin.scale)
            t = b.time_events_us(lambda: fg._cublas_gemm(qc["q"], qc["scale"], lin.weight, sw, torch.bfloat16),
                                 name="fp8:cublas", flush_l2=True)
            b.add("fp8_gemm", f"{name}:cublas", t, flops, "fp8", **meta)
            t = b.time_events_us(lambda: fg.fp8_linear(x, lin.weight, lin.scale, backend="cublas", w_scale_f32=sw),
                                 flush_l2=True)
            b.add("fp8_gemm", f"{name}:linear:cublas", t, flops, "fp8", **meta)
        if configs:
            t = b.time_events_us(lambda: fg.fp8_linear(x, lin.weight, lin.scale, config=configs[0]), flush_l2=True)
            b.add("fp8_gemm", f"{name}:linear:triton", t, flops, "fp8", **meta)
    wcfgs = [c for c in named_configs(WEIGHT_GEMM, True) if f"weight_gemm:{c}" in passed]
    if not wcfgs or b.over_budget(f"weight gemms @{T}"):
        return
    G = a.o_groups
    wo_a = random_fp8_linear(G * a.o_lora_rank, a.wo_a_in_per_group, dev, gen, act_quant=False)
    o = torch.randn(T, G, a.wo_a_in_per_group, device=dev, generator=gen).to(torch.bfloat16)
    flops = 2.0 * T * G * a.o_lora_rank * a.wo_a_in_per_group
    for cfg in wcfgs:
        t = b.time_events_us(lambda: fg.weight_gemm(o, wo_a.weight, wo_a.scale, torch.bfloat16, G, config=cfg),
                             name=f"weight:{cfg}", flush_l2=True)
        b.add("weight_gemm", f"wo_a:{cfg}", t, flops, "bf16", tokens=T)
    if b.cuda:  # cuBLAS bf16 on the dequantized weight: the speed reference (the same products, exact weights)
        wd = wo_a.dequantized(torch.bfloat16).view(G, -1, a.wo_a_in_per_group)
        ot = o.transpose(0, 1)
        t = b.time_events_us(lambda: torch.bmm(ot, wd.transpose(1, 2)), flush_l2=True)
        b.add("weight_gemm", "wo_a:cublas_bf16", t, flops, "bf16", tokens=T)
    if "weight_gemm:cublas" in passed:  # what the backend runs: dequantize, fp32-output bmm, round once
        t = b.time_events_us(lambda: fg.cublas_weight_gemm(o, wo_a.weight, wo_a.scale, torch.bfloat16, G),
                             name="weight:cublas", flush_l2=True)
        b.add("weight_gemm", "wo_a:cublas", t, flops, "bf16", tokens=T)
    x = torch.randn(T, a.dim, device=dev, generator=gen).to(torch.bfloat16)
    for name, (n, k) in bf16_projections(a).items():
        if b.over_budget(f"bf16 {name} @{T}"):
            return
        lb = random_bf16_linear(n, k, dev, gen)
        out = torch.bfloat16 if name.endswith("weights_proj") else torch.float32
        flops = 2.0 * T * n * k
        t = b.time_events_us(lambda: fg.weight_gemm(x, lb.weight, None, out, config=wcfgs[0]), flush_l2=True)
        b.add("weight_gemm", f"{name}:{wcfgs[0]}", t, flops, "bf16", tokens=T, n=n, k=k)
        if b.cuda:
            t = b.time_events_us(lambda: torch.mm(x, lb.weight.t()), flush_l2=True)
            b.add("weight_gemm", f"{name}:cublas_bf16", t, flops, "bf16", tokens=T, n=n, k=k)
        if "weight_gemm:cublas" in passed:
            t = b.time_events_us(lambda: fg.cublas_weight_gemm(x, lb.weight, None, out), flush_l2=True)
            b.add("weight_gemm", f"{name}:cublas", t, flops, "bf16", tokens=T, n=n, k=k)
    if "shared_expert" in passed and not b.over_budget(f"shared expert @{T}"):
        w1, w3, w2 = (random_fp8_linear(n, k, dev, gen) for n, k in ((a.moe_inter_dim, a.dim),
                                                                     (a.moe_inter_dim, a.dim),
                                                                     (a.dim, a.moe_inter_dim)))
        flops = 2.0 * T * 3 * a.dim * a.moe_inter_dim
        for backend in ("triton", "cublas") if cublas else ("triton",):
            t = b.time_events_us(lambda: fg.fp8_swiglu_mlp(x, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight,
                                                           w2.scale, a.swiglu_limit, backend=backend), flush_l2=True)
            b.add("shared_expert", f"fused:{backend}", t, flops, "fp8", tokens=T)


