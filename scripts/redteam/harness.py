"""Red-team harness (issue 12): float64 ascent of nu_i(J_f(Y)) (and of nu_i(J_f(Y) - J_f(X)), stage moves)
over Y in B(X, r), every token within r (l2).  Inner problem nu_i(J) = max_{|u|=1} sum_j ||J_ij^T u|| by
alternating maximisation from many starts on the full Jacobian (small layers); outer problem by Adam on
the offset with per-token projection, from random, boundary and adversarial starts."""
from __future__ import annotations

import dataclasses
import math

import torch

torch.set_default_dtype(torch.float64)


def clip(E, r):
    n = E.norm(dim=1, keepdim=True)
    return E * torch.clamp(r / n.clamp(min=1e-300), max=1.0)


def jac(f, Y, create_graph=False):
    """(T, m, T, d) Jacobian."""
    return torch.autograd.functional.jacobian(f, Y, create_graph=create_graph, vectorize=True)


def nu_row(Ji, starts=24, iters=60, g=None):
    """Ji (m, T, d): a large attained value of max_{|u|=1} sum_j ||J_ij^T u|| and the maximisers (u, V)."""
    m = Ji.shape[0]
    g = g or torch.Generator().manual_seed(0)
    U0 = torch.randn(starts, m, generator=g)
    # plus the top left singular vectors of each block and of the concatenation
    extra = [torch.linalg.svd(Ji[:, j, :])[0][:, 0] for j in range(Ji.shape[1])]
    extra.append(torch.linalg.svd(Ji.reshape(m, -1))[0][:, 0])
    U = torch.cat([U0, torch.stack(extra)])
    U = U / U.norm(dim=1, keepdim=True)
    for _ in range(iters):
        W = torch.einsum("mjd,sm->sjd", Ji, U)  # J_ij^T u
        V = W / W.norm(dim=2, keepdim=True).clamp(min=1e-300)
        Z = torch.einsum("mjd,sjd->sm", Ji, V)
        U = Z / Z.norm(dim=1, keepdim=True).clamp(min=1e-300)
    W = torch.einsum("mjd,sm->sjd", Ji, U)
    vals = W.norm(dim=2).sum(dim=1)
    k = int(vals.argmax())
    V = W[k] / W[k].norm(dim=1, keepdim=True).clamp(min=1e-300)
    val = float(torch.einsum("mjd,jd->m", Ji, V).norm())  # attained ||sum_j J_ij v_j|| with unit v_j
    return val, U[k], V


def nu_all(J, **kw):
    return torch.tensor([nu_row(J[i], **kw)[0] for i in range(J.shape[0])])


def ascend_nu(f, X, r, i, starts, steps=60, lr=0.15, J0=None, inner=12, track=None):
    """Max over the given start offsets of nu_i(J_f(Y) [- J0]) along Adam ascent; returns best value and Y."""
    best, bestY = -1.0, X
    g = torch.Generator().manual_seed(1)
    for E0 in starts:
        E = clip(E0.clone(), r).requires_grad_(True)
        opt = torch.optim.Adam([E], lr=lr * r)
        for s in range(steps):
            Y = X + E
            Jy = jac(f, Y, create_graph=True)
            D = Jy if J0 is None else Jy - J0
            val, u, V = nu_row(D[i].detach(), starts=inner, iters=30, g=g)
            if val > best:
                best, bestY = val, Y.detach().clone()
            obj = torch.einsum("m,mjd,jd->", u, D[i], V)
            opt.zero_grad()
            (-obj).backward()
            opt.step()
            with torch.no_grad():
                E.copy_(clip(E, r))
    # final exact-ish evaluation at the best point with many inner starts
    Jb = jac(f, bestY)
    Db = Jb if J0 is None else Jb - J0
    best = max(best, nu_row(Db[i], starts=64, iters=200)[0])
    return best, bestY


def ascend_value(val_fn, X, r, starts, steps=80, lr=0.15):
    """Per token max of val_fn(Y) (T,) along Adam ascent from the start offsets (sum of tokens ascended,
    and each token separately when per_token)."""
    best = torch.zeros(X.shape[0])
    for E0 in starts:
        for tok in [None] + list(range(X.shape[0])):
            E = clip(E0.clone(), r).requires_grad_(True)
            opt = torch.optim.Adam([E], lr=lr * r)
            for _ in range(steps):
                v = val_fn(X + E)
                best = torch.maximum(best, v.detach())
                opt.zero_grad()
                (-(v.sum() if tok is None else v[tok])).backward()
                opt.step()
                with torch.no_grad():
                    E.copy_(clip(E, r))
            best = torch.maximum(best, val_fn(X + E.detach()).detach())
    return best


def random_starts(X, r, n, g):
    out = []
    for _ in range(n):
        E = torch.randn(X.shape, generator=g)
        out.append(r * E / E.norm(dim=1, keepdim=True))  # boundary
    return out


def adversarial_starts(layer, X, r, g):
    """Every token moved along the top singular directions of W_Q^h W_K^h^T (both sides, both signs), along
    the centring that shrinks each token's std, and along the gradient that flips each head's argmax."""
    from transcover.model import attention_scores

    attn = layer.attention
    out = []
    T, d = X.shape
    for h in range(attn.n_heads):
        G = attn.W_Q[h].double() @ attn.W_K[h].double().T
        Uq, _, Vk = torch.linalg.svd(G)
        for vec in (Uq[:, 0], Vk[0], Uq[:, 1], Vk[1]):
            for s in (1.0, -1.0):
                out.append(s * r * vec.expand(T, d).clone())
        # flip the argmax of every query: ascend s_i,second - s_i,first
        Xr = X.clone().requires_grad_(True)
        S = attention_scores(attn, Xr, h)
        top2 = S.detach().topk(2, dim=1).indices
        obj = (S.gather(1, top2[:, 1:2]) - S.gather(1, top2[:, :1])).sum()
        (gr,) = torch.autograd.grad(obj, Xr)
        out.append(r * gr / gr.norm(dim=1, keepdim=True).clamp(min=1e-300))
    c = X - X.mean(dim=1, keepdim=True)
    out.append(-r * c / c.norm(dim=1, keepdim=True))  # shrink the input tokens' std
    return out


def lnorm_shrink_start(fn_pre_norm, X, r):
    """Offset along -grad of the sum of the std of the norm's input (e.g. S1 = X + A(X) post-LN)."""
    Xr = X.clone().requires_grad_(True)
    S = fn_pre_norm(Xr)
    std = (S - S.mean(dim=1, keepdim=True)).norm(dim=1)
    (gr,) = torch.autograd.grad(std.sum(), Xr)
    return -r * gr / gr.norm(dim=1, keepdim=True).clamp(min=1e-300)


def with_eps(layer, eps):
    rep = lambda n: n if n is None or n.weight is None else dataclasses.replace(n, eps=eps)  # noqa: E731
    return dataclasses.replace(layer, norm_attn=rep(layer.norm_attn), norm_ffn=rep(layer.norm_ffn))
