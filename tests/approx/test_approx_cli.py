"""`transcover approx` and `transcover advise`: outputs, JSON, plots, one-line errors."""

import json

import pytest

from transcover.cli import main


def test_approx_construct_json_and_save(tmp_path, capsys):
    out, st = tmp_path / "c.json", tmp_path / "c.safetensors"
    rc = main(["approx", "construct", "--seq-len", "6", "--sparsity", "2", "--grid", "3", "--R", "10",
               "--search", "100", "--json", str(out), "--save", str(st)])
    assert rc == 0 and st.exists()
    data = json.loads(out.read_text())
    dec = data["decomposition"]
    assert dec["total"]["value"] <= dec["bound"]["total"]["value"]
    assert data["capacity"]["B_V"] == pytest.approx(1.0)


def test_approx_sweep_encodings_failures_and_advise(tmp_path):
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    assert main(["approx", "sweep", "--over", "R", "--ns", "8", "--deltas", "0,0.3", "--Rs", "4,8,12,16",
                 "--plot", str(png), "--json", str(js)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and json.loads(js.read_text())["fits"]
    assert main(["approx", "encodings", "--kind", "random", "--n", "16", "--dim", "32", "--json", str(js)]) == 0
    enc = json.loads(js.read_text())
    assert enc["delta"] == pytest.approx(float(enc["delta_fraction"].split("/")[0]) / float(enc["delta_fraction"].split("/")[1]))
    assert main(["approx", "failures", "--mode", "delta", "--json", str(js)]) == 0
    assert main(["advise", "--sparsity", "2", "--smoothness", "1", "--seq-len", "32", "--n-samples", "100000",
                 "--json", str(js), "--plot", str(png)]) == 0
    assert json.loads(js.read_text())["heads"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["approx", "construct", "--R", "-1"], "R must be > 0"),
    (["approx", "construct", "--R", "0"], "R must be > 0"),
    (["approx", "construct", "--delta", "0.5"], "delta"),
    (["approx", "construct", "--sparsity", "9", "--seq-len", "4"], "s=9 > n=4"),
    (["approx", "construct", "--search", "0"], "--search"),
    (["approx", "encodings", "--delta", "0.7"], "delta"),
    (["approx", "sweep", "--over", "R", "--Rs", "1,-2"], "R must be > 0"),
    (["approx", "sweep", "--over", "R", "--deltas", "0.5"], "delta"),
    (["approx"], "sub-command"),
    (["advise", "--sparsity", "2", "--smoothness", "1", "--seq-len", "8", "--n-samples", "0"], "n_samples"),
    (["advise", "--sparsity", "2", "--smoothness", "3", "--seq-len", "8", "--n-samples", "10"], "beta"),
])
def test_bad_input_is_one_line_and_nonzero(argv, needle, capsys, tmp_path):
    js = tmp_path / "never.json"
    rc = main(argv + (["--json", str(js)] if argv[0] == "advise" else []))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err and err.startswith("transcover: error:")
    assert not js.exists()


