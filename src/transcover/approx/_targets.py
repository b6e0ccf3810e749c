"""I-sparse targets and seeded synthetic sparse-token tasks (seed section 4.1; THEORY F16).

An *I-sparse* target depends only on the tokens indexed by ``I = (i_1, ..., i_s)``:

.. math::

    g^*(Z) = h(z_{i_1}, \\dots, z_{i_s}),\\qquad Z = (z_1, \\dots, z_n),\\ z_t \\in [-1, 1].

Every token carries one scalar content ``z_t`` (so the smooth part ``h`` has input dimension
``s = |I|``, the reading of THEORY section 4 item 3 with one coordinate per head).

The public entry point for other packages (``transcover.train`` trains on these) is
:func:`make_sparse_task`; see ``README.md`` beside this file for the task table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError

__all__ = [
    "SparseTarget",
    "holder_ridge",
    "sparse_parity",
    "sparse_majority",
    "sparse_target",
    "make_sparse_task",
    "TASK_NAMES",
]

TASK_NAMES = ("holder", "parity", "majority", "retrieval")


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{name} must be a positive integer, but got {name}={value!r}")
    return value


def _check_beta(beta: float) -> float:
    if not (isinstance(beta, (int, float)) and 0.0 < float(beta) <= 2.0):
        raise InputError(f"smoothness beta must be in (0, 2], but got beta={beta!r}")
    return float(beta)


def _check_indices(indices: tuple[int, ...], seq_len: int) -> tuple[int, ...]:
    if len(indices) == 0:
        raise InputError("the index set I must not be empty")
    if len(set(indices)) != len(indices):
        raise InputError(f"the index set I must not repeat positions, but got I={indices}")
    for i in indices:
        if not (0 <= i < seq_len):
            raise InputError(f"index {i} in I is outside the sequence 0..{seq_len - 1}")
    return tuple(int(i) for i in indices)


def holder_constant_of_power(beta: float) -> float:
    """Hölder-β constant of ``t -> |t|^β`` on the real line.

    .. math::

        L_\\beta = 1 \\ (\\beta \\le 1),\\qquad L_\\beta = \\beta\\, 2^{2-\\beta} \\ (1 < \\beta \\le 2),

    the latter being the (β−1)-Hölder constant of the derivative ``β|t|^{β-1} sign t``: for equal
    signs ``| |x|^{a} - |y|^{a} | <= |x - y|^{a}`` (a = β−1 ≤ 1), for opposite signs
    ``|x|^a + |y|^a <= 2^{1-a} (|x| + |y|)^a`` by concavity.
    """
    return 1.0 if beta <= 1.0 else beta * 2.0 ** (2.0 - beta)


@dataclass(frozen=True)
class SparseTarget:
    """An I-sparse target ``g*(Z) = h(z_I)``.

    ``h`` maps ``(N, s)`` to ``(N,)``.  For Hölder targets ``beta`` and ``holder_constant`` L say
    ``|h(u) - h(v)| <= L ||u - v||_2^β`` (β ≤ 1) or ``||∇h(u) - ∇h(v)||_2 <= L ||u - v||_2^{β-1}``
    (1 < β ≤ 2) on the content box ``[-1, 1]^s``; Boolean targets have ``beta = None``.
    """

    name: str
    indices: tuple[int, ...]
    h: Callable[[Tensor], Tensor]
    beta: float | None = None
    holder_constant: float | None = None
    seq_len: int | None = None

    @property
    def sparsity(self) -> int:
        return len(self.indices)

    def __call__(self, Z: Tensor) -> Tensor:
        """``g*(Z)`` for contents ``Z`` of shape (N, T) or (N, T, d_in) (channel 0 is the content)."""
        if Z.dim() == 3:
            Z = Z[..., 0]
        if Z.dim() != 2:
            raise InputError(f"contents must have shape (N, T) or (N, T, d_in), but got {tuple(Z.shape)}")
        if Z.shape[1] <= max(self.indices):
            raise InputError(f"sequence length {Z.shape[1]} is too short for I={self.indices}")
        return self.h(Z[:, list(self.indices)])


def holder_ridge(indices: tuple[int, ...], beta: float = 1.0, *, seed: int = 0) -> SparseTarget:
    """A β-Hölder ridge target with an exactly known Hölder constant.

    .. math::

        h(u) = |\\langle w, u\\rangle - c|^{\\beta},\\qquad \\|w\\|_2 = 1,\\ c \\in [-1/2, 1/2],

    with ``w`` and ``c`` drawn from ``seed``.  Since ``|<w, u - v>| <= ||u - v||_2``, the constant of
    :func:`holder_constant_of_power` carries over.  The kink (β < 2) at ``<w,u> = c`` lies inside the
    box, so the Hölder exponent is attained and interpolation errors decay exactly like ``δ^β``.
    """
    beta = _check_beta(beta)
    s = len(indices)
    if s == 0:  # a constant: no ridge direction (it reached build_construction as max() of nothing)
        raise InputError("a Hölder ridge target needs at least one relevant position (indices is empty)")
    g = torch.Generator().manual_seed(int(seed))
    w = torch.randn(s, generator=g, dtype=torch.float64)
    w = w / w.norm()
    c = float(torch.rand(1, generator=g, dtype=torch.float64)) - 0.5
    w_list = w.tolist()

    def h(U: Tensor) -> Tensor:
        t = U @ torch.tensor(w_list, dtype=U.dtype, device=U.device) - c
        return t.abs() ** beta

    return SparseTarget("holder", tuple(indices), h, beta, holder_constant_of_power(beta))


def sparse_parity(indices: tuple[int, ...]) -> SparseTarget:
    """Sparse parity ``prod_{i in I} z_i`` on ±1 tokens (Edelman et al. 2022, section 6)."""

    def h(U: Tensor) -> Tensor:
        return torch.sign(U).prod(dim=-1)

    return SparseTarget("parity", tuple(indices), h)


def sparse_majority(indices: tuple[int, ...]) -> SparseTarget:
    """Sparse majority ``sign(sum_{i in I} z_i)`` on ±1 tokens (|I| odd; Trauger & Tewari 2023)."""
    if len(indices) % 2 == 0:
        raise InputError(f"sparse majority needs an odd sparsity, but got s={len(indices)}")

    def h(U: Tensor) -> Tensor:
        return torch.sign(torch.sign(U).sum(dim=-1))

    return SparseTarget("majority", tuple(indices), h)


def _default_indices(seq_len: int, sparsity: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(int(seed) + 7919)  # a different stream from the data
    return tuple(sorted(torch.randperm(seq_len, generator=g)[:sparsity].tolist()))


def sparse_target(name: str, seq_len: int, *, sparsity: int = 2, beta: float = 1.0,
                  indices: tuple[int, ...] | None = None, seed: int = 0) -> SparseTarget:
    """The fixed-I target behind :func:`make_sparse_task` (``retrieval`` has none: its I varies)."""
    seq_len = _check_positive_int("seq_len", seq_len)
    sparsity = _check_positive_int("sparsity", sparsity)
    if sparsity > seq_len:
        raise InputError(f"sparsity s must be <= seq_len n, but got s={sparsity} > n={seq_len}")
    I = _check_indices(tuple(indices), seq_len) if indices is not None else _default_indices(seq_len, sparsity, seed)
    if name == "holder":
        return holder_ridge(I, beta, seed=seed)
    if name == "parity":
        return sparse_parity(I)
    if name == "majority":
        return sparse_majority(I)
    raise InputError(f"task name must be one of {list(TASK_NAMES[:3])} for a fixed-I target, but got {name!r}")


def make_sparse_task(name: str, n_samples: int, seq_len: int, *, sparsity: int = 2, beta: float = 1.0,
                     indices: tuple[int, ...] | None = None, noise: float = 0.0, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Seeded synthetic sparse-token data ``(X, y)``.

    Tasks (``X`` is ``(N, T, d_in)``, ``y`` is ``(N,)``, both ``dtype``):

    * ``"holder"``: ``d_in = 1``, ``z_t ~ U[-1, 1]``, ``y = h(z_I) (+ noise)`` with the β-Hölder
      ridge of :func:`holder_ridge` (regression).
    * ``"parity"`` / ``"majority"``: ``d_in = 1``, ``z_t`` uniform ±1, ``y = ±1``
      (sparse parity / sparse majority; use ``(y + 1) / 2`` as a class label).
    * ``"retrieval"``: q-sparse token retrieval with the relevant positions *given in the input*
      (Mousavi-Hosseini et al. 2025): ``d_in = 2``, channel 0 is the content ``z_t ~ U[-1, 1]``,
      channel 1 marks the ``q = sparsity`` positions of a per-sample random set ``I(X)``;
      ``y = mean_{t in I(X)} z_t``.

    The index set of the fixed-I tasks is ``indices`` or a random one drawn from ``seed``;
    :func:`sparse_target` with the same arguments returns it (``.indices``) and ``g*`` itself.

    Args:
        name: one of ``"holder"``, ``"parity"``, ``"majority"``, ``"retrieval"``.
        n_samples: N > 0.  seq_len: T > 0.  sparsity: s = |I| with 0 < s <= T.
        beta: Hölder smoothness in (0, 2] (``"holder"`` only).  noise: std of Gaussian label noise >= 0.
        seed: everything (I, the ridge, X, noise) is a function of ``seed``.

    Raises:
        InputError: on an unknown name or an invalid size, beta, noise or index set.

    Example:
        >>> X, y = make_sparse_task("holder", 4, 8, sparsity=2, seed=0)
        >>> tuple(X.shape), tuple(y.shape)
        ((4, 8, 1), (4,))
    """
    if name not in TASK_NAMES:
        raise InputError(f"task name must be one of {list(TASK_NAMES)}, but got {name!r}")
    n_samples = _check_positive_int("n_samples", n_samples)
    seq_len = _check_positive_int("seq_len", seq_len)
    sparsity = _check_positive_int("sparsity", sparsity)
    if sparsity > seq_len:
        raise InputError(f"sparsity s must be <= seq_len n, but got s={sparsity} > n={seq_len}")
    if not (isinstance(noise, (int, float)) and noise >= 0 and math.isfinite(noise)):
        raise InputError(f"noise must be a finite number >= 0, but got noise={noise!r}")
    g = torch.Generator().manual_seed(int(seed))
    if name == "retrieval":
        Z = torch.rand(n_samples, seq_len, generator=g, dtype=torch.float64) * 2 - 1
        order = torch.rand(n_samples, seq_len, generator=g).argsort(dim=1)[:, :sparsity]
        mark = torch.zeros(n_samples, seq_len, dtype=torch.float64)
        mark.scatter_(1, order, 1.0)
        y = (Z * mark).sum(dim=1) / sparsity
        X = torch.stack([Z, mark], dim=-1)
    else:
        target = sparse_target(name, seq_len, sparsity=sparsity, beta=beta, indices=indices, seed=seed)
        if name == "holder":
            Z = torch.rand(n_samples, seq_len, generator=g, dtype=torch.float64) * 2 - 1
        else:
            Z = torch.randint(0, 2, (n_samples, seq_len), generator=g).double() * 2 - 1
        y = target(Z)
        X = Z[..., None]
    if noise > 0:
        y = y + noise * torch.randn(n_samples, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def retrieval_indices(X: Tensor) -> list[tuple[int, ...]]:
    """The per-sample index sets ``I(X)`` of a ``"retrieval"`` batch (channel 1 marks them)."""
    return [tuple(torch.nonzero(row > 0.5).flatten().tolist()) for row in X[..., 1]]
