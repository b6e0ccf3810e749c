"""Red team 191: the Monte-Carlo covering estimators (THEORY F109).

Forward errors against the lower bounds' separation, whole sequences as the uniform search's candidates, and
one-line refusals of options that were internal errors or silently did nothing.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from transcover.cli import main
from transcover.empirical import (
    FORWARD_PAD_ASSUMPTION,
    NormRadii,
    covering_of_outputs,
    forward_pad,
    greedy_net,
    maximal_packing,
    random_inputs,
    sample_reference_class,
    uniform_covering_search,
)
from transcover.model import ReferenceConfig

RED_TEAM_EPS = [0.027935189174186907, 0.055870378348373814]  # 2 * the first is the second, exactly


def test_red_team_pair_within_the_forward_margin_is_not_separated(tmp_path):
    """Seed 3, two members: the float64 outputs are 0.05587037834837381942 apart, above 2 eps = 0.05587037834837381422,
    but the exact outputs (60-digit forward) are 0.05587037834837378700 apart: not a 2eps-packing of the class."""
    out = tmp_path / "pk.json"
    assert main(["cover", "reference", "--functions", "2", "--samples", "4", "--seq-len", "4", "--seed", "3",
                 "--eps", *map(repr, RED_TEAM_EPS), "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["packing_sizes"] == [1]  # the strict 2eps-packing at eps: one member, not two
    assert rows[1]["net_sizes"] == [1]  # the net's centres at 2 eps follow the same rule
    for row in rows:
        for key in ("log_N_ext_lower", "log_P_lower", "log_N_estimate"):
            assert FORWARD_PAD_ASSUMPTION in row[key]["assumptions"]


def test_the_margin_decides_a_pair_just_beyond_two_eps():
    eps = 0.5
    Y = torch.tensor([[[0.0]], [[1.0 + 2.0**-52]]], dtype=torch.float64)  # distance 2 eps (1 + 2.2e-16)
    assert len(maximal_packing(Y, eps)) == 2  # the stored floats are strictly 2eps-separated
    pad = forward_pad(Y, math.inf)
    assert pad == pytest.approx(2e-12 * (1.0 + 2.0**-52), rel=1e-15) and pad >= 2e-12 * (1.0 + 2.0**-52)
    assert len(maximal_packing(Y, eps, pad=pad)) == 1
    assert len(greedy_net(Y, 2 * eps, pad=pad)) == 1  # the net's centre separation: the same rule
    mc = covering_of_outputs(Y, [eps, 2 * eps], checkpoints=[2])  # the Monte-Carlo engine pads by default
    assert mc.packing_sizes[0] == (1,) and mc.net_sizes[1] == (1,)
    assert FORWARD_PAD_ASSUMPTION in mc.log_covering_lower(0).assumptions
    exact = covering_of_outputs(Y, [eps, 2 * eps], checkpoints=[2], rel_pad=0.0)  # outputs taken as exact data
    assert exact.packing_sizes[0] == (2,) and exact.net_sizes[1] == (2,)
    assert FORWARD_PAD_ASSUMPTION not in exact.log_covering_lower(0).assumptions


@pytest.mark.parametrize("q,b,w", [(math.inf, 3, 1), (2.0, 1, 1), (2.0, 3, 2), (1.0, 3, 3)])
def test_the_margin_covers_both_members_in_the_metric(q, b, w):
    Y = torch.zeros(2, 2, b, dtype=torch.float64)
    Y[1, 0, 0] = -4.0
    assert forward_pad(Y, q) >= 2 * w * 1e-12 * 4.0
    assert forward_pad(Y, q, 0.0) == 0.0


@pytest.mark.parametrize("eps", [0.2, 0.5])
def test_uniform_search_in_features_mode_keeps_whole_sequences(eps):
    cfg = ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=4, head_hidden=(), n_outputs=1)
    s = sample_reference_class(cfg, NormRadii(), 200, seed=0, output="features")
    res = uniform_covering_search(s, 1, eps, 2, input_sampler=lambda c, sd: random_inputs(c, 4, 4, seed=sd),
                                  restarts=1, pool_size=8, seed=0)
    assert res.best_inputs.shape == (1, 4, 4)
    Y = s.evaluate(res.best_inputs)  # (M, T token rows, d)
    assert len(maximal_packing(Y, eps, 2, pad=res.forward_pad)) == res.best_packing
    assert FORWARD_PAD_ASSUMPTION in res.lower.assumptions


@pytest.mark.parametrize("argv,match", [
    (["cover", "reference", "--head-hidden", "0"], "--head-hidden must be a positive integer"),
    (["cover", "uniform", "--head-hidden", "-3"], "--head-hidden must be a positive integer"),
    (["cover", "reference", "--seed", "99999999999999999999"], "--seed must be an integer between"),
    (["cover", "uniform", "--seed", "99999999999999999999"], "--seed must be an integer between"),
    (["cover", "local", "MODEL", "--seed", "9999999999999999"], "--seed must be an integer between"),
    (["cover", "local", "MODEL", "--perturb", "head=0.1"], "the model has no head to perturb"),
    (["cover", "local", "MODEL", "--perturb", "W_1=.05", "W_1=.1"], "--perturb gives W_1 twice"),
    (["cover", "reference", "--functions", "1000000000000", "--samples", "16"], "lower --functions"),
])
def test_bad_options_are_one_line_exit_2(tmp_path, capsys, argv, match):
    from transcover.scale._synthetic import write_gpt2_checkpoint

    model = str(write_gpt2_checkpoint(tmp_path / "m", d=16, layers=1, heads=2, vocab=32, positions=8, seed=2))
    rc = main([model if a == "MODEL" else a for a in argv] + ["--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("transcover: error: ") and match in err[0]


def test_config_and_api_refuse_what_the_cli_refuses():
    from transcover import InputError
    from transcover.empirical import MAX_SEED, LocalClassSample, sample_local_class
    from transcover.model import ReferenceTransformer, reference_spec

    with pytest.raises(InputError, match="head_hidden widths must be positive integers"):
        ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=4, head_hidden=(0,))
    cfg = ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=4, head_hidden=(), n_outputs=1)
    with pytest.raises(InputError, match="seed must be an integer between"):
        sample_reference_class(cfg, NormRadii(), 1, seed=2**64)
    spec = reference_spec(ReferenceTransformer(cfg))
    with pytest.raises(InputError, match="seed must be an integer between"):
        sample_local_class(spec, {"W_1": 0.1}, 2, seed=MAX_SEED + 1)
    with pytest.raises(InputError, match="seed must be an integer between"):
        LocalClassSample(spec, {"W_1": 0.1}, 2, seed=10**16)
    big = sample_local_class(spec, {"W_1": 0.1}, 3, seed=MAX_SEED)  # the largest seed still draws its members
    assert torch.isfinite(big.evaluate(random_inputs(2, 2, 4))).all()



@pytest.mark.parametrize("k", [-40, 7, 40])
@pytest.mark.parametrize("q", [1, 2, math.inf])
def test_the_margin_is_homogeneous(k, q):
    """F109's margin is relative: scaling the outputs and eps by 2^k (exact) scales the pad by exactly 2^k and leaves
    every net and packing size unchanged."""
    from transcover.empirical import covering_of_outputs

    g = torch.Generator().manual_seed(5)
    Y = torch.randn(300, 3, 4, generator=g, dtype=torch.float64)
    eps = [0.3, 0.7, 1.5]
    a = covering_of_outputs(Y, eps, q)
    s = covering_of_outputs(torch.ldexp(Y, torch.tensor(k)), [math.ldexp(e, k) for e in eps], q)
    assert a.forward_pad > 0 and s.forward_pad == math.ldexp(a.forward_pad, k)
    assert s.net_sizes == a.net_sizes and s.packing_sizes == a.packing_sizes
    assert any(n > 1 for row in a.net_sizes for n in row)
