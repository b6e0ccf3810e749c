"""Tangent maps of the whole stack's sub-stages at the data (issue 12; THEORY F30, F33).

Note [sub-stages].  A layer is split where its map is token-local: post-LN ``x -> x + A(x)``,
``norm_attn``, ``h -> h + FFN(h)``, ``norm_ffn``; pre-LN ``x -> x + A(norm_attn(x))`` and
``s -> s + FFN(norm_ffn(s))``.  Only the attention sub-stage mixes tokens; the others act on each
token by a ``d x d`` matrix (``_NormLin``, ``_TokenLin``).  The chain of ``_local_stack`` runs through
them, so the exact prefix is known at every norm and FFN input, per token (THEORY F33).

Each map has ``apply`` (columns, row convention ``(N, T, d)``), ``apply_t`` (the transposed map on
rows) and the *abs evaluation* (``absval=True``: the same expression tree on the absolute values of
its operands, every subtraction an addition; Note [stack rounding] in ``_local_stack``), and ``k``:
a generous count of the longest chain of roundings through one application, the construction of its
per-token matrices included.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._errors import InputError
from ..model import NormKind, NormSpec
from ._local_jacobian import centre_tokens, norm_jacobian_entry_error, norm_jacobian_error
from ._rounding import root_sq_plus

__all__ = ["_NormLin", "_AttnLin", "_AttnRes", "_TokenLin", "check_stack_layer"]


def _f64(W) -> Tensor:  # noqa: ANN001
    return torch.as_tensor(W, dtype=torch.float64).detach()


class _NormLin:
    """Row-convention tangent map of a LayerNorm/RMSNorm at Z: ``r -> gamma (P r - u (u.r)) / s``."""

    def __init__(self, norm: NormSpec, Z: Tensor) -> None:
        if norm.kind is NormKind.BALL:
            raise InputError("the stack route does not cover Pi_norm; the product route does")
        d = Z.shape[1]
        self.lay = norm.kind is NormKind.LAYERNORM
        Zc, sig_hat, self.sigma = centre_tokens(Z, self.lay)  # sigma certified low, for the floors (F17e)
        self.s = root_sq_plus(sig_hat, float(norm.eps))
        self.u = Zc / (math.sqrt(d) * self.s[:, None])
        self.g = torch.ones(d, dtype=torch.float64) if norm.weight is None else _f64(norm.weight)
        self.norm = norm
        self.k = 8 * d + 8
        self.err = norm_jacobian_error(norm, Z, formed=True)  # ||D*|| <= max|gamma|/s + err (F17f)
        # F17f's entrywise bound on |(D - D_true) r|, linear in |r|: the abs evaluation carries it divided by
        # gamma_k, so gamma_k (or any larger gamma) times it covers the factors' error too
        c1, c2, beta, ustar = norm_jacobian_entry_error(norm, Z)
        w = 1 / (self.k * 2.0**-53) * (1 + 1e-12)
        self.model = (c1 * w, c2 * w, beta, ustar)

    def _core(self, r: Tensor, absval: bool = False) -> Tensor:
        sg, u = (1.0, self.u.abs()) if absval else (-1.0, self.u)
        rc = r + sg * r.mean(dim=-1, keepdim=True) if self.lay else r
        return (rc + sg * u * (r * u).sum(dim=-1, keepdim=True)) / self.s[:, None]

    def _model(self, r: Tensor, transposed: bool) -> Tensor:
        """``|(D - D_true) r|`` (``transposed``: ``|(D - D_true)^T r|``) entrywise over ``gamma_k``, from ``|r|`` (F17f)."""
        c1, c2, beta, ustar = self.model
        r, u = r.abs(), self.u.abs()
        dot = lambda a, b: (a * b).sum(dim=-1, keepdim=True)  # noqa: E731
        if not transposed:
            mean = r.mean(dim=-1, keepdim=True) if self.lay else 0.0
            return c1 * (r + mean + u * dot(u, r)) + c2 * (beta * dot(u, r) + ustar * dot(beta, r))
        a, b = c1 * r, c2 * r  # the transpose: the diagonal factors act on r first
        mean = a.mean(dim=-1, keepdim=True) if self.lay else 0.0
        return a + mean + u * dot(u, a) + u * dot(beta, b) + beta * dot(ustar, b)

    def apply(self, K: Tensor, absval: bool = False) -> Tensor:
        out = (self.g.abs() if absval else self.g) * self._core(K, absval)
        return out + self._model(K, False) if absval else out

    def apply_t(self, C: Tensor, absval: bool = False) -> Tensor:
        out = self._core((self.g.abs() if absval else self.g) * C, absval)
        return out + self._model(C, True) if absval else out

    def matrices(self, absval: bool = False) -> Tensor:
        """(T, d, d) the per-token Jacobians ``D_i`` (column convention), or their abs evaluation."""
        T, d = self.u.shape
        eye = torch.eye(d, dtype=torch.float64)
        return self.apply(eye[:, None, :].expand(d, T, d), absval).permute(1, 2, 0)


class _AttnLin:
    """Row-convention tangent map of dot-product attention at Xin (heads batched, biases folded)."""

    def __init__(self, attn, Xin: Tensor) -> None:  # noqa: ANN001
        from ._local_attention import certified_weights

        T, d = Xin.shape
        sc = attn.softmax_scale
        Xa = torch.cat([Xin, torch.ones(T, 1, dtype=torch.float64)], dim=1)
        hs = [tuple(_f64(W) for W in attn.head(h)) for h in range(attn.n_heads)]
        self.Q = torch.stack([sc * (Xa @ _f64(attn.W_Q_augmented(h))) for h in range(attn.n_heads)])  # (H,T,dh)
        self.K = torch.stack([Xin @ Wk for _, Wk, _, _ in hs])
        self.V = torch.stack([Xin @ Wv for _, _, Wv, _ in hs])
        self.P = torch.stack([certified_weights(attn, Xin, h) for h in range(attn.n_heads)])
        cat = lambda Ws: torch.cat(list(Ws), dim=1)  # noqa: E731  (d, H dh)
        self.W3 = torch.cat([sc * cat(h[0] for h in hs), cat(h[1] for h in hs), cat(h[2] for h in hs)], dim=1)
        self.Wo = torch.cat([h[3] for h in hs], dim=0)  # (H dh, d)
        self.H, self.dh = attn.n_heads, hs[0][0].shape[1]
        self.aQ, self.aK, self.aV, self.aW3, self.aWo = (A.abs() for A in (self.Q, self.K, self.V, self.W3, self.Wo))

    def _split(self, Z: Tensor) -> tuple[Tensor, ...]:
        N, T, _ = Z.shape
        Z = Z.reshape(N, T, 3, self.H, self.dh).permute(2, 0, 3, 1, 4)  # (3, N, H, T, dh)
        return Z[0], Z[1], Z[2]

    def _f(self, absval: bool) -> tuple:
        if absval:
            return self.aQ, self.aK, self.aV, self.aW3, self.aWo, 1.0
        return self.Q, self.K, self.V, self.W3, self.Wo, -1.0

    def apply(self, dX: Tensor, absval: bool = False) -> Tensor:
        Q, K, V, W3, Wo, sg = self._f(absval)
        dQ, dK, dV = self._split(dX @ W3)
        ds = dQ @ K.transpose(-1, -2) + Q @ dK.transpose(-1, -2)
        dP = self.P * (ds + sg * (self.P * ds).sum(dim=-1, keepdim=True))
        dO = dP @ V + self.P @ dV  # (N, H, T, dh)
        N, _, T, _ = dO.shape
        return dO.permute(0, 2, 1, 3).reshape(N, T, -1) @ Wo

    def apply_t(self, C: Tensor, absval: bool = False) -> Tensor:
        Q, K, V, W3, Wo, sg = self._f(absval)
        N, T, _ = C.shape
        gO = (C @ Wo.T).reshape(N, T, self.H, self.dh).permute(0, 2, 1, 3)
        gdP = gO @ V.transpose(-1, -2)
        gV = self.P.transpose(-1, -2) @ gO
        gds = self.P * (gdP + sg * (self.P * gdP).sum(dim=-1, keepdim=True))
        gQ = gds @ K
        gK = gds.transpose(-1, -2) @ Q
        G = torch.stack([gQ, gK, gV]).permute(1, 3, 0, 2, 4).reshape(N, T, -1)
        return G @ W3.T


class _AttnRes:
    """The attention sub-stage ``x -> x + A(n1(x))`` (``n1``: the pre-LN norm, or None post-LN)."""

    def __init__(self, att: _AttnLin, n1: _NormLin | None, T: int, d: int) -> None:
        self.att, self.n1 = att, n1
        self.k = 8 * (d + T + att.H * att.dh) + 8 + (0 if n1 is None else n1.k)

    def apply(self, K: Tensor, absval: bool = False) -> Tensor:
        return K + self.att.apply(K if self.n1 is None else self.n1.apply(K, absval), absval)

    def apply_t(self, C: Tensor, absval: bool = False) -> Tensor:
        A = self.att.apply_t(C, absval)
        return C + (A if self.n1 is None else self.n1.apply_t(A, absval))


class _TokenLin:
    """A token-local sub-stage with per-token matrices (column convention) ``M`` and their abs
    evaluation ``Ma``: ``dOut_i = dX_i M_i^T``."""

    def __init__(self, M: Tensor, Ma: Tensor, k: int) -> None:
        self.Mt = M.transpose(1, 2).contiguous()
        self.Mat = Ma.transpose(1, 2).contiguous()
        self.k = k

    def apply(self, K: Tensor, absval: bool = False) -> Tensor:
        return torch.einsum("nti,tij->ntj", K, self.Mat if absval else self.Mt)

    def apply_t(self, C: Tensor, absval: bool = False) -> Tensor:
        return torch.einsum("ntj,tij->nti", C, self.Mat if absval else self.Mt)


def check_stack_layer(layer) -> None:  # noqa: ANN001
    attn, ffn = layer.attention, layer.ffn
    if layer.residual.value == "parallel" or ffn.gated or attn.kind != "dot" or attn.rope is not None \
            or attn.q_norm is not None or attn.k_norm is not None or attn.softcap is not None \
            or attn.window is not None or getattr(layer, "post_norm_attn", None) is not None \
            or getattr(layer, "post_norm_ffn", None) is not None:
        raise InputError(f"the stack route (THEORY F30) covers sequential layers with plain dot attention, a "
                         f"non-gated FFN and no branch-output norm; layer {layer.index} is outside it")
