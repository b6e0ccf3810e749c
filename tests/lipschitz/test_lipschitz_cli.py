"""The ``lipschitz`` and ``perturb`` commands on saved reference models: tables, JSON, bad input."""

import json

import pytest
import torch

import lipschitz_testkit  # noqa: F401  (thread setting)
from transcover.cli import main
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    cfg = ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16)
    m = ReferenceTransformer(cfg)
    save_reference(m, d / "a.safetensors")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_reference(m, d / "b.safetensors")
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=3, d_ff=16)), d / "c.safetensors")
    return d


FAST = ["--samples", "2", "--steps", "5", "--seq-len", "3"]


def test_lipschitz_command_prints_table_and_writes_json(models, tmp_path, capsys):
    out = tmp_path / "l.json"
    assert main(["lipschitz", str(models / "a.safetensors"), "--radius", "2", *FAST, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "certified" in text and "empirical" in text and "whole" in text
    data = json.loads(out.read_text())
    rows = data["table"]
    assert {r["component"] for r in rows} >= {"attention", "ffn", "layer", "network"}
    for r in rows:
        assert r["lower"] is None or r["lower"] <= r["upper"]
    assert data["bounds"]["upper"]["kind"] == "certified upper bound"
    assert data["lower"][0]["value"]["kind"] == "empirical lower bound"


def test_perturb_command(models, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["perturb", str(models / "a.safetensors"), str(models / "b.safetensors"), *FAST,
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Lemma G.3" in text and "W_OV.0" in text
    data = json.loads(out.read_text())
    assert 0 < data["lower"]["value"]["value"] <= data["bound"]["total"]["value"]


@pytest.mark.parametrize("argv, match", [
    (["lipschitz", "{a}", "--radius", "0"], "--radius"),
    (["lipschitz", "{a}", "--radius", "-1"], "--radius"),
    (["lipschitz", "{a}", "--samples", "0"], "--samples"),
    (["lipschitz", "{a}", "--sigma-min", "-1"], "--sigma-min"),
    (["lipschitz", "/nonexistent/model.safetensors"], "not found"),
    (["perturb", "{a}", "{c}"], "differ in depth: 2 layers vs 3"),
    (["perturb", "{a}", "/nonexistent/b.safetensors"], "not found"),
])
def test_bad_input_is_one_line_and_exit_2(models, tmp_path, capsys, argv, match):
    out = tmp_path / "never.json"
    argv = [x.format(a=models / "a.safetensors", c=models / "c.safetensors") for x in argv]
    assert main([argv[0], *FAST, *argv[1:], "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("transcover: error:") and match in err and "\n" not in err
    assert not out.exists()


def test_perturb_plot_draws_the_bound_per_layer_and_the_measured_change(models, tmp_path, capsys):
    """``perturb --plot``: PerturbationDisplay (display style) written atomically as PNG; the API's
    ``PerturbationBound.plot`` returns the display with its figure."""
    out = tmp_path / "p.png"
    assert main(["perturb", str(models / "a.safetensors"), str(models / "b.safetensors"), *FAST,
                 "--quiet", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from transcover.lipschitz import perturbation_bound
    from transcover.model import load

    bound = perturbation_bound(load(str(models / "a.safetensors")), load(str(models / "b.safetensors")))
    disp = bound.plot(lower=0.5 * bound.total.value, n_layers=2)
    assert disp.figure_ is not None and len(disp.ax_) == 2
    assert disp.total == bound.total.value and sum(disp.contributions) > 0
    assert main(["perturb", str(models / "a.safetensors"), str(models / "b.safetensors"), *FAST,
                 "--plot", str(tmp_path / "p.txt")]) == 2  # refused before computing


def test_perturb_names_embedding_tables_it_does_not_bound(tmp_path, capsys):
    """Stop 38 red team: two models that differ only in their embedding tables were reported as "0, no change"
    without a word (the bound is for g, after the embedding)."""
    from transcover.scale._synthetic import write_gpt2_checkpoint
    from safetensors.numpy import load_file, save_file

    a = write_gpt2_checkpoint(tmp_path / "a", d=16, layers=1, heads=2, vocab=32, positions=8, seed=1)
    b = write_gpt2_checkpoint(tmp_path / "b", d=16, layers=1, heads=2, vocab=32, positions=8, seed=1)
    t = load_file(b / "model.safetensors")
    t["wte.weight"] = t["wte.weight"] * 2
    save_file(t, b / "model.safetensors")
    out = tmp_path / "p.json"
    assert main(["perturb", str(a), str(b), *FAST, "--json", str(out)]) == 0
    assert "embedding tables differ (token_embedding)" in capsys.readouterr().err
    assert any("embedding tables differ" in w for w in json.loads(out.read_text())["warnings"])


def test_an_empty_sigma_domain_is_named_and_a_huge_radius_is_no_crash(tmp_path):
    """Stop 38 red team: --sigma-min above what inputs of the radius can have (std <= r/sqrt(d)) certified 2.2e11
    over an empty domain without a word; --radius 1e300 ended in OverflowError (34) from R**3."""
    from transcover.lipschitz import lipschitz_bounds
    from transcover.model import load
    from transcover.scale._synthetic import write_gpt2_checkpoint

    spec = load(write_gpt2_checkpoint(tmp_path / "g", d=16, layers=1, heads=2, vocab=32, positions=8)).to_torch()
    empty = lipschitz_bounds(spec, radius=1.0, sigma_min=0.5)  # std <= 1/4 at the first norm
    assert any(a.startswith("EMPTY DOMAIN") for a in empty.upper.assumptions)
    fine = lipschitz_bounds(spec, radius=1.0, sigma_min=0.1)
    assert not any(a.startswith("EMPTY DOMAIN") for a in fine.upper.assumptions)
    huge = lipschitz_bounds(spec, radius=1e300)  # pre-norm: the norms bound every branch's input, R only the first
    assert huge.upper.value >= lipschitz_bounds(spec, radius=1.0).upper.value


def test_an_empty_sigma_domain_has_no_empirical_lower(tmp_path):
    """Red team 218: `lipschitz bert --radius 1 --sigma-min 0.5` (d = 64: std >= 0.5 needs norm >= 4) said EMPTY DOMAIN
    beside the upper and still printed an empirical lower 1.99999999799602 for input_norm, from witnesses the
    variance floor had stretched out of the radius.  A stage with an empty domain has no witness: no lower for it, its
    layer or the network; the other stages keep theirs, every witness inside the ball and above the floor."""
    from transcover.lipschitz import lipschitz_bounds, lipschitz_lower
    from transcover.lipschitz._empirical import _lower, _sigma_floor_projection, stage_functions
    from transcover.model import load
    from transcover.scale._synthetic import write_gpt2_checkpoint

    spec = load(write_gpt2_checkpoint(tmp_path / "g", d=16, layers=1, heads=2, vocab=32, positions=8)).to_torch()
    bounds = lipschitz_bounds(spec, radius=1.0, sigma_min=0.5)  # std <= 1/4 at the first norm
    low = lipschitz_lower(spec, bounds, seq_len=3, n_samples=2, n_steps=3)
    assert (0, "attention") not in low and (0, "layer") not in low and (-2, "network") not in low
    # a non-empty floor: the projection lands in both sets, and a witness outside the ball does not count
    R, sig, d = 5.0, 0.6, 64
    Z = torch.randn(3, 4, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    P = _sigma_floor_projection(sig, R)(Z / Z.norm(dim=-1, keepdim=True) * R + 3.0)  # a large mean: norm > R
    assert float(P.norm(dim=-1).max()) <= R and float(P.std(-1, unbiased=False).min()) >= sig
    fn = stage_functions(load(write_gpt2_checkpoint(tmp_path / "h", d=d, layers=1, heads=2, vocab=32,
                                                    positions=8)).to_torch())[(1, "final_norm")]
    out = lambda X: 2 * X  # noqa: E731  (every row leaves the ball of radius R)
    assert _lower(fn, T=4, d=d, radius=R, metric="2,inf", sigma_min=sig, n_samples=2, n_steps=3, seed=0,
                  project_extra=out) == 0.0
