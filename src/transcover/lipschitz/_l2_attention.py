r"""L2 self-attention (Kim, Papamakarios, Mnih, ICML 2021, arXiv 2006.04710): globally Lipschitz.

Head ``h`` with tied query/key map ``W_Q^h`` (d x d_h) and value map ``W_V^h``:

.. math::

    P^h_{ij} = \mathrm{softmax}_j\Big(-\frac{\|x_i W_Q^h - x_j W_Q^h\|_2^2}{\sqrt{d_h}}\Big),\qquad
    f^h(X) = P^h X A_h W_V^h,\quad A_h = \frac{W_Q^h W_Q^{hT}}{\sqrt{d_h}}

and the block outputs ``sum_h f^h(X) W_O^h`` (= ``[f^1 ... f^H] W_O``).  Kim et al. write
``sqrt(D/H)`` for the head dimension; here it is ``d_h`` (equal when ``d_h = d / H``).  Tying
``W_K = W_Q`` is what makes the map Lipschitz (their Thm 3.2); dot-product attention is not
(their Thm 3.1, THEORY F13).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._errors import InputError

__all__ = ["l2_attention_forward", "phi_inverse", "l2_attention_lipschitz"]


def l2_attention_forward(X: Tensor, W_Q: Tensor, W_V: Tensor, W_O: Tensor) -> Tensor:
    """Multi-head L2 self-attention (no residual), Kim et al. 2021 eq. (L2-MHA).

    Args:
        X: ``(B, T, d)`` (or ``(T, d)``).
        W_Q: ``(H, d, d_h)``, tied query/key map.
        W_V: ``(H, d, d_h)``.
        W_O: ``(H, d_h, d)``.

    Returns:
        ``(B, T, d)`` (or ``(T, d)``): ``sum_h softmax(-||x_i W_Q^h - x_j W_Q^h||^2/sqrt(d_h)) X A_h W_V^h W_O^h``.
    """
    dh = W_Q.shape[-1]
    q = torch.einsum("...td,hde->...hte", X, W_Q)  # (B, H, T, dh)
    # ||q_i - q_j||^2 = ||q_i||^2 - 2 q_i.q_j + ||q_j||^2; the ||q_i||^2 term is constant in j and
    # cancels in the softmax, but keeping the exact distance costs nothing and mirrors the paper.
    sq = (q * q).sum(-1)
    dist2 = sq[..., :, None] - 2.0 * q @ q.transpose(-1, -2) + sq[..., None, :]
    P = torch.softmax(-dist2 / math.sqrt(dh), dim=-1)  # (B, H, T, T)
    A = W_Q @ W_Q.transpose(-1, -2) / math.sqrt(dh)  # (H, d, d)
    value_map = A @ W_V @ W_O  # (H, d, d): A_h W_V^h W_O^h
    PX = torch.einsum("...hts,...sd->...htd", P, X)  # (B, H, T, d)
    return torch.einsum("...htd,hde->...te", PX, value_map)


def phi_inverse(y: float) -> float:
    r"""Inverse of ``phi(x) = x e^{x+1}`` on ``x >= 0``: ``phi^{-1}(y) = W_0(y / e)``.

    .. math:: x e^{x+1} = y \iff x e^x = y/e \iff x = W_0(y/e)

    Kim et al. 2021, Thm 3.2.  ``phi^{-1}(N-1) ~ log N - log log N``.

    Example:
        >>> round(4 * phi_inverse(1.0) + 1, 4)
        2.1139
    """
    from scipy.special import lambertw

    if y < 0:
        raise InputError(f"phi_inverse needs y >= 0, but got y={y}")
    return float(lambertw(y / math.e, 0).real)


def l2_attention_lipschitz(B_Q: list[float], B_V: list[float], B_O: float, d_head: int, seq_len: int,
                           *, metric: str = "fro") -> float:
    r"""Kim et al. 2021 Thm 3.2 bound on L2 multi-head attention (globally, no radius assumption).

    .. math::

        \mathrm{Lip}_2 \le \frac{\sqrt N}{\sqrt{d_h}}\,\big(4\phi^{-1}(N-1) + 1\big)
        \Big(\sum_h \|W_Q^h\|_2^2 \|W_V^h\|_2^2\Big)^{1/2} \|W_O\|_2

    Source: Kim, Papamakarios, Mnih 2021, Thm 3.2 (the ``Lip_2`` statement, THEORY F13), with the
    head dimension ``d_h`` for their ``D/H``.  This is the Frobenius metric on ``N x d`` inputs.
    In ``(2,inf)``: ``||dY||_{2,inf} <= ||dY||_F <= Lip_2 ||dX||_F <= Lip_2 sqrt(N) ||dX||_{2,inf}``.
    Assumptions: none on the input domain; N = sequence length.

    Raises:
        InputError: for non-positive seq_len or d_head.
    """
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise InputError(f"L2 attention bound needs seq_len > 0, but got seq_len={seq_len!r}")
    if d_head <= 0:
        raise InputError(f"d_head must be > 0, but got d_head={d_head}")
    N = seq_len
    lip2 = (math.sqrt(N) / math.sqrt(d_head) * (4.0 * phi_inverse(N - 1.0) + 1.0)
            * math.sqrt(sum((q * v) ** 2 for q, v in zip(B_Q, B_V))) * B_O)
    if metric == "fro":
        return lip2
    if metric == "2,inf":
        return lip2 * math.sqrt(N)
    raise InputError(f"metric must be '2,inf' or 'fro', but got metric={metric!r}")