def test_sweep_and_advise_refuse_what_they_used_to_bend(capsys):
    """Stop 38 red team: --ns 2.5 ran as n = 2, '--Rs 1,,2' as [1, 2], and advise at one sample picked the widest MLP
    (the estimation term is the trivial 8D at every width)."""
    from transcover.cli import main

    for argv, needle in ((["approx", "sweep", "--over", "R", "--ns", "2.5"], "whole numbers"),
                         (["approx", "sweep", "--over", "R", "--Rs", "1,,2"], "empty item"),
                         (["advise", "--sparsity", "2", "--smoothness", "1", "--seq-len", "16", "--n-samples", "1"],
                          "n_samples must be >= 2")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, needle", [
    (["advise", "--sparsity", "2", "--smoothness", "1", "--seq-len", "64", "--n-samples", "10000", "--gamma", "1e-200"],
     "overflow float64 at gamma=1e-200"),
    (["advise", "--sparsity", "2", "--smoothness", "1", "--seq-len", "64", "--n-samples", "10000",
      "--holder-constant", "1e300"], "overflow float64"),
    (["approx", "construct", "--gamma", "1e-160", "--smoothness", "2"], "gamma=1e-160 is too small"),
])
def test_overflowing_designs_are_one_line(argv, needle, capsys):
    """Red team 163: advise ended in an internal OverflowError at gamma = 1e-200 or a Hölder constant of 1e300, and
    construct blamed R for a head that gamma^-beta overflowed (after a numpy RuntimeWarning)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "internal error" not in err


def test_a_measured_value_above_its_exact_arithmetic_bound_is_explained(capsys):
    """Red team 163: at R = 1e300 the table showed a measured read-out of 1.1e-16 beside a certified 4.9e-324 with no
    word (the exact-arithmetic caveat was in the JSON only); a caption now says why, and only then."""
    assert main(["approx", "construct", "--R", "1e300"]) == 0
    assert "the bounds hold for the network in exact arithmetic" in " ".join(capsys.readouterr().out.split())
    assert main(["approx", "construct", "--seq-len", "6", "--sparsity", "2", "--grid", "3", "--R", "10"]) == 0
    assert "exact arithmetic" not in " ".join(capsys.readouterr().out.split())


def test_a_tight_construction_never_shows_a_lower_bound_above_its_certified_upper(tmp_path):
    """Red team 181: with an equiangular code the read-out bound is exactly tight, and the float64 network's measured
    sup (then labelled an empirical lower bound) came out 5e-9 relative above the certified upper bound, which is for
    exact arithmetic.  The measurements are the float64 network's: labelled estimates, so no two quantities of the JSON
    contradict each other, whatever the rounding."""
    import json

    out = tmp_path / "c.json"
    assert main(["approx", "construct", "--seq-len", "8", "--sparsity", "1", "--R", "40", "--delta", "0.45",
                 "--grid", "4", "--search", "300", "--quiet", "--json", str(out)]) == 0
    d = json.loads(out.read_text())["decomposition"]
    b = d["bound"]
    parts = {"readout": max(b["readout_bound"]), "attention": b["attention"]["value"], "mlp": b["mlp"]["value"],
             "total": b["total"]["value"]}
    for name, upper in parts.items():
        assert d[name]["kind"] == "estimate" and "float64" in d[name]["source"], name
        assert d[name]["value"] <= upper * (1 + 1e-6), name  # tight where the code is: the measurement meets it
    assert d["readout"]["value"] >= 0.5 * parts["readout"]


def test_a_rate_sweep_says_what_it_skipped_and_why_a_fit_is_missing(tmp_path, capsys):
    """Red team 181: ``--over R`` printed an empty fit table and "over 5 points" for 6 asked, dropping a point under
    the float64 floor without a word; with every point under it, the summary line had no points to take a maximum of."""
    import json

    out = tmp_path / "s.json"
    assert main(["approx", "sweep", "--over", "R", "--ns", "8", "--deltas", "0,0.4", "--Rs", "2,10,30",
                 "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "1 point(s) skipped: bound below 1e-11" in text and "n=8 Δ=0 R=30" in text
    assert "no fit where fewer than two radii" in text
    d = json.loads(out.read_text())
    assert len(d["rows"]) + len(d["skipped"]) == 6 and not d["fits"] and len(d["unfitted"]) == 2
    assert main(["approx", "sweep", "--over", "R", "--ns", "8", "--deltas", "0", "--Rs", "100,200"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "no point to measure; 2 point(s) skipped" in text


def test_one_token_needs_no_attention_error_and_no_position_code(tmp_path, capsys):
    """Red team 181: ``advise --seq-len 1`` advised d_p = 192 for one position and charged an attention error of
    about 2 (attention reads the only token with weight 1); ``approx construct --seq-len 0`` blamed the sparsity."""
    import json

    out = tmp_path / "a.json"
    assert main(["advise", "--seq-len", "1", "--sparsity", "1", "--smoothness", "1", "--n-samples", "10000",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["positional_dim"] == 1 and all(c["attention"] == 0.0 for c in d["curve"])
    assert main(["approx", "construct", "--seq-len", "0"]) == 2
    assert "--seq-len must be a positive integer" in capsys.readouterr().err
