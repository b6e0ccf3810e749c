"""The constructive Transformer of Lemma H.1, as a :class:`~transcover.model.ReferenceTransformer`.

Layout of a token row (``d_model = 1 + d_p + 1 + s``), all scaled by κ:

    [ content z_t | positional encoding p_t (d_p) | constant 1 | s output slots (0 on input) ]

* the input embedding writes ``κ z_t`` into the content slot; the (fixed) positional embedding
  writes ``κ p_t`` and the constant ``κ``;
* head ``k`` (one per relevant position ``i_k``, ``d_head = d_p``) has its query driven by the
  constant slot and aimed at ``p_{i_k}`` with temperature R, its key reading the encoding (and,
  with ``key_leak = λ``, the content along ``p_{i_k}``), so the score of key ``j`` is exactly

  .. math::  R\\,(\\langle p_{i_k}, p_j\\rangle + \\lambda z_j);

  its value carries the content, and ``W_O`` writes ``γ``·(attention average) into output slot k;
* the block's FFN is zero (identity through the residual) and the MLP head, reading the first
  token, is the simplicial-interpolation network of ``h o ψ^{-1}`` on the read-out box ``[-1,1]^s``
  (``ψ(z_I) = γ z_I`` is the γ-injective read-out).

With ``norm="ball"``, ``κ = 1/sqrt(3 + s)`` keeps every row inside the unit ball at every stage
(``||row||^2 <= κ^2 (1 + 1 + 1 + s γ^2)``), so Π_norm is the identity on every input in the content
box and the network computes exactly the formulas above; with ``norm="none"``, ``κ = 1``.

Error (THEORY F16a, F16c), for every Z in ``[-1, 1]^n``: the softmax gap of head k is
``g_k >= R (1 - Δ_k - 2λ)`` with ``Δ_k = max_{j≠i_k} <p_{i_k}, p_j>`` (target score ``>= R(1-λ)``,
others ``<= R(Δ_k + λ)``), the off-target mass is ``<= m(g) = (n-1)e^{-g}/(1+(n-1)e^{-g})`` and the
read-out error ``|ψ̂_k - ψ_k| <= 2γ m(g_k)`` (value spread 2γ).  The head is ``L_k``-Lipschitz in
coordinate k (exact, from its node values), so

.. math::

    \\sup_Z |F(Z) - g^*(Z)| \\le \\underbrace{\\sum_k L_k\\, 2\\gamma\\, m(g_k)}_{\\text{attention}}
    + \\underbrace{\\tfrac{L}{\\max(1,\\beta)} \\gamma^{-\\beta} (\\delta\\sqrt{s})^\\beta}_{\\text{MLP}}.

The lemma's form ``sum_k L_k 2γ n e^{-R(1-2Δ)}`` is larger whenever ``λ <= Δ/2`` (then
``g_k >= R(1 - 2Δ)`` and ``m(g) <= n e^{-g}``); ``key_leak = Δ/2`` realises its worst case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError
from .._results import Kind, Quantity
from ..model import ReferenceConfig, ReferenceTransformer
from ._encodings import Encoding
from ._simplicial import SimplicialMLP, simplicial_error_bound, simplicial_mlp
from ._targets import SparseTarget

__all__ = ["Construction", "ConstructionBound", "build_construction", "off_target_mass_bound"]


def off_target_mass_bound(n: int, gap: float) -> float:
    """Softmax mass off the target when it beats all other n − 1 scores by ``gap`` (THEORY F16a).

    .. math::  1 - \\pi_{i^*} \\le \\frac{(n-1)e^{-g}}{1 + (n-1)e^{-g}}

    (``π_{i*} = 1/(1 + Σ_j e^{a_j - a_{i*}}) >= 1/(1 + (n-1)e^{-g})``); valid for every real g.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"n must be an integer >= 1, but got n={n!r}")
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or math.isnan(gap):
        raise InputError(f"gap must be a number, but got gap={gap!r}")
    if n == 1:
        return 0.0
    # t/(1 + t), t = (n-1)e^{-g}, in log space: for t <= 1 as t/(1 + t), which underflows to 0 for huge
    # gaps, for t > 1 as 1/(1 + 1/t); exp(-log t) overflowed for gaps beyond ln(n-1) + 709.8 (an
    # OverflowError at R = 1000 before stop 36)
    log_t = math.log(n - 1) - gap
    if log_t <= 0.0:
        t = math.exp(log_t)
        return t / (1.0 + t)
    return 1.0 / (1.0 + math.exp(-log_t))


