"""``transcover bound``: output, JSON, PNG, and one-line errors for bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from transcover.cli import main
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("m") / "ref.safetensors"
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16, head_hidden=(8,))), path)
    return path


def test_bound_prints_json_and_plot(model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal width
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bound", str(model_path), "--eps", "0.1", "--n-samples", "1e6", "1e9", "--seq-len", "16",
               "--json", str(js), "--plot", str(png), "--top", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "log N_inf(eps=0.1" in out and "assumptions" in out and "Theorem G.5" in out
    data = json.loads(js.read_text())
    assert data["with_mlp_head"] is True and math.isfinite(data["ln_log_N"])
    assert [g["n"] for g in data["generalisation"]] == [1e6, 1e9]
    shares = [c["share_of_transformer"] for c in data["transformer"]["contributions"]]
    assert sum(shares) == pytest.approx(1.0, rel=1e-9)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def mathtext_bound(model_path, tmp_path_factory):
    """``bound MODEL --seq-len 16 --plot --json --quiet`` of the model copied to a folder whose name holds mathtext,
    run once: ``test_bound_json_carries_the_whole_class_terms_and_the_head`` ran the same bound of the same weights
    (its own ``--json --quiet`` run, each a ~20 s n-for-gap search and diagnosis), and reads this run's JSON.
    (path of the copy, PNG path, JSON path)."""
    import shutil

    tmp = tmp_path_factory.mktemp("mathtext")
    folder = tmp / "m$\\nosuchcmd{$"
    folder.mkdir()
    path = shutil.copy(model_path, folder / "ref.safetensors")
    js, png = tmp / "b.json", tmp / "b.png"
    assert main(["bound", str(path), "--seq-len", "16", "--plot", str(png), "--json", str(js), "--quiet"]) == 0
    return path, png, js


def test_bound_json_carries_the_whole_class_terms_and_the_head(mathtext_bound):
    """Red team 215: with an MLP head, ``transformer.contributions[].share`` summed to 1 over the Transformer alone
    while the printed table and ``diagnosis.top`` gave shares of the whole class, and the head's terms, log N and C
    were missing from the JSON.  Every ``share`` is now of the whole class; the Transformer's own is named so."""
    # `bound MODEL --seq-len 16 --json --quiet` of model_path's weights (the run of ``mathtext_bound``)
    data = json.loads(mathtext_bound[2].read_text())
    assert data["schema_version"] == "2"
    terms = data["class_terms"]
    assert sum(t["share"] for t in terms) == pytest.approx(1.0, rel=1e-9)
    head = [t for t in terms if t["layer"] == "head"]
    assert head and all(t["log_cost"] > -math.inf for t in head)
    share = {t["name"]: t["share"] for t in terms if t["layer"] != "head"}
    for top in data["diagnosis"]["top"]:
        if top["layer"] != "head":
            assert share[top["matrix"]] == top["share"]
    layers = {d["layer"]: d["share"] for d in data["diagnosis"]["layers"]}
    assert sum(t["share"] for t in head) == pytest.approx(layers["head"], rel=1e-12)
    assert math.isfinite(data["head"]["ln_log_N"]) and math.isfinite(data["head"]["ln_C"])
    assert data["head"]["eps"] == data["eps"] / 2
    assert all("share" not in c for c in data["transformer"]["contributions"])


