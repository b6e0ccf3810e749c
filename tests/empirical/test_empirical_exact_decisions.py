"""Issue 10, defect 7: every net/packing decision ``d <= r`` is exact, whatever the data's dtype.

The reference is rational arithmetic on the floats' exact values (``Fraction``), independent of
torch's kernels: a naive greedy over exact distances, and a brute-force covering number over all
subsets of a tiny set.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import InputError
from transcover.cli import main
from transcover.empirical import (
    as_outputs,
    covering_of_outputs,
    estimate_covering_number,
    exact_covering_number,
    greedy_net,
    maximal_packing,
)

QS = (1.0, 2.0, math.inf)


def exact_distance(f: torch.Tensor, g: torch.Tensor, q: float) -> Fraction:
    """``max_i ||f_i - g_i||_q`` for q in {1, inf}, or its square for q = 2, in Fractions."""
    worst = Fraction(0)
    for fi, gi in zip(f.double().tolist(), g.double().tolist()):
        d = [abs(Fraction(a) - Fraction(b)) for a, b in zip(fi, gi)]
        v = max(d) if (q == math.inf or len(d) == 1) else (sum(d) if q == 1.0 else sum(t * t for t in d))
        worst = max(worst, v)
    return worst


def exact_le(f, g, q: float, r: float) -> bool:
    d = exact_distance(f, g, q)
    R = Fraction(r)
    b = f.shape[-1]
    return d <= (R * R if (q == 2.0 and b > 1) else R)


def exact_greedy(Y: torch.Tensor, r: float, q: float) -> list[int]:
    """Sequential greedy: a point is a centre iff exactly farther than r from every earlier centre."""
    centres: list[int] = []
    for j in range(Y.shape[0]):
        if not any(exact_le(Y[j], Y[c], q, r) for c in centres):
            centres.append(j)
    return centres


def brute_force_internal(Y: torch.Tensor, eps: float, q: float) -> int:
    """Fewest centres from the set covering it, by trying every subset (M <= 8)."""
    M = Y.shape[0]
    close = [[exact_le(Y[i], Y[j], q, eps) for j in range(M)] for i in range(M)]
    for k in range(1, M + 1):
        for S in itertools.combinations(range(M), k):
            if all(any(close[i][j] for j in S) for i in range(M)):
                return k
    return M


# ---- the reproductions of the issue ---------------------------------------------------------------

def test_float32_unit_grid_below_one():
    """Points 0..9 are pairwise >= 1 apart: at eps = 0.999999999 no point covers another."""
    Y = np.arange(10, dtype=np.float32)[:, None]
    est = estimate_covering_number(Y, 0.999999999)
    assert est.net_size == 10
    assert exact_covering_number(Y, 0.999999999) == 10
    assert est.packing_size == 5  # 0, 2, 4, 6, 8: pairwise >= 2 > 2 eps
    assert estimate_covering_number(Y, 1.0).net_size == 5  # at eps = 1 exactly, neighbours are covered


def test_cli_finite_prints_eps_and_net(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps narrow tables; the row must stay one line
    np.save(tmp_path / "y.npy", np.arange(10, dtype=np.float32)[:, None])
    assert main(["cover", "finite", str(tmp_path / "y.npy"), "--eps", "0.999999999", "--exact"]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if "0.999999999" in ln]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].replace("│", "|").split("|") if c.strip()]
    assert cells[0] == "0.999999999" and cells[1:3] == ["5", "10"] and cells[-1] == "10"


def test_torch_does_cast_the_radius():
    """Why the defect existed: a Python radius compared with a float32 tensor is cast to float32."""
    from transcover.empirical._predicates import within

    assert bool(torch.tensor([1.0], dtype=torch.float32) <= 0.999999999)
    assert not bool(within(torch.tensor([[[1.0]]]), torch.tensor([[[0.0]]]), math.inf, 0.999999999))


# ---- exactness against rational arithmetic --------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@st.composite
def boundary_sets(draw):
    """Small sets in a low-precision dtype and a radius equal to, or one float64 ulp around, a distance."""
    dtype = draw(st.sampled_from(DTYPES))
    q = draw(st.sampled_from(QS))
    M, n, b = draw(st.integers(2, 7)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    scale = draw(st.sampled_from([1.0, 1 / 3, 0.1, 1e3, 2.0**-20]))
    vals = draw(st.lists(st.integers(-6, 6), min_size=M * n * b, max_size=M * n * b))
    jitter = draw(st.lists(st.floats(-0.49, 0.49), min_size=M * n * b, max_size=M * n * b))
    spread = draw(st.sampled_from([0.0, 1e-3]))  # 0: integer lattice (many exact ties)
    base = torch.tensor(vals, dtype=torch.float64) + torch.tensor(jitter, dtype=torch.float64) * spread
    Y = (base * scale).reshape(M, n, b).to(dtype)
    i, j = draw(st.integers(0, M - 1)), draw(st.integers(0, M - 1))
    d = exact_distance(Y[i], Y[j], q)
    r = float(d) if not (q == 2.0 and b > 1) else math.sqrt(float(d))
    r = draw(st.sampled_from([r, math.nextafter(r, 0.0), math.nextafter(r, math.inf), r * (1 - 1e-9), r * (1 + 1e-9)]))
    if not r > 0:
        r = scale
    return Y, q, r


@settings(max_examples=100, deadline=None)
@given(boundary_sets())
def test_within_is_exact(data):
    from transcover.empirical._predicates import certainly_beyond, certainly_within, within

    Y, q, r = data
    Yw = as_outputs(Y)
    got = within(Yw, Yw, q, r).numpy()
    ref = np.array([[exact_le(Yw[i], Yw[j], q, r) for j in range(len(Yw))] for i in range(len(Yw))])
    assert (got == ref).all()
    # the stage-1 verdicts alone are sound: never a wrong "certainly"
    from transcover.empirical import distance_matrix

    D = distance_matrix(Yw, Yw, q)
    terms = 1 if (q == math.inf or Yw.shape[2] == 1) else Yw.shape[2]
    assert not (certainly_within(D, r, terms).numpy() & ~ref).any()
    assert not (certainly_beyond(D, r, terms).numpy() & ref).any()


@settings(max_examples=80, deadline=None)
@given(boundary_sets(), st.integers(1, 5))
def test_net_and_packing_are_the_exact_greedy(data, chunk):
    """The greedy net is a valid eps-cover, the packing strictly 2eps-separated, in exact arithmetic."""
    Y, q, eps = data
    Yw = as_outputs(Y)
    assert greedy_net(Y, eps, q, chunk_size=chunk).tolist() == exact_greedy(Yw, eps, q)
    assert maximal_packing(Y, eps, q, chunk_size=chunk).tolist() == exact_greedy(Yw, 2 * eps, q)


@settings(max_examples=60, deadline=None)
@given(boundary_sets())
def test_packing_exact_net_chain_against_brute_force(data):
    Y, q, eps = data
    est = estimate_covering_number(Y, eps, q, n_orders=2)
    n_int = brute_force_internal(as_outputs(Y), eps, q)
    assert exact_covering_number(Y, eps, q) == n_int
    assert est.packing_size <= n_int <= est.net_size
    if q == math.inf:
        assert est.packing_size <= exact_covering_number(Y, eps, q, centres="external") <= n_int


def test_monte_carlo_path_uses_the_exact_decisions():
    """``covering_of_outputs`` (the Monte-Carlo engine) on the float32 grid of the issue."""
    Y = torch.arange(10, dtype=torch.float32)[:, None]
    res = covering_of_outputs(Y, [0.999999999, 1.0], checkpoints=[10])
    assert [s[-1] for s in res.net_sizes] == [10, 5]
    assert [s[-1] for s in res.packing_sizes] == [5, 4]


def test_float32_overflow_is_not_taken_as_far():
    """q = 2 squares of 3e19 overflow float32 (D = inf), yet the distance is below eps = 1e30."""
    from transcover.empirical import distance_matrix
    from transcover.empirical._predicates import within

    Y = torch.tensor([[[0.0, 0.0]], [[3e19, 3e19]]], dtype=torch.float32)
    assert torch.isinf(distance_matrix(Y, Y, 2.0)).any()
    assert within(Y, Y, 2.0, 1e30).all()
    assert len(greedy_net(Y, 1e30, 2.0)) == 1
    assert not within(Y, Y, 2.0, 4e19)[0, 1]  # sqrt(2) 3e19 = 4.24e19 > 4e19


def test_subnormal_and_huge_radii():
    Y = torch.tensor([[0.0], [2.0**-140]], dtype=torch.float32)  # float32 subnormal
    assert len(greedy_net(Y, 2.0**-141, math.inf)) == 2
    assert len(greedy_net(Y, 2.0**-140, math.inf)) == 1
    assert len(maximal_packing(torch.tensor([[0.0], [1.0]]), 1e308)) == 1  # 2 eps overflows to inf


def test_integers_beyond_2_53_refused():
    Y = torch.tensor([[0], [2**53 + 1]], dtype=torch.int64)
    with pytest.raises(InputError, match="2\\^53"):
        estimate_covering_number(Y, 1.0)
    assert estimate_covering_number(torch.tensor([[0], [2**53]], dtype=torch.int64), 2.0**53).net_size == 1


def test_many_ties_are_decided_exactly_and_in_chunks(monkeypatch):
    """A float32 lattice at its own spacing: every neighbour is a tie, resolved exactly in small blocks."""
    from transcover.empirical import _predicates

    monkeypatch.setattr(_predicates, "_PAIR_BLOCK", 8)
    Y = (torch.arange(300, dtype=torch.float32) * 0.5)[:, None]
    assert greedy_net(Y, 0.5).tolist() == list(range(0, 300, 2))  # a centre covers the next point, a tie
    assert len(maximal_packing(Y, 0.25)) == 150  # strictly > 0.5 apart: every other point
    lattice = torch.tensor([[[i * 0.5, j * 0.5]] for i in range(5) for j in range(5)], dtype=torch.float32)
    for q in QS:
        assert greedy_net(lattice, 0.5, q).tolist() == exact_greedy(lattice, 0.5, q)


@pytest.mark.parametrize("mode", ["reference", "uniform"])
def test_cli_class_modes_print_eps_in_full(mode, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    extra = ["--n", "2", "--pool", "4", "--restarts", "1"] if mode == "uniform" else []
    assert main(["cover", mode, "--functions", "20", "--layers", "1", "--d-model", "8", "--d-ff", "8",
                 "--samples", "2", "--seq-len", "2", "--eps", "0.0500000001", *extra]) == 0
    assert "0.0500000001" in capsys.readouterr().out


def test_integer_data_exact():
    Y = torch.arange(10, dtype=torch.int64)[:, None]
    assert estimate_covering_number(Y, 0.999999999).net_size == 10
    assert estimate_covering_number(Y, 1.0).net_size == 5


def test_external_cover_decides_twice_eps_beyond_float64s_range():
    """Red team 162: with eps above half of float64's range, 2 eps overflowed to an infinite radius and two points
    2e308 apart were one external cover ("exact" answer 1, true 2). d <= 2 eps is now decided on the halved data."""
    from transcover.empirical import exact_covering_number

    big = torch.finfo(torch.float64).max
    Y = torch.tensor([[1e308], [-1e308]], dtype=torch.float64)
    assert exact_covering_number(Y, 9e307, centres="external") == 2  # 2e308 > 1.8e308
    assert exact_covering_number(Y, 1e308, centres="external") == 1  # 2e308 <= 2e308: a tie, closed balls
    assert exact_covering_number(torch.tensor([[big], [-big], [0.0]], dtype=torch.float64), 0.6 * big,
                                 centres="external") == 2
    with pytest.raises(InputError, match="subnormal"):
        exact_covering_number(torch.tensor([[1e308], [5e-324]], dtype=torch.float64), 9e307, centres="external")
