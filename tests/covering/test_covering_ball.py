"""Lemma G.2 against explicitly constructed eps-nets and packings in dimensions 1-3."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from transcover import InputError, Kind
from transcover.covering import (
    ball_log_covering,
    ball_log_covering_simple,
    ball_log_packing_lower,
    box_log_covering,
    box_log_covering_linf,
)


def _grid(p: int, spacing: float, reach: float) -> np.ndarray:
    k = int(math.ceil(reach / spacing))
    axis = spacing * np.arange(-k, k + 1)
    return np.array(list(itertools.product(axis, repeat=p)), dtype=np.float64)


def _uniform_in_ball(rng, n: int, p: int, B: float) -> np.ndarray:
    x = rng.standard_normal((n, p))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x * B * rng.random((n, 1)) ** (1.0 / p)


def _min_dist(points: np.ndarray, centres: np.ndarray) -> np.ndarray:
    out = np.empty(len(points))
    for i in range(0, len(points), 512):
        d = np.linalg.norm(points[i:i + 512, None, :] - centres[None, :, :], axis=-1)
        out[i:i + 512] = d.min(axis=1)
    return out


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("ratio", [1.0, 2.5, 6.0])
def test_grid_net_is_a_net_and_smaller_than_bound(p, ratio):
    B, eps = 1.0, 1.0 / ratio
    h = 2 * eps / math.sqrt(p)  # cube half-diagonal = eps: every point is within eps of its cube's centre
    grid = _grid(p, h, B + eps)
    net = grid[np.linalg.norm(grid, axis=1) <= B + eps]
    rng = np.random.default_rng(p)
    pts = _uniform_in_ball(rng, 4000, p, B)
    assert _min_dist(pts, net).max() <= eps * (1 + 1e-12)
    assert math.log(len(net)) <= ball_log_covering(p, B, eps).value


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_greedy_packing_between_lower_and_upper_bound(p, ratio):
    B, eps = 1.0, 1.0 / ratio
    delta = eps / 4  # candidate resolution: the maximal packing is an (eps + delta*sqrt(p)/2)-net
    cand = _grid(p, delta, B)
    cand = cand[np.linalg.norm(cand, axis=1) <= B]
    chosen: list[np.ndarray] = []
    for c in cand:
        if not chosen or np.linalg.norm(np.asarray(chosen) - c, axis=1).min() > eps:
            chosen.append(c)
    S = np.asarray(chosen)
    slack = eps + delta * math.sqrt(p) / 2
    # an eps-separated set is no larger than the volumetric bound (1 + 2B/eps)^p
    assert math.log(len(S)) <= ball_log_covering(p, B, eps).value
    # and, being a slack-net, no smaller than N(slack) >= (B/slack)^p
    assert math.log(len(S)) >= ball_log_packing_lower(p, B, slack).value


def test_simple_form_only_for_eps_below_radius():
    assert ball_log_covering_simple(10, 2.0, 0.5).value >= ball_log_covering(10, 2.0, 0.5).value
    assert ball_log_covering_simple(3, 1.0, 1.0).value == pytest.approx(3 * math.log(3.0), rel=1e-15)
    with pytest.raises(InputError, match="eps <= B"):
        ball_log_covering_simple(3, 1.0, 1.5)


def test_box_in_l2_and_linf():
    # the l_inf box of half-width b sits in the l2 ball of radius b sqrt(p)
    assert box_log_covering(4, 0.5, 0.1).value == pytest.approx(ball_log_covering(4, 1.0, 0.1).value, rel=1e-15)
    q = box_log_covering_linf(3, 1.0, 0.3)
    assert q.kind is Kind.EXACT and q.value == pytest.approx(3 * math.log(4), rel=1e-15)


def test_huge_dimension_no_overflow():
    v = ball_log_covering(10**9, 1e3, 1e-12).value
    assert math.isfinite(v) and v > 1e10


@pytest.mark.parametrize("bad", [dict(p=0, radius=1.0, eps=0.1), dict(p=2, radius=-1.0, eps=0.1),
                                 dict(p=2, radius=1.0, eps=0.0), dict(p=2, radius=1.0, eps=float("nan"))])
def test_bad_inputs(bad):
    with pytest.raises(InputError):
        ball_log_covering(**bad)
