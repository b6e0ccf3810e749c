"""A lower estimate of the uniform covering number by searching over sample sets (seed 1.1).

.. math::

    N_\\infty(F, \\varepsilon, n, \\|\\cdot\\|_q) = \\sup_{x_1, \\dots, x_n} N_\\infty(F, \\varepsilon, \\{x_i\\}, \\|\\cdot\\|_q)
    \\;\\ge\\; |\\text{packing}_{2\\varepsilon}(F_M |_{S})| \\quad \\text{for every } S \\text{ of size } n,

with ``F_M`` the M drawn members (``_classes``/``_local``) and the strict 2eps-packing of ``_nets``.
Every sample set we try gives a valid lower bound; the search only looks for a large one.

Search (per restart, with a fresh pool of ``pool_size`` random candidate inputs):

1. *random*: the first n candidates of the pool (the baseline a search must beat);
2. *greedy*: start from the empty set and add, n times, the candidate that maximises
   ``(packing size, number of pairs at distance > 2 eps)``.  The pair count breaks the many ties
   of the integer packing size and rewards samples that separate functions.  The distance matrix
   of a set is ``D_S = max_{i in S} D_i`` (D_i: per-sample distances), so adding a sample is one
   elementwise max; distances only grow with S, so greedy never loses separation.

Memory: the search holds ``M x M`` matrices, so M is capped (``MAX_FUNCTIONS``); the covering
number of one sample set for large M is ``_montecarlo``'s job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._errors import InputError, check_positive_int
from .._results import Kind, Quantity
from ..covering import log_count
from ._metrics import as_outputs, check_eps, check_q, distance_matrix
from ._classes import check_seed
from ._montecarlo import FunctionSample, check_output_memory
from ._nets import FORWARD_PAD_ASSUMPTION, FORWARD_REL_PAD, forward_pad, padded_radius, torch_threads
from ._predicates import certainly_beyond

__all__ = ["UniformSearchResult", "uniform_covering_search", "MAX_FUNCTIONS"]

MAX_FUNCTIONS = 4000  # 4000 x 4000 float64 = 128 MB per matrix


@dataclass(frozen=True)
class UniformSearchResult:
    """Best packing found over sample sets of size n, with the random baseline beside it."""

    eps: float
    q: float
    n: int
    n_functions: int
    best_packing: int
    random_packings: tuple[int, ...]  # one per restart: the random set's packing
    greedy_packings: tuple[int, ...]  # one per restart: the greedy set's packing
    best_inputs: Tensor  # (n, T, d) the sample set attaining best_packing
    description: str = ""
    forward_pad: float = 0.0  # the distance margin (THEORY F109) of the restart that found best_packing
    rel_pad: float = 0.0  # the relative output accuracy the margin assumes (0: outputs taken as exact)

    @property
    def lower(self) -> Quantity:
        """``ln best_packing`` rounded down (THEORY F112, logs of counts)."""
        return Quantity(log_count(self.best_packing, "down"), Kind.EMPIRICAL_LOWER,
                        "strict 2eps-packing on the best sample set found: lower bound on "
                        "log N_inf(F, eps, n) (uniform covering number)",
                        (f"M={self.n_functions} sampled members", f"n={self.n} samples")
                        + ((FORWARD_PAD_ASSUMPTION,) if self.rel_pad > 0 else ()))

    def to_dict(self) -> dict[str, object]:
        return {"eps": self.eps, "q": "inf" if self.q == math.inf else int(self.q), "n": self.n,
                "n_functions": self.n_functions, "best_packing": self.best_packing,
                "forward_pad": self.forward_pad, "rel_pad": self.rel_pad,
                "random_packings": list(self.random_packings), "greedy_packings": list(self.greedy_packings),
                "log_N_uniform_lower": self.lower.to_dict(), "description": self.description}


def _packing_of_matrix(far: np.ndarray) -> int:
    """Greedy (row order) maximal set whose pairs are all ``far`` (strictly separated)."""
    alive = np.ones(far.shape[0], dtype=bool)
    k = 0
    for j in range(far.shape[0]):
        if alive[j]:
            k += 1
            alive &= far[j]
    return k


def _score(D: Tensor, r: float, terms: int) -> tuple[int, int]:
    far = certainly_beyond(D, r, terms).numpy()
    return _packing_of_matrix(far), int(far.sum())


def uniform_covering_search(sample: FunctionSample, n: int, eps: float, q: float | str = math.inf, *,
                            input_sampler: Callable[[int, int], Tensor], restarts: int = 3,
                            pool_size: int = 64, seed: int = 0, workers: int | None = None,
                            rel_pad: float = FORWARD_REL_PAD) -> UniformSearchResult:
    """Search sample sets of size ``n`` for a large packing of the sampled class (module docstring).

    Args:
        sample: M drawn members of the class (M <= MAX_FUNCTIONS).
        n: sample-set size >= 1.
        eps: accuracy > 0.
        q: per-sample output norm.
        input_sampler: ``(count, seed) -> (count, T, d)`` candidate inputs (e.g. ``random_inputs``).
        restarts: independent candidate pools.
        pool_size: candidates per pool (>= n).
        rel_pad: relative accuracy assumed of the float64 outputs (THEORY F109): a pair counts as
            separated only beyond ``2 eps + forward_pad(outputs of the pool, q, rel_pad)``.

    A candidate is one input sequence: all of its rows of the outputs (one row per sequence for a head's
    outputs, its ``T`` token rows for ``output="features"``), so ``best_inputs`` carries the sequences
    whose outputs give ``best_packing``.

    Returns:
        :class:`UniformSearchResult`; ``best_packing`` lower-bounds ``N_inf(F, eps, n)``.
    """
    eps = check_eps(eps)
    qf = check_q(q)
    for name, v in (("n", n), ("restarts", restarts), ("pool_size", pool_size)):
        check_positive_int(v, name)
    check_seed(seed)
    if pool_size < n:
        raise InputError(f"pool_size must be >= n, but got pool_size={pool_size}, n={n}")
    M = sample.n_functions
    if M > MAX_FUNCTIONS:
        raise InputError(f"the uniform search holds M x M matrices; use at most {MAX_FUNCTIONS} "
                         f"functions, but got M={M}")
    check_output_memory(8 * (pool_size + 2) * M * M, f"the search's {pool_size} + 2 matrices of {M} x {M} distances",
                        "--functions or --pool")
    best, best_X, best_pad = 0, None, 0.0
    rand_p, greedy_p = [], []
    with torch_threads(workers):
        for r in range(restarts):
            pool = input_sampler(pool_size, seed * 7919 + r)
            Y = as_outputs(sample.evaluate(pool))  # (M, P * rows, b): rows per candidate sequence
            if Y.shape[1] % pool_size:
                raise InputError(f"the class's outputs have {Y.shape[1]} rows for {pool_size} candidate inputs; "
                                 "expected a whole number of rows per input")
            rows = Y.shape[1] // pool_size
            pad = forward_pad(Y, qf, rel_pad)
            thr = padded_radius(2.0 * eps, pad)
            # per-candidate distances (max over its rows), so one row's term count; pairs within rounding of
            # the threshold count as not separated (conservative: the packing stays strict)
            terms = 1 if (qf == math.inf or Y.shape[2] == 1) else Y.shape[2]
            per = [distance_matrix(Y[:, i * rows:(i + 1) * rows], Y[:, i * rows:(i + 1) * rows], qf)
                   for i in range(pool_size)]
            D_rand = torch.stack(per[:n]).amax(dim=0)
            rand_p.append(_score(D_rand, thr, terms)[0])
            D = torch.zeros(M, M, dtype=Y.dtype)
            chosen: list[int] = []
            for _ in range(n):
                scores = [(_score(torch.maximum(D, per[i]), thr, terms), i) for i in range(pool_size)
                          if i not in chosen]
                (_, _), i_best = max(scores)
                chosen.append(i_best)
                D = torch.maximum(D, per[i_best])
            g = _score(D, thr, terms)[0]
            greedy_p.append(g)
            for p, idx in ((rand_p[-1], list(range(n))), (g, chosen)):
                if p > best:
                    best, best_X, best_pad = p, pool[idx], pad
    assert best_X is not None
    return UniformSearchResult(eps, qf, n, M, best, tuple(rand_p), tuple(greedy_p), best_X,
                               getattr(sample, "description", ""), best_pad, float(rel_pad))