@dataclass(frozen=True)
class ConstructionBound:
    """The lemma's error budget for one construction (all ``CERTIFIED_UPPER`` in exact arithmetic)."""

    gaps: tuple[float, ...]  # g_k >= R(1 - Δ_k - 2λ), per head
    readout_bound: tuple[float, ...]  # 2γ m(g_k), per head, sup |ψ̂_k - ψ_k|
    attention: Quantity  # sum_k L_k 2γ m(g_k)
    mlp: Quantity  # simplicial interpolation error
    total: Quantity
    lemma_attention: Quantity  # sum_k L_k 2γ n e^{-R(1-2Δ)} (the seed's form, F16a)

    def to_dict(self) -> dict[str, object]:
        return {"gaps": list(self.gaps), "readout_bound": list(self.readout_bound),
                "attention": self.attention.to_dict(), "mlp": self.mlp.to_dict(),
                "total": self.total.to_dict(), "lemma_attention": self.lemma_attention.to_dict()}


@dataclass(frozen=True)
class Construction:
    """A built Lemma H.1 model with everything needed to read and bound it."""

    model: ReferenceTransformer
    target: SparseTarget
    encoding: Encoding
    mlp: SimplicialMLP
    R: float
    gamma: float
    key_leak: float
    kappa: float

    @property
    def n(self) -> int:
        return self.encoding.n

    @property
    def s(self) -> int:
        return self.target.sparsity

    @property
    def output_slots(self) -> list[int]:
        d_p = self.encoding.dim
        return [d_p + 2 + k for k in range(self.s)]

    def inputs(self, Z: Tensor) -> Tensor:
        """Model input (N, n, 1) float64 from contents (N, n)."""
        return Z.double()[..., None] if Z.dim() == 2 else Z.double()

    def __call__(self, Z: Tensor) -> Tensor:
        """F(Z), shape (N,)."""
        return self.model(self.inputs(Z))[:, 0]

    def readout(self, Z: Tensor) -> Tensor:
        """ψ̂(Z): what attention delivers to the head, in read-out coordinates (N, s)."""
        feats = self.model.features(self.inputs(Z))
        return feats[:, 0, self.output_slots] / self.kappa

    def ideal_readout(self, Z: Tensor) -> Tensor:
        """ψ(Z) = γ z_I: the read-out with perfectly sparse attention (N, s)."""
        Z = Z[..., 0] if Z.dim() == 3 else Z
        return self.gamma * Z.double()[:, list(self.target.indices)]

    def head_on_readout(self, psi: Tensor) -> Tensor:
        """The model's own MLP head applied to a read-out ψ (N, s), through the first-token row."""
        D = self.model.cfg.d_model
        z = torch.zeros(psi.shape[0], D, dtype=torch.float64)
        z[:, self.output_slots] = self.kappa * psi.double()
        for i, lin in enumerate(self.model.head):
            z = lin(z)
            if i < len(self.model.head) - 1:
                z = torch.relu(z)
        return z[:, 0]

    def bound(self) -> ConstructionBound:
        """The error budget of the docstring above for this construction."""
        P = self.encoding.P.double()
        n, s, R, lam, gam = self.n, self.s, self.R, self.key_leak, self.gamma
        G = P @ P.T
        gaps, readout = [], []
        d_p = P.shape[1]
        gram_err = (d_p + 2) * 2.0**-52  # |fl(<p_i, p_j>) - <p_i, p_j>| for rows of norm <= 1 + 64 d eps
        for i in self.target.indices:
            others = torch.cat([G[i, :i], G[i, i + 1:]])
            # rounded in the claim's direction (stop 38: equiangular codes make the read-out bound exactly tight, and
            # plain float64 put it 1 ulp below the network's own sup): Δ_k up by the Gram's rounding, the gap down,
            # the read-out bound up. The target's own score is R <p_i, p_i>, not R: a row 2.6e-12 short of unit
            # norm (coherence admits 64 d eps) lost that much gap, and at R = 1e14 the bound fell 30x under the
            # network's error (red team 163)
            delta_k = float(others.max()) + gram_err if others.numel() else -1.0
            own = float(G[i, i]) - gram_err
            g = math.nextafter(R * (own - delta_k - 2.0 * lam) * (1.0 - 2.0**-50), -math.inf)
            gaps.append(g)
            readout.append(_up(2.0 * gam * off_target_mass_bound(n, g)))
        L = self.mlp.axis_lipschitz
        attn = _up(sum(Lk * r for Lk, r in zip(L, readout)))
        beta, Lh = self.target.beta, self.target.holder_constant
        mlp = simplicial_error_bound(beta, Lh, s, self.mlp.N, self.mlp.lo, self.mlp.hi, gam)
        Delta = self.encoding.delta
        # the seed's form, rounded up; it is certified only where it dominates the certified attention part (its
        # derivation needs unit rows and lambda <= Delta / 2 in exact arithmetic: the float test 2 lambda <= Delta +
        # 1e-15 certified 6.7e-8 against an attained 1.7e-7 at R = 1e15, and an underflowed 0 at R = 1e300; 163)
        lemma = _up(sum(L) * 2.0 * gam * n * math.exp(-R * (1.0 - 2.0 * Delta)))
        src = "Lemma H.1 / THEORY F16a,c"
        assumptions = ("contents in [-1, 1]", f"key_leak={lam}", f"beta={beta}, L={Lh}",
                       "the network in exact arithmetic: a float64 evaluation adds its own rounding (about 1e-16 of "
                       "the outputs), which the bound does not include")
        return ConstructionBound(
            tuple(gaps), tuple(readout),
            Quantity(attn, Kind.CERTIFIED_UPPER, src + " (attention part)", assumptions),
            Quantity(mlp, Kind.CERTIFIED_UPPER, src + " (MLP part, simplicial interpolation)", assumptions),
            Quantity(math.nextafter(attn + mlp, math.inf), Kind.CERTIFIED_UPPER, src, assumptions),
            Quantity(lemma, Kind.CERTIFIED_UPPER if lemma >= attn else Kind.ESTIMATE,
                     "seed section 4.2: n e^{-R(1-2Δ)} x value spread x head Lipschitz (certified where it is at "
                     "least the attention part)", assumptions),
        )


