"""F5 (docs/theory.md): ||sm(a) - sm(b)||_1 <= c_sm ||a - b||_inf holds with c_sm = 1, and no smaller c_sm.

The bounds take c_sm as a parameter (default 1); these checks pin the fact the default rests on.
"""

import itertools

import numpy as np
import torch


def _l1_gain_at_vertices(p: np.ndarray) -> float:
    """max over v in {-1, 1}^n of ||(diag(p) - p p^T) v||_1: the l_inf -> l_1 norm of the Jacobian
    (a convex function of v, so its maximum over the cube is at a vertex)."""
    J = np.diag(p) - np.outer(p, p)
    return max(np.abs(J @ np.array(v)).sum() for v in itertools.product((-1.0, 1.0), repeat=p.size))


def test_jacobian_gain_never_exceeds_one():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(300):
        n = int(rng.integers(2, 8))
        p = rng.dirichlet(np.full(n, rng.uniform(0.05, 3.0)))
        worst = max(worst, _l1_gain_at_vertices(p))
    # exact value 4q(1-q) <= 1 per vertex; float64 rounding of n terms of size <= 1
    assert worst <= 1.0 + 16 * np.finfo(np.float64).eps


def test_one_is_attained_so_smaller_constants_are_not_certificates():
    a = torch.zeros(2, dtype=torch.float64)
    v = torch.tensor([1.0, -1.0], dtype=torch.float64)
    h = 1e-6
    ratio = (torch.softmax(a + h * v, 0) - torch.softmax(a, 0)).abs().sum() / h
    assert ratio > 1.0 - 1e-5  # any c_sm < 1 - 1e-5 would be violated by this pair


def test_global_pairs_respect_the_constant():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2000, 6, generator=g, dtype=torch.float64) * 4
    b = a + torch.randn(2000, 6, generator=g, dtype=torch.float64) * torch.rand(2000, 1, generator=g, dtype=torch.float64) * 5
    lhs = (torch.softmax(a, -1) - torch.softmax(b, -1)).abs().sum(-1)
    rhs = (a - b).abs().amax(-1)
    assert torch.all(lhs <= rhs * (1 + 1e-12) + 1e-15)
