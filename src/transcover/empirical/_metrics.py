"""The empirical sup-metric of seed section 1.1 on a finite class of functions, computed in blocks.

.. math::

    d_q(f, g) = \\max_{1 \\le i \\le n} \\| f(x_i) - g(x_i) \\|_q, \\qquad q \\in \\{1, 2, \\infty\\}

A finite class is given by its outputs on the samples: a tensor ``Y`` of shape ``(M, n, b)``
(``M`` functions, ``n`` samples, ``b`` outputs per sample); a ``(M, n)`` tensor means ``b = 1``.
``N_inf(F, eps, {x_i}, ||.||_q)`` of THEORY section 2 is the covering number of the rows of ``Y``
in this metric.

Note [blocked distances]: a distance block between ``A`` (a rows) and ``B`` (k rows) is computed
with ``torch.cdist`` (vectorised, no ``a x k x n x b`` difference tensor).  For ``q = inf`` and
for ``b = 1`` the metric is the l_inf distance of the flattened rows (for scalars every q-norm is
the absolute value), one ``cdist(p=inf)``.  Otherwise per-sample q-distances come from a batched
``cdist`` over the ``n`` samples followed by a max, which holds an ``n x a x k`` temporary; the
callers choose ``a`` and ``k`` so that it stays inside a memory budget.  The Euclidean case uses
``donot_use_mm_for_euclid_dist``: the faster ``|a|^2 + |b|^2 - 2ab`` form cancels catastrophically
near zero distance, and a net's decisions ``d <= eps`` must not depend on that.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._errors import InputError

__all__ = ["as_outputs", "check_q", "check_eps", "distance_matrix", "sample_distance"]

_Q_VALUES = (1.0, 2.0, math.inf)

# Elements of a temporary (n x a x k floats) that a distance block may allocate: 16 Mi floats
# (64 MiB in float32).  Large enough that cdist runs at full speed, small enough for 2 GiB peaks.
DEFAULT_BLOCK_ELEMENTS = 1 << 24


def check_q(q: float | str) -> float:
    """Normalise ``q`` (1, 2, inf, or the strings "1", "2", "inf") or raise InputError."""
    try:
        qf = float(q)
    except (TypeError, ValueError):
        raise InputError(f"q must be 1, 2 or inf, but got q={q!r}") from None
    if qf not in _Q_VALUES:
        raise InputError(f"q must be 1, 2 or inf, but got q={q!r}")
    return qf


def check_eps(eps: float, name: str = "eps") -> float:
    """A finite positive accuracy, or InputError naming the value."""
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number > 0, but got {name}={eps!r}") from None
    if not (e > 0.0 and math.isfinite(e)):
        raise InputError(f"{name} must be a finite number > 0, but got {name}={eps!r}")
    return e


def as_outputs(Y: object, name: str = "outputs") -> Tensor:
    """Validate a finite class's outputs and return them as a ``(M, n, b)`` floating tensor.

    Accepts a torch tensor or anything ``torch.as_tensor`` takes (numpy arrays).  Integer data
    becomes float64, float16 and bfloat16 become float32: both conversions are exact, so the
    exact distance decisions of ``_predicates`` are about the data as given.

    Raises:
        InputError: wrong number of dimensions, an empty axis, a NaN/Inf entry, or an integer
            beyond 2^53 in magnitude (float64 could not hold it exactly).
    """
    try:
        T = torch.as_tensor(Y)
    except (TypeError, ValueError, RuntimeError) as err:
        raise InputError(f"{name} is not a numeric array: {err}") from None
    if T.ndim == 2:
        T = T[:, :, None]
    if T.ndim != 3:
        raise InputError(
            f"{name} must have shape (M functions, n samples, b outputs) or (M, n), "
            f"but got shape {tuple(T.shape)}")
    if min(T.shape) == 0:
        raise InputError(f"{name} has an empty axis: shape {tuple(T.shape)}")
    if T.is_complex() or T.dtype == torch.bool:
        raise InputError(f"{name} must be real-valued, but got dtype {T.dtype}")
    if T.dtype in (torch.uint16, torch.uint32, torch.uint64):
        # torch has no comparisons for these ("gt_cpu" not implemented: an internal error, red team 181): range-check
        # the values as numpy holds them, then go on as a signed integer array
        if int(T.numpy().max()) > 2**53:
            raise InputError(f"{name} has integers beyond 2^53 in magnitude, which float64 cannot hold exactly")
        T = torch.from_numpy(T.numpy().astype("int64"))
    if not T.is_floating_point():
        # compared as int64: against a narrower dtype 2^53 wrapped, and every uint8/int16/int32 array was refused as
        # "beyond 2^53" (red team 181)
        T = T.to(torch.int64)
        if bool(((T > 2**53) | (T < -2**53)).any()):
            raise InputError(f"{name} has integers beyond 2^53 in magnitude, which float64 cannot hold exactly")
        T = T.to(torch.float64)
    elif T.dtype in (torch.float16, torch.bfloat16):
        T = T.to(torch.float32)
    big = torch.finfo(T.dtype).max  # amax/amin propagate NaN and are vectorised (isfinite is not)
    if not (bool(T.amax() <= big) and bool(T.amin() >= -big)):
        raise InputError(f"{name} contains NaN or Inf")
    return T


def _flat_metric(q: float, b: int) -> bool:
    """True when d_q is the l_inf distance of flattened rows (q = inf, or scalar outputs)."""
    return q == math.inf or b == 1


def distance_matrix(A: Tensor, B: Tensor, q: float, *,
                    block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> Tensor:
    """All distances ``d_q(A_j, B_k)`` as an ``(a, k)`` matrix (the caller bounds ``a * k``).

    Args:
        A: outputs ``(a, n, b)``.
        B: outputs ``(k, n, b)``, same ``n, b`` and dtype as ``A``.
        q: 1, 2 or inf.
        block_elements: cap on the ``n x a' x k`` temporary of the per-sample case.

    Returns:
        ``(a, k)`` tensor of distances, in ``A``'s dtype.
    """
    a, n, b = A.shape
    k = B.shape[0]
    if _flat_metric(q, b):
        return torch.cdist(A.reshape(a, n * b), B.reshape(k, n * b), p=math.inf)
    mode = "donot_use_mm_for_euclid_dist"
    Bt = B.transpose(0, 1).contiguous()  # (n, k, b)
    out = torch.empty(a, k, dtype=A.dtype)
    rows = max(1, block_elements // max(1, n * k))
    for s in range(0, a, rows):
        At = A[s:s + rows].transpose(0, 1).contiguous()  # (n, a', b)
        out[s:s + rows] = torch.cdist(At, Bt, p=q, compute_mode=mode).amax(dim=0)
    return out


def sample_distance(f: Tensor, g: Tensor, q: float) -> float:
    """``d_q(f, g)`` for two single functions' outputs ``(n, b)`` (or ``(n,)``): a scalar."""
    f2 = f.reshape(f.shape[0], -1) if f.ndim > 1 else f[:, None]
    g2 = g.reshape(g.shape[0], -1) if g.ndim > 1 else g[:, None]
    return float(distance_matrix(f2[None], g2[None], check_q(q))[0, 0])
