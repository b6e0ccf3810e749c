"""Config objects (issue 11): the API's and the CLI's defaults are the same fields, in one place."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from transcover import InputError
from transcover.cli import build_parser
from transcover.covering import BoundConfig, model_bound, model_terms
from transcover.lipschitz import LipschitzConfig, PerturbConfig
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec


def _sub(name: str):
    parser, _ = build_parser()
    action = next(a for a in parser._subparsers._group_actions if a.choices)  # argparse has no public getter
    return action.choices[name]


def test_bound_cli_defaults_and_help_are_read_from_boundconfig():
    p, d = _sub("bound"), BoundConfig()
    args = p.parse_args([])
    for field in ("eps", "radius", "c_sm", "family", "sigma_min", "loss_lipschitz", "loss_bound", "delta"):
        assert getattr(args, field) == getattr(d, field)
    text = " ".join(p.format_help().split())
    assert f"covering scale eps (default: {d.eps})" in text and f"failure probability (default: {d.delta})" in text
    assert f"default {d.n_samples[0]:g};" in text and f"default {d.seq_len};" in text  # resolved after loading


@pytest.mark.parametrize("name", ["lipschitz", "perturb"])
def test_lipschitz_and_perturb_cli_defaults_are_read_from_their_config(name):
    argv = [] if name == "lipschitz" else ["a", "b"]
    args = _sub(name).parse_args(argv)
    d = LipschitzConfig() if name == "lipschitz" else PerturbConfig()
    assert (args.radius, args.metric, args.c_sm, args.ln_sigma_min, args.samples, args.steps,
            args.seed) == (d.radius, d.metric, d.c_sm, d.sigma_min, d.samples, d.steps, d.seed)
    # T is resolved against the model (the config's default, or the model's longest sequence if shorter): unset here,
    # and the help names the config's default
    assert args.seq_len is None and f"default {d.seq_len}," in " ".join(_sub(name).format_help().split())


def test_config_keywords_and_measured_terms_give_the_same_bound():
    torch.manual_seed(0)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16,
                                                               head_hidden=())))
    cfg = BoundConfig(eps=0.2, n_samples=(1e4, 1e6), seq_len=16, radius=1.5, family="l21")
    by_config = model_bound(spec, cfg)
    by_keywords = model_bound(spec, eps=0.2, n_samples=(1e4, 1e6), seq_len=16, radius=1.5, family="l21")
    reused = model_bound(spec, cfg, terms=model_terms(spec, radius=1.5))
    assert by_config.to_dict() == by_keywords.to_dict() == reused.to_dict()
    assert model_bound(spec).to_dict() == model_bound(spec, BoundConfig()).to_dict()
    with pytest.raises(TypeError, match="unexpected"):
        model_bound(spec, epsilon=0.1)
    with pytest.raises(InputError, match="eps must be"):
        model_bound(spec, dataclasses.replace(cfg, eps=0.0))