_SUB = 2.0**-1074


def _up(x: float) -> float:
    """``x`` (a few roundings of products, quotients and ``exp`` away from its exact value) rounded up: ``2^-47``
    relative, plus eight subnormal steps where the relative pad is lost below float64's normal range (red team 163:
    5.09e-322 against an exact 5.0987e-322)."""
    return math.nextafter(x * (1.0 + 2.0**-47) + 8 * _SUB, math.inf)


def build_construction(target: SparseTarget, encoding: Encoding, *, R: float, grid: int,
                       gamma: float = 1.0, key_leak: float = 0.0, norm: str = "ball",
                       max_width: int = 20000) -> Construction:
    """Build the Lemma H.1 Transformer for a Hölder I-sparse target (see the module docstring).

    Args:
        target: an I-sparse target with ``beta`` and ``holder_constant`` (e.g. :func:`holder_ridge`).
        encoding: unit positional encodings for ``n >= max(I) + 1`` positions.
        R: attention temperature > 0.  grid: cells per axis N of the MLP's interpolation grid.
        gamma: read-out injectivity γ in (0, 1].  key_leak: content cross-term λ in [0, 1/2).
        norm: ``"ball"`` (the seed's Π_norm) or ``"none"``.

    Returns:
        a :class:`Construction` whose ``model`` is a float64 ``ReferenceTransformer``.

    Raises:
        InputError: on a non-positive R or grid, γ or λ out of range, a Boolean target,
            encodings with Δ >= 1/2, or encodings too short for the index set.
    """
    if not (isinstance(R, (int, float)) and R > 0 and math.isfinite(R)):
        raise InputError(f"temperature R must be > 0, but got R={R!r}")
    if not (0.0 < gamma <= 1.0):
        raise InputError(f"gamma must be in (0, 1], but got gamma={gamma!r}")
    if not (0.0 <= key_leak < 0.5):
        raise InputError(f"key_leak must be in [0, 1/2), but got key_leak={key_leak!r}")
    if norm not in ("ball", "none"):
        raise InputError(f"norm must be 'ball' or 'none' for the construction, but got norm={norm!r}")
    if target.beta is None or target.holder_constant is None:
        raise InputError(f"the construction needs a Hölder target (beta, constant), but got {target.name!r}")
    n, d_p = encoding.P.shape
    s = target.sparsity
    if not (0.0 <= encoding.delta < 0.5):
        raise InputError(f"Lemma H.1 needs encodings with Delta in [0, 1/2), but got Delta={encoding.delta:.6g} "
                         f"({encoding.family}, n={n}, d_p={d_p})")
    if max(target.indices) >= n:
        raise InputError(f"index {max(target.indices)} in I needs n > {max(target.indices)}, but the encoding has n={n}")
    import numpy as np

    with np.errstate(all="ignore"):  # an overflowing head is refused below, in one line
        mlp = simplicial_mlp(lambda U: target.h(U / gamma), s, grid, -1.0, 1.0, max_width=max_width)
    if not all(np.isfinite(W).all() and np.isfinite(b).all() for W, b in mlp.layers):
        raise InputError(f"gamma={gamma!r} is too small for beta={target.beta!r}: the head's weights (the target read "
                         "at U / gamma) overflow float64")
    kappa = 1.0 / math.sqrt(3.0 + s) if norm == "ball" else 1.0
    D = 1 + d_p + 1 + s
    cfg = ReferenceConfig(
        d_model=D, n_heads=s, n_layers=1, d_ff=1, d_head=d_p, activation="relu", norm=norm,
        d_input=1, max_len=n, head_hidden=mlp.widths, n_outputs=1, readout="first", ffn_bias=True,
    )
    model = ReferenceTransformer(cfg).double()
    c_slot, p_slots, one_slot = 0, slice(1, 1 + d_p), 1 + d_p
    P = encoding.P.double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[c_slot, 0] = kappa
        model.pos[:, p_slots] = kappa * P
        model.pos[:, one_slot] = kappa
        b = model.blocks[0]
        for k, i in enumerate(target.indices):
            # score_j = scale (κ q)(κ k_j) with scale = 1/sqrt(d_p): undo both κ and the scale.
            b.W_Q[k, one_slot, :] = R * math.sqrt(d_p) / kappa**2 * P[i]
            b.W_K[k, p_slots, :] = torch.eye(d_p, dtype=torch.float64)
            b.W_K[k, c_slot, :] = key_leak * P[i]
            b.W_V[k, c_slot, 0] = 1.0
            b.W_O[k, 0, 1 + d_p + 1 + k] = gamma
        W1, b1 = mlp.layers[0]
        first = model.head[0]
        for k in range(s):
            first.weight[:, 1 + d_p + 1 + k] = torch.from_numpy(W1[k]) / kappa
        first.bias.copy_(torch.from_numpy(b1))
        for lin, (W, bias) in zip(list(model.head)[1:], mlp.layers[1:]):
            lin.weight.copy_(torch.from_numpy(W.T))
            lin.bias.copy_(torch.from_numpy(bias))
    model.eval()
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):  # R ~ 1e308: W_Q = R sqrt(d_p)/κ² is inf
        raise InputError(f"R={R!r} is too large: the construction's weights overflow float64")
    return Construction(model, target, encoding, mlp, float(R), float(gamma), float(key_leak), kappa)
