"""mHC — manifold-constrained hyper-connections (spec §3.2).

The residual stream is ``hc_mult`` (4) parallel streams ``X [b, s, n, D]``. Around each sub-layer,
:func:`hc_pre` mixes them into the sub-layer input ``u`` and produces the ``post`` gains and the doubly
stochastic ``comb`` matrix (Sinkhorn); :func:`hc_post` writes the sub-layer output back into every stream.
:func:`hc_head` collapses the streams before the final norm (main model and MTP).
"""
from __future__ import annotations

import torch

from dsv4lab.core.config import ModelArgs


def _mix_logits(x_flat: torch.Tensor, fn: torch.Tensor, eps: float, calc: torch.dtype) -> torch.Tensor:
    # RMS over all n·D values (norm_eps, not hc_eps), applied after the projection; reductions in calc.
    acc = x_flat.dtype
    proj = (x_flat.to(calc) @ fn.to(calc).T).to(acc)
    ms = x_flat.to(calc).square().mean(-1, keepdim=True).to(acc)
    return proj * torch.rsqrt((ms + eps).to(calc)).to(acc)


def _sigmoid(x: torch.Tensor, calc: torch.dtype) -> torch.Tensor:
    return torch.sigmoid(x.to(calc)).to(x.dtype)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (+eps), column normalisation, then ``iters-1`` × (rows, columns). ``c [..., n, n]``."""
    c = c.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, args: ModelArgs,
           acc: torch.dtype, calc: torch.dtype | None = None):
    """``X [b,s,n,D]`` with a site's ``fn [(2+n)·n, n·D]``, ``base``, ``scale [3]`` →
    ``(u [b,s,D] in X.dtype, post [b,s,n] acc, comb [b,s,n,n] acc)``."""
    n = args.hc_mult
    calc = calc or acc
    x = X.flatten(-2).to(acc)
    m = _mix_logits(x, fn, args.norm_eps, calc)
    scale, base = scale.to(acc), base.to(acc)
    pre = _sigmoid(m[..., :n] * scale[0] + base[:n], calc) + args.hc_eps
    post = 2 * _sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n], calc)
    comb = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = sinkhorn(comb.to(calc), args.hc_sinkhorn_iters, args.hc_eps).to(acc)
    u = (pre[..., None] * X.to(acc)).to(calc).sum(-2).to(acc)
    return u.to(X.dtype), post, comb


def hc_post(out: torch.Tensor, X_res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            calc: torch.dtype | None = None) -> torch.Tensor:
    """``X_new[k] = post[k]·out + Σ_j comb[j,k]·X_res[j]`` in ``post.dtype``, returned in ``X_res.dtype``."""
    acc = post.dtype
    calc = calc or acc
    mixed = torch.einsum("bsjk,bsjd->bskd", comb.to(calc), X_res.to(calc)).to(acc)
    return (post[..., None] * out.to(acc)[..., None, :] + mixed).to(X_res.dtype)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, args: ModelArgs,
            acc: torch.dtype, calc: torch.dtype | None = None) -> torch.Tensor:
    """Collapse the streams: ``y = Σ_j (sigmoid(m_j·scale + base_j) + eps)·X_j`` → ``X.dtype``."""
    calc = calc or acc
    x = X.flatten(-2).to(acc)
    m = _mix_logits(x, fn, args.norm_eps, calc)
    pre = _sigmoid(m * scale.to(acc)[0] + base.to(acc), calc) + args.hc_eps
    return (pre[..., None] * X.to(acc)).to(calc).sum(-2).to(acc).to(X.dtype)
