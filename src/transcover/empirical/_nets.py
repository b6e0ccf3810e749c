"""Greedy eps-nets and maximal packings of a finite class: upper and lower covering estimates.

For a finite set F (rows of ``Y``, metric ``d_q`` of ``_metrics``) and closed balls:

* ``N_int(eps)``: fewest centres *from F* with every f within ``eps`` of a centre;
* ``N_ext(eps)``: fewest centres anywhere in the ambient space ``R^{n x b}`` (free centres);
* ``P(r)``: largest subset of F whose points are pairwise at distance ``> r`` (strictly).

.. math::

    P(2\\varepsilon) \\;\\le\\; N_{ext}(\\varepsilon) \\;\\le\\; N_{int}(\\varepsilon)
    \\;\\le\\; |\\text{greedy net}(\\varepsilon)| \\;\\le\\; P(\\varepsilon),
    \\qquad N_{int}(\\varepsilon) \\le N_{ext}(\\varepsilon / 2).

Derivations (standard, e.g. Vershynin, *High-Dimensional Probability*, Lemma 4.2.8, redone here
for closed balls and *strict* separation):

* Packing lower bound: if ``d(p, p') > 2 eps`` and one closed eps-ball (any centre c) held both,
  the triangle inequality would give ``d(p, p') <= d(p, c) + d(c, p') <= 2 eps``.  So each point
  of a strictly-2eps-separated set needs its own centre, for free centres and a fortiori for
  centres from F.  Strictness matters: the two points ``0`` and ``2 eps`` of the real line are
  2eps-separated non-strictly and one ball (centre ``eps``) covers both, so a ``>= 2 eps``
  packing does *not* bound ``N_ext(eps)``; with centres from F it would, but only because 0 and
  2 eps are then distinct centres anyway -- we use the strict version for both.
* Greedy net: a point becomes a centre iff it is at distance ``> eps`` from every earlier centre.
  The result is a cover by centres from F (so ``N_int <= |net|``) whose centres are strictly
  eps-separated (so ``|net| <= P(eps)``).
* The greedy net at radius ``2 eps`` is therefore a maximal strictly-2eps-separated subset: the
  packing this module reports.  Any cover has at least that many centres, so
  ``packing_size <= net_size`` always (the property test checks it).
* Factor 2: given a free-centre cover at radius ``eps/2``, replace each ball's centre by any
  point of F inside it; every point of the ball is then within ``eps`` of it.  Hence
  ``N_int(eps) <= N_ext(eps/2)``.

Floating point: every decision ``d <= r`` is the exact one for the real numbers the stored floats
stand for (``_predicates``: a certified float filter, then float64, then rational arithmetic for
near-ties), whatever the data's dtype (float16, bfloat16 and float32 are held as float32, integers
as float64).  So the net is a true eps-cover by strictly eps-separated points and the packing truly
strictly 2eps-separated: the chain above holds for the stored data, not only up to rounding.  Outputs of a
forward pass are not exact data: for them the lower-bound claims use a margin (``pad``, THEORY F109, Note
[forward pad]) that a pair must exceed to count as separated.

Speed (issue 14): a chunk of points meets all current centres in one matrix product, which gives a
certified lower bound on every distance (Note [Gram filter] of :class:`IncrementalNet`); only the
pairs it cannot rule out are decided exactly, nearest first.  The chunk's own order is then
resolved by the exact sequential greedy among its uncovered points, so the centres are those of
the one-point-at-a-time greedy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from .._errors import InputError, check_positive_int
from .._results import Kind, Quantity
from ..covering import log_count
from ._metrics import DEFAULT_BLOCK_ELEMENTS, as_outputs, check_eps, check_q
from ._predicates import _round_to, gram_filter, ieee_float32_matmul, within, within_rows

__all__ = [
    "IncrementalNet", "greedy_net", "maximal_packing",
    "CoveringEstimate", "estimate_covering_number", "torch_threads",
    "FORWARD_REL_PAD", "FORWARD_PAD_ASSUMPTION", "forward_pad", "padded_radius",
]

# Note [forward pad] (THEORY F109): outputs computed by a float64 forward pass are not the exact outputs of the members
# they stand for, so a pair separated by the stored floats can fail to be separated exactly (red team 191: computed
# distance 0.0558703783483738194 > 2 eps = 0.0558703783483738142, exact 0.0558703783483737870).  The lower-bound
# claims about a class (packing, net centres) therefore count a pair as separated only when its computed distance
# exceeds the threshold by ``forward_pad``: both members' forward errors under the assumption below.
FORWARD_REL_PAD = 1e-12
FORWARD_PAD_ASSUMPTION = ("each computed float64 output within 1e-12 max|output| (over all members and samples) of "
                          "the member's exact output (THEORY F109: about 6e-16 of that scale observed against a "
                          "60-digit forward)")


class torch_threads:
    """Context manager: run with ``workers`` torch threads (None: leave torch's setting)."""

    def __init__(self, workers: int | None):
        if workers is not None:
            check_positive_int(workers, "workers")
        self.workers = workers

    def __enter__(self) -> "torch_threads":
        from .._threads import limit_threads

        self._block = limit_threads(self.workers, blas=False)  # the one thread-limit helper
        self._block.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._block.__exit__(*exc)


_SKETCH_DIM = 16  # random projection used only to guess a covering centre (the guess is then checked exactly)
_SKETCH_FROM = 64  # centres in a block from which the guess pays for itself
_ROUNDS = 3  # nearest-first exact checks per row before a block's remaining candidates are checked at once


class IncrementalNet:
    """A greedy net built from a stream of functions, never holding an M x M matrix.

    Point ``j`` (in arrival order) becomes a centre iff ``d_q(y_j, c) > radius`` for every
    earlier centre ``c``, decided exactly (module notes).
    Memory: the centres plus one ``chunk x centres`` block.

    Note [chunked greedy]: a chunk's points are first compared with the existing centres; the
    ones still uncovered are compared with each other and resolved in arrival order (a point
    becomes a centre iff it is farther than the radius from every earlier pick of the chunk), so
    the result equals the sequential greedy exactly.

    Note [Gram filter]: with ``w = n b`` for the flat l_inf metric (q = inf or b = 1) and
    ``w = n`` otherwise, ``d_q(x, y) >= ||x - y||_F / sqrt(w)`` (the largest of ``w`` per-entry
    or per-sample norms is at least their root mean square, and ``||.||_1 >= ||.||_2``).  The
    squared Frobenius distances of a chunk to all centres come from one matrix product,
    ``S = c nu_x + c nu_y - 2 x.y`` (``nu`` the computed squared norms, ``c <= 1 - kappa``).  With
    ``D = n b`` terms and unit roundoff ``u``, the norms and the dot product carry relative errors
    ``gamma_D`` (Higham, Lemma 3.1 and eq. 3.5; any order, FMA or not, since
    ``|x.y| <= |x| |y| <= (|x|^2 + |y|^2)/2``) and the two additions ``gamma_2``, so
    ``S <= ||x - y||^2 + (|x|^2 + |y|^2)((1 - kappa)(1 + u)(1 + gamma_D) - 1 + gamma_D
    + 2 gamma_2 (1 + gamma_D)) + eta``; ``kappa = 2 gamma_(2D+8)`` (twice what is needed) makes the
    bracket negative, and ``eta = 8 (D + 4) tiny`` covers underflow, flushed or gradual.  Hence
    ``S > T >= w r^2 + eta`` proves ``d_q > r``: such pairs are dropped, never wrongly.  Rows
    whose squared norm is ``>= max/8`` (where a product could overflow) get NaN and are never
    dropped.  Every other pair is decided exactly by ``_predicates``, nearest-first (smallest
    ``S``), so a covered point usually costs one exact check.

    Args:
        radius: the net's radius ``eps`` (> 0; ``inf`` gives one centre, as ``2 eps`` may overflow).
        q: 1, 2 or inf.
        chunk_size: rows compared at once.
    """

    def __init__(self, radius: float, q: float = math.inf, *,
                 chunk_size: int = 2048, block_elements: int = DEFAULT_BLOCK_ELEMENTS):
        self.radius = math.inf if radius == math.inf else check_eps(radius, "radius")
        self.q = check_q(q)
        check_positive_int(chunk_size, "chunk_size")
        self.chunk_size = chunk_size
        self.block_elements = block_elements
        self._centres: Tensor | None = None  # (capacity, n, b), first _k rows used
        self._scaled: Tensor | None = None  # (capacity,) c * squared norms of the centres
        self._proj: Tensor | None = None  # (n b, _SKETCH_DIM) fixed Gaussian projection
        self._sketch: Tensor | None = None  # (capacity, _SKETCH_DIM + 1) rows [-2 z, |z|^2], z = projected centre
        self._k = 0
        self._indices: list[int] = []
        self.n_seen = 0

    @property
    def size(self) -> int:
        return self._k

    @property
    def centres(self) -> Tensor:
        """The centres' outputs, ``(size, n, b)``."""
        if self._centres is None:
            return torch.empty(0)
        return self._centres[: self._k]

    @property
    def indices(self) -> np.ndarray:
        """Arrival indices of the centres (increasing)."""
        return np.asarray(self._indices, dtype=np.int64)

    def _filter(self, X: Tensor) -> tuple[float, float, float] | None:
        if self.radius == math.inf or (X.dtype == torch.float32 and not ieee_float32_matmul()):
            return None
        _, n, b = X.shape
        return gram_filter(self.radius, X.dtype, n * b, n * b if (self.q == math.inf or b == 1) else n)

    def _scale(self, F: Tensor, filt: tuple[float, float, float]) -> Tensor:
        """``c * nu`` per row of the flattened rows F; NaN where the filter must not prune."""
        nu = (F * F).sum(dim=1)
        out = nu * filt[0]
        out[~(nu < filt[2])] = math.nan
        return out

    def _append(self, rows: Tensor) -> None:
        if self._centres is None:
            cap = max(64, rows.shape[0])
            self._centres = torch.empty((cap, *rows.shape[1:]), dtype=rows.dtype)
            self._scaled = torch.empty(cap, dtype=rows.dtype)
            self._sketch = torch.empty(cap, _SKETCH_DIM + 1, dtype=rows.dtype)
            gen = torch.Generator().manual_seed(0)
            self._proj = torch.randn(rows[0].numel(), _SKETCH_DIM, generator=gen, dtype=torch.float64).to(rows.dtype)
        elif self._k + rows.shape[0] > self._centres.shape[0]:
            cap = max(2 * self._centres.shape[0], self._k + rows.shape[0])
            grown = torch.empty((cap, *rows.shape[1:]), dtype=rows.dtype)
            grown[: self._k] = self._centres[: self._k]
            self._centres = grown
            scaled = torch.empty(cap, dtype=rows.dtype)
            scaled[: self._k] = self._scaled[: self._k]
            self._scaled = scaled
            sketch = torch.empty(cap, _SKETCH_DIM + 1, dtype=rows.dtype)
            sketch[: self._k] = self._sketch[: self._k]
            self._sketch = sketch
        filt = self._filter(rows)
        if filt is not None:
            self._scaled[self._k: self._k + rows.shape[0]] = self._scale(rows.reshape(rows.shape[0], -1), filt)
        Z = self._project(rows.reshape(rows.shape[0], -1))
        self._sketch[self._k: self._k + rows.shape[0]] = torch.cat([-2 * Z, (Z * Z).sum(dim=1, keepdim=True)], dim=1)
        self._centres[self._k: self._k + rows.shape[0]] = rows
        self._k += rows.shape[0]

    def _project(self, F: Tensor) -> Tensor:
        """``F R``: a sketch whose distances only rank centres (they never decide anything)."""
        return F @ self._proj

    def _guess(self, X: Tensor, Xf: Tensor, rows: Tensor, s: int, e: int) -> Tensor:
        """Rows (of ``rows``) exactly within the radius of the sketch-nearest centre in ``[s, e)``."""
        Z = self._project(Xf if rows.numel() == Xf.shape[0] else Xf[rows])
        Z1 = torch.cat([Z, torch.ones(Z.shape[0], 1, dtype=Z.dtype)], dim=1)
        j = torch.from_numpy((Z1 @ self._sketch[s:e].T).numpy().argmin(axis=1))  # |z - k|^2 - |z|^2
        return torch.from_numpy(within_rows(X[rows], self._centres[s + j], self.q, self.radius))

    def _gram(self, sx: Tensor, Xf: Tensor, sy: Tensor, Yf: Tensor) -> Tensor:
        """Filter values ``S`` (Note [Gram filter]): ``S > T`` proves ``d > radius``; NaN proves nothing."""
        return torch.addmm(sx[:, None] + sy[None, :], Xf, Yf.T, alpha=-2)

    def _uncovered(self, X: Tensor) -> Tensor:
        """Mask of rows of X farther than the radius from every current centre."""
        m, n, b = X.shape
        keep = torch.ones(m, dtype=torch.bool)
        if self._k == 0:
            return keep
        filt = self._filter(X)
        if filt is None:
            return self._uncovered_plain(X, keep)
        assert self._centres is not None and self._scaled is not None
        T = filt[1]
        Xf = X.reshape(m, -1)
        sx = self._scale(Xf, filt)
        C = self._centres
        Cf = C.reshape(C.shape[0], -1)
        per = max(1, self.block_elements // m)
        for s in range(0, self._k, per):
            e = min(self._k, s + per)
            rows = torch.nonzero(keep).flatten()
            if rows.numel() == 0:
                break
            if e - s >= _SKETCH_FROM:  # most points are covered: a cheap guess, checked exactly, settles them
                ok = self._guess(X, Xf, rows, s, e)
                keep[rows[ok]] = False
                rows = rows[~ok]
                if rows.numel() == 0:
                    break
            whole = rows.numel() == m  # no gathered copies while every row is still open
            P = self._gram(sx if whole else sx[rows], Xf if whole else Xf[rows], self._scaled[s:e], Cf[s:e])
            prow = torch.arange(rows.numel())
            for _ in range(_ROUNDS):  # nearest-first: a covered point is usually settled at once
                j = torch.from_numpy(P.numpy().argmin(axis=1))  # numpy's argmin is vectorised; NaN first
                live = torch.nonzero(~(P.gather(1, j[:, None]).squeeze(1) > T)).flatten()
                ok = torch.from_numpy(within_rows(X[rows[prow[live]]], C[s + j[live]], self.q, self.radius))
                keep[rows[prow[live[ok]]]] = False
                bad = live[~ok]
                P, prow = P[bad], prow[bad]
                P[torch.arange(bad.numel()), j[bad]] = math.inf
                if bad.numel() == 0:
                    break
            if prow.numel() == 0:
                continue
            ii, jj = torch.nonzero(~(P > T), as_tuple=True)
            if 4 * ii.numel() < prow.numel() * (e - s):
                ok = torch.from_numpy(within_rows(X[rows[prow[ii]]], C[s + jj], self.q, self.radius))
                keep[rows[prow[ii[ok]]]] = False
            else:
                close = within(X[rows[prow]], C[s:e], self.q, self.radius, block_elements=self.block_elements)
                keep[rows[prow[close.any(dim=1)]]] = False
        return keep

    def _uncovered_plain(self, X: Tensor, keep: Tensor) -> Tensor:
        """Without the filter (infinite radius, or dimensions beyond its error analysis)."""
        _, n, b = X.shape
        per = max(1, self.block_elements // max(1, X.shape[0] * (1 if b == 1 or self.q == math.inf else n)))
        for s in range(0, self._k, per):
            idx = torch.nonzero(keep).flatten()
            if idx.numel() == 0:
                break
            close = within(X[idx], self._centres[s: min(self._k, s + per)], self.q, self.radius,
                           block_elements=self.block_elements)
            keep[idx] = ~close.any(dim=1)
        return keep

    def _resolve(self, X: Tensor) -> list[int]:
        """Exact sequential greedy among a chunk's uncovered points X, in order: the picks."""
        u, n, b = X.shape
        filt = self._filter(X)
        if filt is None:
            near = within(X, X, self.q, self.radius, block_elements=self.block_elements).numpy()
            exact = True
        else:
            Xf = X.reshape(u, -1)
            sx = self._scale(Xf, filt)
            near = (~(self._gram(sx, Xf, sx, Xf) > filt[1])).numpy()
            exact = False
        alive = np.ones(u, dtype=bool)
        picks = []
        for j in range(u):
            if not alive[j]:
                continue
            picks.append(j)
            others = np.flatnonzero(alive[j + 1:] & near[j, j + 1:]) + (j + 1)
            if others.size and not exact:
                ok = within_rows(X[j].expand(others.size, n, b), X[torch.from_numpy(others)], self.q, self.radius)
                others = others[ok]
            alive[others] = False
        return picks

    def add(self, Y: Tensor) -> Tensor:
        """Feed the next functions ``(m, n, b)``; returns the mask of those that became centres."""
        Y = as_outputs(Y)
        if self._centres is not None and (Y.shape[1:] != self._centres.shape[1:] or Y.dtype != self._centres.dtype):
            raise InputError(f"outputs of shape {tuple(Y.shape[1:])} / {Y.dtype} do not match the "
                             f"net's {tuple(self._centres.shape[1:])} / {self._centres.dtype}")
        new_mask = torch.zeros(Y.shape[0], dtype=torch.bool)
        for s in range(0, Y.shape[0], self.chunk_size):
            X = Y[s: s + self.chunk_size]
            cand = torch.nonzero(self._uncovered(X)).flatten()
            if cand.numel():
                picks = self._resolve(X[cand])
                chosen = cand[torch.as_tensor(picks, dtype=torch.long)]
                self._append(X[chosen])
                self._indices.extend((self.n_seen + s + chosen).tolist())
                new_mask[s + chosen] = True
        self.n_seen += Y.shape[0]
        return new_mask

    def size_after(self, counts: Iterable[int]) -> list[int]:
        """Net size after the first m arrivals, for each m: the net of that prefix (greedy is online)."""
        idx = self.indices
        return [int(np.searchsorted(idx, m, side="left")) for m in counts]


def forward_pad(Y: Tensor, q: float, rel: float = FORWARD_REL_PAD) -> float:
    """The distance margin of Note [forward pad] (THEORY F109) for the outputs ``Y`` (M, n, b) in the metric ``d_q``.

    If every entry is within ``delta = rel * max|Y|`` of its exact value, a per-sample ``q``-norm of a
    difference moves by at most ``2 w delta`` (triangle inequality, both members), ``w = 1`` for the flat
    l_inf metric (q = inf or b = 1), ``b`` for q = 1 and ``ceil(sqrt(b)) >= sqrt(b)`` for q = 2.  Returned as
    a float64 at or above the exact value of that product; 0 for ``rel = 0``.
    """
    if not (isinstance(rel, (int, float)) and math.isfinite(rel) and rel >= 0):
        raise InputError(f"the relative forward pad must be a finite number >= 0, but got {rel!r}")
    Y = as_outputs(Y)
    if rel == 0 or Y.numel() == 0:
        return 0.0
    b = Y.shape[2]
    w = 1 if (q == math.inf or b == 1) else (b if q == 1 else math.isqrt(b - 1) + 1)
    big = Fraction(float(Y.abs().amax().to(torch.float64)))
    return _round_to(2 * w * Fraction(rel) * big, torch.float64, up=True)


def padded_radius(r: float, pad: float) -> float:
    """The float64 at or above ``r + pad`` (exactly): ``d > padded_radius(r, pad)`` proves ``d > r + pad``."""
    if pad == 0 or r == math.inf:
        return r
    return _round_to(Fraction(r) + Fraction(pad), torch.float64, up=True)


def _ordered(Y: Tensor, order: Sequence[int] | Tensor | None) -> Tensor:
    if order is None:
        return Y
    raw = torch.as_tensor(order)
    M = Y.shape[0]
    # only the length was checked: [0, 0, 0] gave a "net" that covered one point of three, 0.5 was truncated to 0
    # and an index out of range was an IndexError (red team 162)
    if raw.ndim != 1 or raw.numel() != M or raw.is_floating_point() or raw.is_complex() or raw.dtype == torch.bool \
            or not torch.equal(torch.sort(raw.long()).values, torch.arange(M)):
        shown = raw.tolist() if raw.numel() <= 8 else f"{raw.numel()} entries"
        raise InputError(f"order must be a permutation of the {M} indices 0..{M - 1} (integers, each once), but got "
                         f"{shown}")
    return Y[raw.long()]


def greedy_net(Y: Tensor, eps: float, q: float = math.inf, *, order=None,
               chunk_size: int = 2048, pad: float = 0.0) -> np.ndarray:
    """Indices of a greedy eps-net of the rows of ``Y`` (centres from the set).

    ``|result| >= N_int(eps) >= N_ext(eps)`` (module docstring); centres are pairwise ``> eps``.

    Args:
        Y: outputs ``(M, n, b)`` or ``(M, n)``.
        eps: radius > 0.
        q: 1, 2 or inf.
        order: optional permutation in which points are visited (default: row order).
        pad: a distance margin (THEORY F109, :func:`forward_pad`): a point becomes a centre only when it
            is farther than ``eps + pad`` from every earlier centre (the net of radius ``eps + pad``), so
            centres stay ``eps``-separated when each output may be off by the forward errors the pad covers.

    Returns:
        Row indices (into ``Y``) of the centres, in visiting order.

    Example:
        >>> greedy_net(torch.arange(6.0)[:, None], 0.5).tolist()
        [0, 1, 2, 3, 4, 5]
        >>> greedy_net(torch.arange(6.0)[:, None], 1.0).tolist()
        [0, 2, 4]
    """
    Y = as_outputs(Y)
    net = IncrementalNet(eps if _check_pad(pad) == 0 else padded_radius(check_eps(eps), pad), q,
                         chunk_size=chunk_size)
    net.add(_ordered(Y, order))
    idx = net.indices
    return idx if order is None else np.asarray(order, dtype=np.int64)[idx]


def maximal_packing(Y: Tensor, eps: float, q: float = math.inf, *, order=None,
                    chunk_size: int = 2048, pad: float = 0.0) -> np.ndarray:
    """Indices of a maximal set whose points are pairwise at distance ``> 2 eps + pad``.

    Its size is a lower bound on ``N_ext(eps) <= N_int(eps)`` (module docstring: strict
    separation, decided exactly).  ``pad`` (THEORY F109, :func:`forward_pad`): the margin that keeps the
    packing ``2 eps``-separated for the exact outputs when the stored ones carry forward errors.

    Example:
        >>> maximal_packing(torch.arange(6.0)[:, None], 0.5).tolist()  # needs distance > 1
        [0, 2, 4]
    """
    Y = as_outputs(Y)
    net = IncrementalNet(padded_radius(2.0 * check_eps(eps), _check_pad(pad)), q, chunk_size=chunk_size)
    net.add(_ordered(Y, order))
    idx = net.indices
    return idx if order is None else np.asarray(order, dtype=np.int64)[idx]


def _check_pad(pad: float) -> float:
    if not (isinstance(pad, (int, float)) and math.isfinite(pad) and pad >= 0):
        raise InputError(f"pad must be a finite number >= 0, but got pad={pad!r}")
    return float(pad)


def _net_and_packing(Y: Tensor, eps: float, q: float, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The greedy eps-net and the greedy 2eps-net (the packing) in one pass over the chunks of Y."""
    net = IncrementalNet(eps, q, chunk_size=chunk_size)
    pack = IncrementalNet(2.0 * eps, q, chunk_size=chunk_size)
    for s in range(0, Y.shape[0], chunk_size):
        net.add(Y[s:s + chunk_size])
        pack.add(Y[s:s + chunk_size])
    return net.indices, pack.indices


@dataclass(frozen=True)
class CoveringEstimate:
    """Lower and upper estimates of the covering number of a finite set at one ``eps``.

    ``net_size`` (greedy net, centres from the set) is attained, so ``N_int(eps) <= net_size``
    is certified for the finite set (every ``d <= eps`` decided exactly); ``packing_size`` (strict
    2eps-packing) certifies ``packing_size <= N_ext(eps) <= N_int(eps)``.
    """

    eps: float
    q: float
    n_functions: int
    n_samples: int
    n_outputs: int
    net_size: int
    packing_size: int
    n_orders: int = 1
    net_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    @property
    def upper(self) -> Quantity:
        """``ln |net|`` rounded up (THEORY F112, logs of counts: ``math.log(4)`` is 1 ulp below ``ln 4``)."""
        return Quantity(log_count(self.net_size, "up"), Kind.CERTIFIED_UPPER,
                        "greedy eps-net, centres from the set: log N_int(eps) <= log |net|",
                        ("closed balls", f"metric max_i ||f(x_i)-g(x_i)||_{_qname(self.q)}"))

    @property
    def lower(self) -> Quantity:
        """``ln |packing|`` rounded down (THEORY F112, logs of counts)."""
        return Quantity(log_count(self.packing_size, "down"), Kind.EMPIRICAL_LOWER,
                        "maximal strict 2eps-packing: log N_ext(eps) >= log |packing|",
                        ("closed balls", "free or internal centres"))

    def to_dict(self) -> dict[str, object]:
        return {
            "eps": self.eps, "q": _qname(self.q), "n_functions": self.n_functions,
            "n_samples": self.n_samples, "n_outputs": self.n_outputs,
            "net_size": self.net_size, "packing_size": self.packing_size, "n_orders": self.n_orders,
            "log_N_upper": self.upper.to_dict(), "log_N_lower": self.lower.to_dict(),
        }


def _qname(q: float) -> str:
    return "inf" if q == math.inf else str(int(q))


def estimate_covering_number(Y, eps: float, q: float | str = math.inf, *, n_orders: int = 1,
                             seed: int = 0, workers: int | None = None,
                             chunk_size: int = 2048) -> CoveringEstimate:
    """Bracket the covering number of a finite class: ``packing <= N_ext <= N_int <= net``.

    Args:
        Y: outputs ``(M, n, b)`` (or ``(M, n)``) of the M functions on the n samples.
        eps: accuracy > 0.
        q: the per-sample norm: 1, 2 or inf.
        n_orders: visiting orders tried (the first is the row order, the rest seeded random
            permutations); the smallest net and the largest packing are kept.
        seed: seed of the permutations.
        workers: torch threads to use (None: torch's default).

    Returns:
        A :class:`CoveringEstimate`.

    Raises:
        InputError: bad shapes, non-finite data, ``eps <= 0``, ``q`` not in {1, 2, inf}.
    """
    Y = as_outputs(Y)
    eps = check_eps(eps)
    qf = check_q(q)
    check_positive_int(n_orders, "n_orders")
    from ._classes import check_seed  # _classes reaches the model package: imported where it is needed

    gen = torch.Generator().manual_seed(check_seed(seed))
    best_net: np.ndarray | None = None
    best_pack = 0
    with torch_threads(workers):
        for r in range(n_orders):
            order = None if r == 0 else torch.randperm(Y.shape[0], generator=gen)
            net, pack = _net_and_packing(_ordered(Y, order), eps, qf, chunk_size)
            if order is not None:
                net, pack = order.numpy()[net], order.numpy()[pack]
            if best_net is None or len(net) < len(best_net):
                best_net = net
            best_pack = max(best_pack, len(pack))
    assert best_net is not None
    M, n, b = Y.shape
    return CoveringEstimate(eps, qf, M, n, b, len(best_net), best_pack, n_orders, best_net)
