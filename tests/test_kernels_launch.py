"""Programmatic dependent launch (``kernels/dsv4lab_kernels/launch.py``, on by default on sm_90+): off on a CPU and in the
interpreter whatever the environment says; every kernel launched with :func:`pdl_args` declares ``PDL`` and waits for its predecessors before
anything else (a static check over the kernel sources — a PDL launch without the wait would read stale memory);
on a GPU, the graph-replayed decode step with PDL on gives the same bits as with it off."""
from __future__ import annotations

import ast

import pytest
import torch

from conftest import ROOT, TINY
from dsv4lab.engine.kernel_loader import kernel_module

KERNELS = ROOT / "kernels" / "dsv4lab_kernels"


def test_pdl_is_off_without_a_hopper_gpu(monkeypatch):
    from dsv4lab.engine.kernel_loader import PDL_ENV
    launch = kernel_module("launch")
    assert launch.PDL_ENV == PDL_ENV == "DSV4LAB_PDL"  # one switch, named twice (the tools do not import triton)
    monkeypatch.delenv("DSV4LAB_PDL", raising=False)  # the default: on where the GPU has it
    assert launch.pdl_args("cpu") == {}
    monkeypatch.setenv("DSV4LAB_PDL", "1")
    assert launch.pdl_args("cpu") == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch.pdl_args("cuda:0") == {}  # the interpreter: no griddepcontrol
    monkeypatch.setenv("DSV4LAB_PDL", "0")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert launch.pdl_args("cuda:0") == {}


def _pdl_launched(tree: ast.AST) -> set[str]:
    """Names of the kernels launched as ``kernel[grid](..., **pdl_args(...))``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                and isinstance(node.func.value, ast.Name) and any(
                    k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") == "pdl_args"
                    for k in node.keywords):
            names.add(node.func.value.id)
    return names


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def test_every_pdl_launched_kernel_waits_first():
    # a kernel may be launched from one module of the package and defined in another (fp4_moe_decode launches
    # the kernels of fp4_moe_decode_kernels), so the definitions are gathered over the whole package first
    trees = {path: ast.parse(path.read_text()) for path in sorted(KERNELS.glob("*.py"))}
    defs = {n.name: n for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    launched_anywhere = set()
    for path, tree in trees.items():
        launched = _pdl_launched(tree)
        launched_anywhere |= launched
        for name in launched:
            fn = defs.get(name)
            assert fn is not None, f"{path.name}: {name} launched with pdl_args but defined nowhere in the package"
            params = [a.arg for a in fn.args.args]
            assert params[-1] == "PDL", f"{path.name}: {name} does not end its parameters with PDL"
            first = _first_statement(fn)
            assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) \
                and getattr(first.value.func, "id", "") == "pdl_prologue" \
                and [getattr(a, "id", None) for a in first.value.args] == ["PDL"], \
                f"{path.name}: {name} does not start with pdl_prologue(PDL)"
    # the decode step's kernels (bench e2e's breakdown) are all among them
    assert {"_fp8_gemv_kernel", "_moe_up_kernel", "_moe_down_expert_kernel", "_mhc_site_kernel",
            "_attn_decode_kernel", "_attn_combine_kernel", "_indexer_select_kernel", "_head_rms_rope_kernel",
            "_kv_norm_rope_kernel", "_indexer_query_kernel", "_router_kernel", "_compressor_step_kernel",
            "_rms_norm_kernel"} <= launched_anywhere


def test_the_static_check_fails_a_kernel_without_the_wait(tmp_path):
    """The check above can fail: a kernel launched with pdl_args whose body does not start with the prologue."""
    src = '''
@triton.jit
def _k(x_ptr, PDL: tl.constexpr = False):
    """doc"""
    tl.store(x_ptr, 1)
    pdl_prologue(PDL)

def launch(x):
    _k[(1,)](x, **pdl_args(x.device))
'''
    tree = ast.parse(src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_k")
    assert _pdl_launched(tree) == {"_k"}
    first = _first_statement(fn)
    assert not (isinstance(first.value, ast.Call) and getattr(first.value.func, "id", "") == "pdl_prologue")


@pytest.mark.gpu
def test_gpu_decode_step_with_pdl_gives_the_same_bits(monkeypatch):
    """The graph-replayed decode step on the tiny model, teacher-forced, with and without PDL: the same logits
    bit for bit (PDL moves launches, not arithmetic). Skips where PDL is not available (before sm_90, ROCm)."""
    import dsv4lab
    launch = kernel_module("launch")
    monkeypatch.setenv("DSV4LAB_PDL", "1")
    if not launch.pdl_enabled("cuda"):
        pytest.skip("PDL needs an NVIDIA GPU of compute capability 9.0 or later")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 4096, (2, 30), generator=g)

    def run() -> list[torch.Tensor]:
        m = dsv4lab.load(TINY, device="cuda", backend="triton", max_batch=2, max_seq_len=64)
        m.reset()
        out = [m.forward(ids[:, :20], 0, slots=[0, 1])]
        out += [m.forward(ids[:, t:t + 1], t, slots=[0, 1]) for t in range(20, 26)]
        assert m.decode_path == "graph" and m.decode_info()["captured"], m.decode_info()
        return [o.cpu() for o in out]
    with_pdl = run()
    monkeypatch.setenv("DSV4LAB_PDL", "0")
    without = run()
    for i, (a, b) in enumerate(zip(with_pdl, without)):
        assert torch.equal(a, b), f"step {i}: PDL changed the logits"
