"""Higham's ``gamma_k``, the relative error of ``k`` float64 roundings, for the local routes (issue 12).

One place for the unit roundoff these bounds read: a test that evaluates a stage in float32 sets ``_U`` here to
``2^-24`` and every ``gamma_k`` follows (``tests/lipschitz/test_local_stack.py``).
"""

from __future__ import annotations

_U = 2.0**-53


def _gamma(k: int) -> float:
    """``gamma_k = k u / (1 - k u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1): a product of
    ``k`` factors ``(1 + delta_i)^{+-1}``, ``|delta_i| <= u``, lies within ``gamma_k`` of 1 when ``k u < 1``."""
    return k * _U / (1 - k * _U)
