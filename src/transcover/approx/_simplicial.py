"""The MLP of the construction: a ReLU network equal to the simplicial interpolant of h (THEORY F16c).

On the grid ``t_a = lo + a δ`` (``a = 0..N``, ``δ = (hi - lo)/N``) of ``[lo, hi]^s``, the Kuhn
(Freudenthal) triangulation splits each cell into the ``s!`` simplices
``{y_{π(1)} >= ... >= y_{π(s)}}``; the continuous piecewise-linear interpolant of ``h`` is

.. math::

    f(u) = \\sum_m h(x_m)\\, \\varphi_m(u),\\qquad
    \\varphi_m(u) = \\mathrm{relu}\\Big(1 - \\max_k y_k^+ - \\max_k y_k^-\\Big),\\quad y = (u - x_m)/\\delta,

the Courant hat of node ``x_m`` (on the cell below x_m it is ``1 - max_k y_k^-``... i.e. the
barycentric coordinate of x_m in whichever Kuhn simplex contains u).  Maxima of non-negative
numbers are ReLU-exact (``max(a, b) = a + relu(b - a)``), so ``f`` *is* a ReLU network with
``2 + ceil(log2 s)`` hidden layers; nothing is approximated.

Error (Hölder-β ``h`` with constant L, every u in a simplex of diameter ``δ√s`` whose barycentric
weights reproduce affine functions):

.. math::

    \\|f - h\\|_\\infty \\le L (\\delta\\sqrt{s})^{\\beta}\\ (\\beta \\le 1),\\qquad
    \\|f - h\\|_\\infty \\le \\tfrac{L}{\\beta} (\\delta\\sqrt{s})^{\\beta}\\ (1 < \\beta \\le 2),

the second from ``h(v) - h(u) - ∇h(u)(v - u) = ∫_0^1 (∇h(u + t(v-u)) - ∇h(u))(v - u) dt``.
With ``N + 1`` knots per axis the width is ``Θ((N+1)^s)``, so the error is ``Θ(d_m^{-β/s})``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._errors import InputError

__all__ = [
    "SimplicialMLP",
    "simplicial_mlp",
    "simplicial_interpolate",
    "simplicial_error_bound",
]


@dataclass(frozen=True)
class SimplicialMLP:
    """ReLU network ``u -> f(u)`` as layers ``(W, b)`` in the row convention ``relu(u W + b)``.

    ``layers[:-1]`` are hidden (ReLU) layers, ``layers[-1]`` the linear output.  ``node_values``
    has shape ``(N+1,)*s``; ``axis_lipschitz[k]`` is ``max |f(x + δe_k) - f(x)| / δ`` over grid edges,
    so ``|f(u) - f(v)| <= sum_k axis_lipschitz[k] |u_k - v_k|`` on the box.
    """

    s: int
    N: int
    lo: float
    hi: float
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    node_values: np.ndarray
    axis_lipschitz: tuple[float, ...]

    @property
    def delta(self) -> float:
        return (self.hi - self.lo) / self.N

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(W.shape[1] for W, _ in self.layers[:-1])

    @property
    def width(self) -> int:
        """d_m: the widest hidden layer."""
        return max(self.widths)

    @property
    def n_nonzero_params(self) -> int:
        return int(sum(np.count_nonzero(W) + np.count_nonzero(b) for W, b in self.layers))

    def __call__(self, U: Tensor) -> Tensor:
        """f(U) for U of shape (M, s), computed through the network (float64)."""
        z = U.double()
        for i, (W, b) in enumerate(self.layers):
            z = z @ torch.from_numpy(W) + torch.from_numpy(b)
            if i < len(self.layers) - 1:
                z = torch.relu(z)
        return z[:, 0]


def _check_grid(s: int, N: int, lo: float, hi: float) -> None:
    for name, v in (("s", s), ("grid", N)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(f"{name} must be a positive integer, but got {name}={v!r}")
    if not (lo < hi):
        raise InputError(f"the interpolation box needs lo < hi, but got lo={lo}, hi={hi}")


def simplicial_mlp(h: Callable[[Tensor], Tensor], s: int, N: int, lo: float = -1.0, hi: float = 1.0,
                   *, max_width: int = 20000) -> SimplicialMLP:
    """Build the ReLU network equal to the Kuhn simplicial interpolant of ``h`` on ``[lo, hi]^s``.

    Args:
        h: maps (M, s) float64 to (M,).  s: input dimension.  N: cells per axis (N + 1 knots).
        max_width: refuse networks wider than this (memory: the layers are stored dense).

    Raises:
        InputError: on non-positive sizes, an empty box, or a network wider than ``max_width``.
    """
    _check_grid(s, N, lo, hi)
    delta = (hi - lo) / N
    knots = lo + delta * np.arange(N + 1)
    n_nodes = (N + 1) ** s
    # Layer 1: relu(+(u_k - t_a)/δ) and relu(-(u_k - t_a)/δ), shared by every node.
    L1 = 2 * s * (N + 1)
    levels, c = [], s
    while c > 1:
        levels.append(c)
        c = (c + 1) // 2
    widest = max([L1, n_nodes] + [n_nodes * 2 * (2 * (c // 2) + c % 2) for c in levels])
    if widest > max_width:
        raise InputError(f"the simplicial MLP for s={s}, grid={N} would be {widest} wide (> max_width={max_width})")
    W1 = np.zeros((s, L1))
    b1 = np.zeros(L1)
    for k in range(s):
        for a in range(N + 1):
            j = 2 * (k * (N + 1) + a)
            W1[k, j], b1[j] = 1.0 / delta, -knots[a] / delta
            W1[k, j + 1], b1[j + 1] = -1.0 / delta, knots[a] / delta
    layers: list[tuple[np.ndarray, np.ndarray]] = [(W1, b1)]
    nodes = list(itertools.product(range(N + 1), repeat=s))
    # items[node][group] = list of unit indices (in the current layer) whose value is >= 0.
    items = [[[2 * (k * (N + 1) + m[k]) for k in range(s)], [2 * (k * (N + 1) + m[k]) + 1 for k in range(s)]]
             for m in nodes]
    # Each item is a linear functional of the current layer: a dict unit -> coefficient.
    funcs = [[[{u: 1.0} for u in g] for g in node] for node in items]
    width_in = L1
    while len(funcs[0][0]) > 1:
        cols: list[dict[int, float]] = []
        new_funcs = []
        for node in funcs:
            new_node = []
            for group in node:
                new_group = []
                for i in range(0, len(group) - 1, 2):
                    a, b = group[i], group[i + 1]
                    cols.append(dict(a))  # relu(a) = a, since a >= 0
                    diff = dict(b)
                    for u, w in a.items():
                        diff[u] = diff.get(u, 0.0) - w
                    cols.append(diff)  # relu(b - a)
                    new_group.append({len(cols) - 2: 1.0, len(cols) - 1: 1.0})  # max(a, b)
                if len(group) % 2:
                    cols.append(dict(group[-1]))
                    new_group.append({len(cols) - 1: 1.0})
                new_node.append(new_group)
            new_funcs.append(new_node)
        W = np.zeros((width_in, len(cols)))
        for j, col in enumerate(cols):
            for u, w in col.items():
                W[u, j] = w
        layers.append((W, np.zeros(len(cols))))
        funcs, width_in = new_funcs, len(cols)
    # Final hidden layer: phi_m = relu(1 - M+ - M-).
    W = np.zeros((width_in, n_nodes))
    for j, node in enumerate(funcs):
        for group in node:
            for u, w in group[0].items():
                W[u, j] -= w
    layers.append((W, np.ones(n_nodes)))
    grid = np.stack(np.meshgrid(*([knots] * s), indexing="ij"), axis=-1).reshape(-1, s)
    values = h(torch.from_numpy(grid)).double().numpy().reshape((N + 1,) * s)
    layers.append((values.reshape(n_nodes, 1).copy(), np.zeros(1)))
    lips = tuple(float(np.abs(np.diff(values, axis=k)).max() / delta) if N >= 1 else 0.0 for k in range(s))
    return SimplicialMLP(s, N, float(lo), float(hi), tuple(layers), values, lips)


def simplicial_interpolate(node_values: np.ndarray, U: np.ndarray, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    """Reference Kuhn-simplicial interpolation by sorting (independent of the network).

    ``f(u) = Σ_j λ_j f(v_j)`` with ``v_0`` the cell's lower corner, ``v_j = v_{j-1} + e_{π(j)}``,
    ``π`` sorting the local coordinates ``y`` in decreasing order, ``λ_0 = 1 - y_(1)``,
    ``λ_j = y_(j) - y_(j+1)``, ``λ_s = y_(s)``.  Points outside the box are clamped to it.
    """
    s = node_values.ndim
    N = node_values.shape[0] - 1
    delta = (hi - lo) / N
    X = (np.clip(U, lo, hi) - lo) / delta
    cell = np.clip(np.floor(X).astype(np.int64), 0, N - 1)
    y = X - cell
    order = np.argsort(-y, axis=1, kind="stable")
    ys = np.take_along_axis(y, order, axis=1)
    lam = np.empty((U.shape[0], s + 1))
    lam[:, 0] = 1 - ys[:, 0]
    lam[:, 1:s] = ys[:, :-1] - ys[:, 1:]
    lam[:, s] = ys[:, -1]
    v = cell.copy()
    out = lam[:, 0] * node_values[tuple(v.T)]
    rows = np.arange(U.shape[0])
    for j in range(s):
        v[rows, order[:, j]] += 1
        out = out + lam[:, j + 1] * node_values[tuple(v.T)]
    return out


def simplicial_error_bound(beta: float, holder_constant: float, s: int, N: int,
                           lo: float = -1.0, hi: float = 1.0, gamma: float = 1.0) -> float:
    """Sup-error of the simplicial interpolant of ``h~ = h o ψ^{-1}`` (read-out ψ = γ·z).

    .. math::

        \\varepsilon_{MLP} \\le \\frac{L}{\\max(1,\\beta)}\\,\\gamma^{-\\beta} (\\delta \\sqrt{s})^{\\beta},\\qquad
        \\delta = \\frac{hi - lo}{N},

    which for the box ``[-1, 1]^s`` is ``(L/max(1,β)) (2/γ)^β (√s / N)^β``: the seed's
    ``(2/γ)^β d_m^{-β/s}`` with ``d_m ∝ (N+1)^s`` (section 4.2; THEORY F16c).  A γ-injective
    read-out makes ``h~`` Hölder with constant ``L γ^{-β}`` (THEORY F16c).

    Raises:
        InputError: for β outside (0, 2], a negative constant, γ outside (0, 1] or a bad grid.
    """
    if not (0.0 < beta <= 2.0):
        raise InputError(f"beta must be in (0, 2], but got beta={beta!r}")
    if not (holder_constant >= 0.0):
        raise InputError(f"the Hölder constant must be >= 0, but got {holder_constant!r}")
    if not (0.0 < gamma <= 1.0):
        raise InputError(f"gamma must be in (0, 1], but got gamma={gamma!r}")
    _check_grid(s, N, lo, hi)
    delta = (hi - lo) / N
    return holder_constant * gamma ** (-beta) * (delta * math.sqrt(s)) ** beta / max(1.0, beta)