@pytest.mark.parametrize("argv, needle", [
    (["--eps", "0"], "--eps must be"),
    (["--eps", "-0.1"], "--eps must be"),
    (["--n-samples", "0"], "--n-samples must be"),
    (["--n-samples", "1.5"], "--n-samples must be whole numbers"),  # the cover used round(nT) points (37j)
    (["--seq-len", "0"], "--seq-len must be"),
    (["--radius", "-1"], "--radius must be"),
    (["--delta", "1.5"], "--delta must be"),
    (["--plot", "x.jpg"], "must end in .png"),
    (["--norm-grid", "-1"], "--norm-grid must be in"),
    (["--norm-grid", str(10**30)], "--norm-grid must be in"),
    (["--target-gap", "inf"], "--target-gap must be a finite number"),  # not the API's "target_gap" (red team 198)
    (["--sigma-min", "inf"], "--sigma-min must be a finite number"),
    # red team 205: a subnormal eps / 2 rounded up (3 x 2^-1074 certified at 4 x 2^-1074's log N), and n T = inf was
    # an internal error (exit 1)
    (["--eps", "5e-324"], "--eps must be >= 4.45"),
    (["--eps", str(3 * 2.0**-1074)], "--eps must be >= 4.45"),
    (["--n-samples", "1e307"], "--n-samples must be <= 1e+300"),
])
def test_bad_arguments_one_line_exit_2(model_path, tmp_path, capsys, argv, needle):
    js = tmp_path / "never.json"
    rc = main(["bound", str(model_path), "--json", str(js), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1 and err.startswith("transcover: error:")
    assert not js.exists()


def test_missing_file(tmp_path, capsys):
    rc = main(["bound", str(tmp_path / "nope.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("transcover: error:") and err.count("\n") == 1


@pytest.mark.parametrize("family, has_leading", [("l21", True), ("spectral", False)])
def test_bound_names_the_g5_leading_term_only_where_an_f2_cover_makes_one(model_path, capsys, monkeypatch,
                                                                          family, has_leading):
    # with parameter-count covers only, Theorem G.5's 4C^2(eta+eta~)^3/eps^2 term does not exist (printed as "= 0")
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["bound", str(model_path), "--family", family, "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert ("4C^2(eta+eta~)^3/eps^2 = " in out) is has_leading
    assert ("no 4C^2(eta+eta~)^3/eps^2 term" in out) is not has_leading


@pytest.fixture(scope="module")
def narrow_tables(model_path, tmp_path_factory):
    """One ``bound --family best --eps 0.05 --top 40 --json`` run whose tables the CLI prints at COLUMNS=60 and again
    at COLUMNS=80 (its own render call, repeated with the same arguments: the two widths' runs computed the same
    bound twice, only the printing depends on the width): ({columns: stdout}, JSON path)."""
    import contextlib
    import io

    import transcover.report as report

    js = tmp_path_factory.mktemp("narrow") / "b.json"
    outs = {}
    render = report.render_bound

    def at_each_width(*args, **kwargs):
        for columns in ("60", "80"):
            buf = io.StringIO()
            with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(buf):
                mp.setenv("COLUMNS", columns)
                render(*args, **kwargs)
            outs[columns] = buf.getvalue()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "render_bound", at_each_width)
        assert main(["bound", str(model_path), "--family", "best", "--eps", "0.05", "--seq-len", "16", "--top", "40",
                     "--json", str(js)]) == 0
    assert set(outs) == {"60", "80"}  # the CLI printed through render_bound
    return outs, js


@pytest.mark.parametrize("columns", ["60", "80"])
def test_bound_table_never_crops_a_number(narrow_tables, columns):
    # rich cropped no_wrap cells to the terminal: eps_i = 7.135e-21 was printed as "7.135e-2" at 80 columns
    from transcover.report._bound_tables import fmt_log

    outs, js = narrow_tables
    out = outs[columns]  # `bound MODEL --family best --eps 0.05 --seq-len 16 --top 40 --json` at COLUMNS=columns
    table = out[out.index("largest 40 contributions"):]
    rows = json.loads(js.read_text())["transformer"]["contributions"]
    assert len(rows) >= 10
    for c in rows:
        eps_i, cost = fmt_log(float(c["log_eps_i"]), "near"), fmt_log(float(c["log_cost"]))  # eps_i is chosen
        assert f" {eps_i} " in table and f" {cost} " in table, (c["name"], eps_i, cost)


def test_the_final_norms_share_is_named(tmp_path, capsys, monkeypatch):
    """Red team 185: the share table and the "why vacuous" line listed a 2-layer Llama's final norm as a layer "2";
    it is "out (final norm)", as ``perturb`` names it."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("COLUMNS", "200")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=24, vocab_size=32, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m", safe_serialization=True)
    capsys.readouterr()
    js = tmp_path / "b.json"
    assert main(["bound", str(tmp_path / "m"), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert 2 in {c["layer"] for c in json.loads(js.read_text())["transformer"]["contributions"]}
    assert "out (final norm)" in out and "│                2 │" not in out and ", 2: " not in out
    assert "│          1 (trivial) │" in out  # the trivial gap bound is b = 1 exactly (it printed 1.001; 188)


def test_bound_plot_of_a_model_path_holding_mathtext(mathtext_bound):
    """Red team 215: ``bound --plot`` put the model's path into the figure's title as mathtext: a path holding
    "$\\nosuchcmd{$" was an internal error (exit 1, neither the PNG nor the JSON written)."""
    path, png, js = mathtext_bound  # bound PATH --seq-len 16 --plot PNG --json JS --quiet: exit 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and json.loads(js.read_text())["model"] == str(path)


def test_bound_prints_the_sample_size_exactly(model_path, capsys, monkeypatch):
    """Red team 215: n = 110384404 was printed as 1.1e+08 (``%.3g``) beside a gap certified at the exact n."""
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["bound", str(model_path), "--n-samples", "110384404", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "n=110,384,404 x T=16" in out and "│ 110,384,404 │" in out and "1.1e+08" not in out


def test_trivial_values_are_printed_as_they_are(model_path, capsys, monkeypatch):
    """Red team 215: the BFT-baseline column printed its trivial gap b = 1 from its log, as 1.001 (red team 188 fixed
    only the reported gap's column), and the trivial Rademacher term 4b as 4.001."""
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["bound", str(model_path), "--n-samples", "10", "--seq-len", "16"]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("│") and " 10 │" in ln][0]
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[1] == "1 (trivial)" and cells[3] == "4 (trivial 4b)" and cells[5].startswith("1 (vacuous, raw ")
