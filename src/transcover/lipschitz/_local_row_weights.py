"""Per-token optimised weights of the weighted row Gram (issue 12; THEORY F56).

Note [optimised row weights].  Note [weighted row Gram]'s bound ``nu_i(J)^2 <= lambda_max(sum_j J_ij J_ij^T
/ w_ij) sum_j w_ij`` holds for every positive ``w``; ``row_weights`` (F34c) is one fixed proxy per layer.  The
bound is scale-free in ``w_i.``, convex in ``w_i.`` on the simplex, and stationary where ``w_ij`` is proportional
to ``||J_ij^T u_i||`` at the top eigenvector ``u_i`` of the weighted Gram; there it equals
``(sum_j ||J_ij^T u_i||)^2 <= nu_i^2``, the bound is attained.  The weights here come from a few fixed-point
steps toward that condition, the Gram applied as an operator (``J_ij^T u`` for all ``j`` at once, in the head
space, never the ``T^2`` blocks); the Gram of the attention sublayer is then rebuilt once with them and every
stage certified as before.  Soundness does not depend on the weights (any positive ones are valid), only on
the same certified formula; the rule is a heuristic choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._local_jacobian import pow2_norm

# the relative floor of a row's weights (a zero block, e.g. a masked key, gets this fraction of the row's largest
# weight: ``sum_j w_ij`` grows by at most ``T`` times it) and the fixed-point steps, measured (THEORY F56)
FLOOR = 1e-9
STEPS = 12


@dataclass(frozen=True)
class BlockOps:
    """The attention sublayer's Jacobian blocks ``B_ij`` as operators, all tokens at once (Note [weighted row
    Gram]): ``Poff`` (H, T, T) the softmax weights without the diagonal, ``V`` (H, T, T, dh) the ``v^h_ij``,
    ``Q`` (H, T, d), ``Wv`` (H, d, dh), ``Wo_all`` (H dh, d), ``Bii`` (T, d, d) the exact diagonal blocks and
    ``nN`` (T,) the bounds on ``||N_j||`` pre-LN (None post-LN): the blocks ``j != i`` enter the Gram as
    ``||N_j|| W_O^T Z_ij`` (``N_j N_j^T <= ||N_j||^2 I``)."""

    Poff: Tensor
    V: Tensor
    Q: Tensor
    Wv: Tensor
    Wo_all: Tensor
    Bii: Tensor
    nN: Tensor | None

    @staticmethod
    def of(heads, Wo_all: Tensor, Bii: Tensor, nN: Tensor | None) -> BlockOps:  # noqa: ANN001
        T = Bii.shape[0]
        off = 1 - torch.eye(T, dtype=torch.float64)
        return BlockOps(torch.stack([hd[0] * off for hd in heads]), torch.stack([hd.values for hd in heads]),
                        torch.stack([hd[2] for hd in heads]), torch.stack([hd[5] for hd in heads]), Wo_all, Bii, nN)

    def vjp(self, z: Tensor) -> Tensor:
        """(T, T, d) ``B_ij^T z_i`` for all ``i, j`` (``j != i``: ``||N_j|| Z_ij^T W_O z_i``)."""
        H, T, _, dh = self.V.shape
        x = (z @ self.Wo_all.T).reshape(T, H, dh).transpose(0, 1)  # (H, T, dh): W_O z_i per head
        a = torch.einsum("hda,hia->hid", self.Wv, x)  # W_V x
        c = torch.einsum("hija,hia->hij", self.V, x)  # v_ij . x
        G = torch.einsum("hij,hid->ijd", self.Poff, a) + torch.einsum("hij,hid->ijd", self.Poff * c, self.Q)
        if self.nN is not None:
            G = G * self.nN[None, :, None]
        idx = torch.arange(T)
        G[idx, idx] = torch.einsum("ia,iab->ib", z, self.Bii)
        return G

    def jvp(self, U: Tensor) -> Tensor:
        """(T, d) ``sum_j B_ij U_ij`` (the adjoint of ``vjp``)."""
        H, T, _, dh = self.V.shape
        idx = torch.arange(T)
        Uo = U * self.nN[None, :, None] if self.nN is not None else U
        s = torch.einsum("hij,ijd->hid", self.Poff, Uo)
        s = torch.einsum("hid,hda->hia", s, self.Wv)
        t = torch.einsum("hid,ijd->hij", self.Q, Uo)
        s = s + torch.einsum("hij,hija->hia", self.Poff * t, self.V)
        return s.transpose(0, 1).reshape(T, H * dh) @ self.Wo_all + torch.einsum("iab,ib->ia", self.Bii, U[idx, idx])


def _floored(g: Tensor) -> Tensor:
    return torch.maximum(g, FLOOR * g.max(dim=1, keepdim=True).values).clamp(min=1e-300)


def optimised_weights(ops, M: Callable[[Tensor], Tensor], Mt: Callable[[Tensor], Tensor], u: Tensor,  # noqa: ANN001
                      w: Tensor, steps: int = STEPS) -> Tensor:
    """(T, T) positive weights for the row Grams of ``J_ij = M_i B_ij`` (Note [optimised row weights]): from
    ``w`` and the start directions ``u`` (T, d), ``steps`` rounds of one power step on the weighted Gram
    ``M_i S_i M_i^T`` as an operator (``u <- M_i sum_j B_ij B_ij^T M_i^T u / w_ij``, normalised) and
    ``w_ij <- ||B_ij^T M_i^T u_i||`` (floored at ``FLOOR`` of the row's largest).  ``ops``: ``vjp``/``jvp`` of the
    blocks (``BlockOps``); ``M``/``Mt`` apply ``M_i``, ``M_i^T`` to (T, d).  Heuristic (THEORY F56): any positive
    result gives a valid bound.
    The weights' norms at powers of two (``pow2_norm``: they scale with the blocks below ``2^-537`` too)."""
    G = ops.vjp(Mt(u))
    for _ in range(steps):
        y = M(ops.jvp(G / w[:, :, None]))
        y = y / y.abs().amax(dim=1, keepdim=True).clamp(min=1e-300)  # the norm's squares would overflow past 1e154
        G = ops.vjp(Mt(y / y.norm(dim=1, keepdim=True).clamp(min=1e-300)))
        w = _floored(pow2_norm(G, 2))  # at a power of two: weights scale with the blocks (torch's norm flushed at 2^-537)
    return w


def _pick(mask: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Per token (leading index) ``b`` where ``mask``, else ``a``."""
    return torch.where(mask.reshape(-1, *([1] * (a.dim() - 1))), b, a)


def stage_weights(at, gram, pt) -> Tensor:  # noqa: ANN001
    """(T, T) F56's weights for the stage that sets the next radius: post-LN ``g_pt``'s map ``P (I + F) D1`` (``P``
    the centring when a LayerNorm follows), pre-LN the layer's ``M = I + F D2``; from F34c's ``row_weights`` and the
    attention Gram's Ritz vectors mapped forward; a row that degenerates (not finite, or all zero) keeps F34c's."""
    from ._local_rows import row_weights
    from ._local_stages import _centred, _centring

    nN = None if at.post else at.nD1
    ops = BlockOps.of(at.heads, at.Wo_all, gram.Bii, nN)
    mv = lambda A, x: (A @ x[:, :, None])[:, :, 0]  # noqa: E731
    if at.post:
        n1, IF = at.n1, pt.IF
        P = _centred if _centring(at.layer.norm_ffn) else (lambda v: v)
        M = lambda x: P(mv(IF, n1.left(x[:, :, None])[0][:, :, 0]))  # noqa: E731
        Mt = lambda u: n1.right(mv(IF.transpose(1, 2), P(u))[:, None, :])[0][:, 0, :]  # noqa: E731
    else:
        M = lambda x: mv(pt.M, x)  # noqa: E731
        Mt = lambda u: mv(pt.M.transpose(1, 2), u)  # noqa: E731
    w0 = row_weights(at.heads, at.T, at.nO, nN)
    w = optimised_weights(ops, M, Mt, M(gram.x), w0)
    return _pick(~torch.isfinite(w.sum(dim=1)) | ~(w.amax(dim=1) > 1e-200), w, w0)


def reweighted(at, gram, pt):  # noqa: ANN001, ANN201
    """(``RowGram``, ``PostPoint``/``PrePoint``) with F56's optimised weights joined in (THEORY F56): the
    weights of ``stage_weights``, one more row Gram with them, every stage's row constant re-certified, and per
    token and stage the smaller of the two kept (both are valid bounds).  The row Gram carried on (for F46/F54's
    first-norm Grams) is per token the one with the smaller ``h_pt`` (pre-LN ``point``); the Ritz vectors of
    ``point`` by ``point``."""
    from dataclasses import replace

    from ._local_stages import attention_row_gram, post_rows, pre_rows

    g2 = attention_row_gram(at, stage_weights(at, gram, pt))
    if at.post:
        new = post_rows(at, g2, pt.IF, pt.nIF)
        names = ("aP_pt", "h_pt", "g_pt", "point")
        keep = new[1] < pt.h_pt
    else:
        new = pre_rows(g2, pt.M, pt.eM, pt.nM)
        names = ("point",)
        keep = new[0] < pt.point
    better = new[len(names) - 1] < pt.point
    fin = lambda v: torch.nan_to_num(v, nan=math.inf)  # noqa: E731  (a NaN never wins a min)
    vals = {k: torch.minimum(getattr(pt, k), fin(v)) for k, v in zip(names, new)}
    a_pt = torch.minimum(gram.a_pt, fin(g2.a_pt))
    pt = replace(pt, a_pt=a_pt, x=_pick(better, pt.x, new[-1]), **vals)
    S1 = None if gram.S1 is None else tuple(_pick(keep, u, v) for u, v in zip(gram.S1, g2.S1))
    gram = replace(gram, S=_pick(keep, gram.S, g2.S), err=_pick(keep, gram.err, g2.err),
                   wsum=_pick(keep, gram.wsum, g2.wsum), a_pt=a_pt, x=_pick(keep, gram.x, g2.x), S1=S1)
    return gram, pt
