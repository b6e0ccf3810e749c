"""``benchmarks/local_lipschitz_merge.py``: reruns replace a base run sentence by sentence, keep the larger lower of a
ball, refuse runs that disagree on the input, and check every certified ball against the merged lower."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from local_lipschitz_merge import merge  # noqa: E402

from transcover._errors import CertificateViolation  # noqa: E402


def _row(sentence, ball, lower, point_lower=None, median=2.0, T=5):
    pl = lower if point_lower is None else point_lower
    return {"sentence": sentence, "T": T, "layer": 0, "rho": 1e-3, "median_norm": median, "point": 0.9 * ball,
            "ball": ball, "point_lower": pl, "lower": lower, "lower_method": "point", "ratio": ball / lower,
            "ratio_point_lower": ball / pl, "point_ratio": 0.9 * ball / pl, "parts": {}, "seconds": 1.0,
            "cpu_seconds": 1.0, "lower_seconds": 0.0}


def test_a_rerun_replaces_its_sentences_and_keeps_the_larger_lower():
    base = {"skip": 0, "layers": [_row(0, 10.0, 4.0), _row(1, 10.0, 4.0), _row(2, 10.0, 4.0)]}
    rerun = {"skip": 1, "layers": [_row(0, 6.0, 3.0), _row(1, 5.0, 4.5)]}  # sentences 1 and 2
    rows = merge([("old", base), ("new", rerun)])
    assert [(r["sentence"], r["run"]) for r in rows] == [(0, "old"), (1, "new"), (2, "new")]
    assert rows[1]["ball"] == 6.0 and rows[1]["lower"] == 4.0 and rows[1]["ratio"] == 1.5  # the base's lower
    assert rows[1]["lower_method"] == "point (old)"
    assert rows[2]["lower"] == 4.5 and rows[2]["ratio"] == 5.0 / 4.5  # its own
    again = merge([("merged", {"layers": rows}), ("newer", {"skip": 2, "layers": [_row(0, 5.0, 4.0)]})])
    assert [r["run"] for r in again] == ["old", "new", "newer"]  # a merged file keeps its labels


def test_runs_on_different_inputs_are_refused():
    base = {"skip": 0, "layers": [_row(0, 10.0, 4.0)]}
    with pytest.raises(SystemExit, match="median norm"):
        merge([("old", base), ("new", {"skip": 0, "layers": [_row(0, 6.0, 3.0, median=2.5)]})])
    with pytest.raises(SystemExit, match="T 5 vs 6"):
        merge([("old", base), ("new", {"skip": 0, "layers": [_row(0, 6.0, 3.0, T=6)]})])


def test_a_ball_below_the_merged_lower_is_a_violation():
    base = {"skip": 0, "layers": [_row(0, 10.0, 7.0)]}
    with pytest.raises(CertificateViolation):
        merge([("old", base), ("new", {"skip": 0, "layers": [_row(0, 6.0, 3.0)]})])


def test_against_an_older_run_uses_the_larger_lower_and_only_the_named_runs():
    from local_lipschitz_merge import against

    old = [_row(0, 10.0, 4.0), _row(1, 12.0, 2.0), _row(2, 9.0, 3.0)]
    rows = merge([("old", {"skip": 0, "layers": old}), ("new", {"skip": 1, "layers": [_row(0, 6.0, 3.0)]}),
                  ("other", {"skip": 2, "layers": [_row(0, 4.0, 3.0)]})])
    lines = against(rows, old, {"new"})
    assert lines[2] == "| 0.001 | 1 | 1 | 2 | 2 | 4 | 4 |"  # sentence 1 alone, both over the new lower 3.0
    assert len(against(rows, old, {"new", "other"})) == 3 and "| 2 | 2 |" in against(rows, old, {"new", "other"})[2]
    with pytest.raises(CertificateViolation):  # the old ball below the new lower
        against(rows, [_row(0, 10.0, 4.0), _row(1, 2.5, 2.0)], {"new"})
