"""The public API mirrors the CLI: same numbers from ``transcover.X(...)`` as from ``transcover X --json``.

Each API function runs on a tiny model beside its command (in this process, same options), and
every key of the API result's ``to_dict()`` must equal the command's JSON payload exactly (after
the same strict-JSON conversion the envelope applies; run times dropped).  ``lipschitz``,
``approx`` and ``train`` are subpackages as well as functions: both spellings are checked.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import transcover
from transcover.cli import main
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference
from transcover.report import envelope_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bound_memo import model_bound_once  # noqa: E402

_ENVELOPE = ("schema", "schema_version", "tool", "tool_version", "command_line", "inputs")
_VOLATILE = ("elapsed", "seconds", "wall", "time_s", "duration")


@pytest.fixture(scope="module", autouse=True)
def _bounds_once():
    """An API call and its command on the same model and options compute one ``model_bound`` (``bound``, and the
    final bound of ``train``'s identical runs): memoised on the exact spec and BoundConfig (tests/bound_memo.py), so
    each is computed once; a command that read another spec or option would miss and compute its own.  No test of
    this file patches anything the bound reads."""
    with model_bound_once() as memo:
        yield memo


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    cfg = ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16, head_hidden=(8,))
    torch.manual_seed(0)
    save_reference(ReferenceTransformer(cfg), d / "a.safetensors")
    torch.manual_seed(1)
    save_reference(ReferenceTransformer(cfg), d / "b.safetensors")
    torch.manual_seed(2)  # one small layer: the Lipschitz lower search runs per stage
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=8, head_hidden=(4,))),
                   d / "one.safetensors")
    torch.manual_seed(3)  # LayerNorm: the local (at-the-data) route's Jacobians cover it, not Pi_norm
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=8, head_hidden=(4,),
                                                        norm="layernorm")), d / "ln.safetensors")
    np.save(d / "points.npy", np.random.default_rng(0).standard_normal((30, 5, 2)))
    return d


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if not any(s in k for s in _VOLATILE)}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _cli_json(tmp_path, argv: list[str]) -> dict:
    out = tmp_path / "cli.json"
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    return _clean({k: v for k, v in data.items() if k not in _ENVELOPE})


def _same(result, cli: dict) -> None:
    """Every key the API result reports equals the command's payload, bit for bit."""
    api = _clean(json.loads(envelope_json(result.to_dict(), schema="x", schema_version="1")))
    api = {k: v for k, v in api.items() if k not in _ENVELOPE}
    assert api, "the API result reports nothing"
    missing = sorted(set(api) - set(cli))
    assert not missing, f"keys the command does not write: {missing}"
    for key, value in api.items():
        assert value == cli[key], f"{key!r} differs between the API and the CLI"


def test_analyze(models, tmp_path):
    path = str(models / "a.safetensors")
    _same(transcover.analyze(path), _cli_json(tmp_path, ["analyze", path, "--quiet"]))


def test_lipschitz(models, tmp_path):
    path = str(models / "one.safetensors")
    r = transcover.lipschitz(path, samples=1, steps=2, seed=3, radius=2.0)
    assert r.lower and r.upper.kind.value == "certified upper bound"
    _same(r, _cli_json(tmp_path, ["lipschitz", path, "--samples", "1", "--steps", "2", "--seed", "3",
                                  "--radius", "2", "--quiet"]))


def test_lipschitz_at_the_data(models, tmp_path):
    path, data = str(models / "ln.safetensors"), models / "emb.npy"
    np.save(data, np.random.default_rng(1).standard_normal((2, 3, 4)))
    r = transcover.lipschitz(path, data=str(data), rho=[1e-3, 1e-2], rho_relative=True, steps=2)
    assert r.rows and all(row.local_upper >= row.lower for row in r.rows if row.lower is not None)
    _same(r, _cli_json(tmp_path, ["lipschitz", path, "--data", str(data), "--rho", "1e-3,1e-2", "--rho-relative",
                                  "--steps", "2", "--quiet"]))


def test_lipschitz_at_the_data_reads_any_real_rho_and_refuses_the_rest(models):
    """Red team 216: a numpy scalar or 0-d tensor rho was "not iterable", "0.001" was read character by character,
    ``[]`` gave an empty table and ``True`` was rho 1.0; ``limit=1.5`` failed in a slice.  Any real number (or a
    non-empty sequence of them) is a radius; the rest is refused in one line."""
    path, data = str(models / "ln.safetensors"), models / "emb216.npy"
    np.save(data, np.random.default_rng(1).standard_normal((2, 3, 4)))
    want = transcover.lipschitz(path, data=str(data), rho=1e-3, lower=False).rows
    for rho in (np.float64(1e-3), torch.tensor(1e-3, dtype=torch.float64), [1e-3], np.array([1e-3])):
        assert transcover.lipschitz(path, data=str(data), rho=rho, lower=False).rows == want, rho
    for bad, needle in (("0.001", "rho must be a number > 0 or a non-empty sequence"), ([], "non-empty"),
                        (True, "rho must be a finite number > 0"), ([1e-3, "x"], "rho must be a finite number")):
        with pytest.raises(transcover.InputError, match=needle) as e:
            transcover.lipschitz(path, data=str(data), rho=bad, lower=False)
        assert "\n" not in str(e.value)
    for bad in (1.5, True, 0):
        with pytest.raises(transcover.InputError, match=r"limit must be a positive integer, but got limit="):
            transcover.lipschitz(path, data=str(data), rho=1e-3, limit=bad, lower=False)


def test_lipschitz_at_the_data_in_memory_is_the_npy(models):
    """Red team 216: ``data=`` a numpy array failed in an elementwise comparison, a list in pathlib.  An array in
    memory (numpy, torch, nested lists) is read exactly as the same array saved as a .npy, every check included."""
    path, data = str(models / "ln.safetensors"), models / "emb216m.npy"
    arr = np.random.default_rng(2).standard_normal((3, 3, 4))
    np.save(data, arr)
    want = transcover.lipschitz(path, data=str(data), rho=1e-3, limit=2, lower=False)
    for given in (arr, torch.from_numpy(arr), arr.tolist()):
        got = transcover.lipschitz(path, data=given, rho=1e-3, limit=2, lower=False)
        assert got.rows == want.rows and got.n_sequences == want.n_sequences == 2, type(given)
    for bad, needle in ((np.zeros((2, 3, 7)), "shape"), ([[1.0, 2.0], [3.0]], "different lengths"),
                        (object(), "data must be a path")):
        with pytest.raises(transcover.InputError, match=needle):
            transcover.lipschitz(path, data=bad, rho=1e-3, lower=False)


def test_perturb(models, tmp_path):
    a, b = str(models / "a.safetensors"), str(models / "b.safetensors")
    r = transcover.perturb(a, b, samples=1, steps=2)
    assert r.bound.total.value >= r.lower.value.value > 0
    _same(r, _cli_json(tmp_path, ["perturb", a, b, "--samples", "1", "--steps", "2", "--quiet"]))


def test_bound(models, tmp_path):
    a, b = str(models / "a.safetensors"), str(models / "b.safetensors")
    r = transcover.bound(a, eps=0.2, n_samples=[1e5, 1e7], seq_len=16, reference=b, family="l21")
    _same(r, _cli_json(tmp_path, ["bound", a, "--eps", "0.2", "--n-samples", "1e5", "1e7", "--seq-len", "16",
                                  "--reference", b, "--family", "l21", "--quiet"]))


def test_config_objects_and_options_are_one_thing(models):
    """The CLI's defaults live in the config dataclasses: a config and the same fields as options agree."""
    from transcover.covering import BoundConfig
    from transcover.lipschitz import LipschitzConfig

    a = str(models / "a.safetensors")
    cfg = BoundConfig(eps=0.3, n_samples=(1e4,), seq_len=8, family="l21")
    assert transcover.bound(a, cfg).to_dict() == transcover.bound(a, eps=0.3, n_samples=1e4, seq_len=8,
                                                                   family="l21").to_dict()
    one = str(models / "one.safetensors")
    r = transcover.lipschitz(one, LipschitzConfig(radius=3.0), lower=False)
    assert r.bounds.to_dict() == transcover.lipschitz(one, radius=3.0, lower=False).bounds.to_dict()
    with pytest.raises(transcover.InputError, match="no option epz"):
        transcover.bound(a, epz=0.1)
    with pytest.raises(transcover.InputError, match="config must be a LipschitzConfig"):
        transcover.lipschitz(one, cfg)


@pytest.mark.parametrize("mode, api, argv", [
    ("finite", dict(eps=[0.5, 1.0]), ["--eps", "0.5", "1.0"]),
    ("reference", dict(functions=12, samples=3, seq_len=2, layers=1, d_model=4, heads=1, d_ff=8, eps=[0.2, 0.5],
                       radii={"B_V": 0.5}),
     ["--functions", "12", "--samples", "3", "--seq-len", "2", "--layers", "1", "--d-model", "4", "--heads", "1",
      "--d-ff", "8", "--eps", "0.2", "0.5", "--B_V", "0.5"]),
    ("uniform", dict(functions=10, n=2, restarts=1, pool=4, seq_len=2, layers=1, d_model=4, heads=1, d_ff=8,
                     eps=[0.1]),
     ["--functions", "10", "--n", "2", "--restarts", "1", "--pool", "4", "--seq-len", "2", "--layers", "1",
      "--d-model", "4", "--heads", "1", "--d-ff", "8", "--eps", "0.1"]),
    ("local", dict(functions=8, samples=2, seq_len=2, eps=[0.01]),
     ["--functions", "8", "--samples", "2", "--seq-len", "2", "--eps", "0.01"]),
])
def test_cover(models, tmp_path, mode, api, argv):
    source = {"finite": str(models / "points.npy"), "local": str(models / "a.safetensors")}.get(mode)
    r = transcover.cover(source, mode=mode, **api)
    cli = _cli_json(tmp_path, ["cover", mode, *([source] if source else []), *argv, "--quiet"])
    _same(r, cli)


def test_cover_takes_an_array_too(models):
    Y = np.load(models / "points.npy")
    a = transcover.cover(Y, eps=[0.5]).to_dict()
    b = transcover.cover(str(models / "points.npy"), eps=[0.5]).to_dict()
    assert a["rows"] == b["rows"] and a["file"] == "<array (30, 5, 2)>"


def test_approx_construct(tmp_path):
    r = transcover.approx(seq_len=6, sparsity=1, grid=3, search=20, pos_dim=8)
    _same(r, _cli_json(tmp_path, ["approx", "construct", "--seq-len", "6", "--sparsity", "1", "--grid", "3",
                                  "--search", "20", "--pos-dim", "8", "--quiet"]))


def test_approx_construct_config_names_the_parameters_only(tmp_path):
    """Regression (issue 11): the JSON ``config`` held --json's own path, the CLI's bookkeeping
    (command, debug, quiet) and ``"<transcover.report._progress.Tracker object at 0x...>"``."""
    cli = _cli_json(tmp_path, ["approx", "construct", "--seq-len", "6", "--sparsity", "1", "--grid", "3",
                               "--search", "20", "--pos-dim", "8", "--quiet"])
    config = cli["config"]
    assert not {"json", "plot", "save", "quiet", "tracker", "debug", "command", "approx_command"} & set(config)
    assert all(not isinstance(v, str) or " object at 0x" not in v for v in config.values())
    assert config["seq_len"] == 6 and config["search"] == 20 and config["R"] == 20.0


def test_approx_encodings(tmp_path):
    r = transcover.approx("encodings", kind="random", n=16, dim=32, delta=0.3)
    _same(r, _cli_json(tmp_path, ["approx", "encodings", "--kind", "random", "--n", "16", "--dim", "32",
                                  "--delta", "0.3", "--quiet"]))


def test_advise(tmp_path):
    r = transcover.advise(2, 1.0, 16, 10_000, delta=0.2)
    _same(r, _cli_json(tmp_path, ["advise", "--sparsity", "2", "--smoothness", "1", "--seq-len", "16",
                                  "--n-samples", "10000", "--delta", "0.2"]))


def test_train(tmp_path):
    fields = dict(task="majority", sparsity=3, seq_len=8, epochs=1, n_train=32, n_test=16, d_model=8, n_heads=2,
                  n_layers=1, d_ff=16, batch_size=16)
    r = transcover.train(**fields, method="project", radii="KQ=1,W1=1.5")
    cli = _cli_json(tmp_path, ["train", "--task", "majority", "--sparsity", "3", "--seq-len", "8", "--epochs", "1",
                               "--n-train", "32", "--n-test", "16", "--d-model", "8", "--n-heads", "2",
                               "--n-layers", "1", "--d-ff", "16", "--batch-size", "16", "--method", "project",
                               "--radius", "KQ=1", "--radius", "W1=1.5", "--out", str(tmp_path / "run"),
                               "--quiet"])
    _same(r, cli)
    assert (tmp_path / "run" / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_refuses_unknown_options():
    with pytest.raises(transcover.InputError, match="no option"):
        transcover.train(task="majority", epochz=1)


@pytest.mark.parametrize("name, member", [("lipschitz", "lipschitz_bounds"), ("approx", "make_encoding"),
                                          ("train", "TrainConfig")])
def test_callable_subpackages_keep_both_spellings(name, member):
    module = importlib.import_module(f"transcover.{name}")
    assert getattr(transcover, name) is module  # the attribute is the module, not a function over it
    assert callable(module) and hasattr(module, member)
    exec(f"import transcover.{name} as m\nassert m is module and hasattr(m, {member!r})", {"module": module})
    assert module.__name__ == f"transcover.{name}" and module.__doc__
    from transcover import _api

    assert getattr(_api, name).__doc__ and "Example" in getattr(_api, name).__doc__


def test_calling_the_subpackage_calls_the_api():
    """``transcover.approx(...)`` is ``transcover._api.approx(...)``: same result, same errors."""
    a = transcover.approx("encodings", kind="random", n=8, dim=16, delta=0.3, seed=2)
    b = transcover._api.approx("encodings", kind="random", n=8, dim=16, delta=0.3, seed=2)
    assert a.to_dict() == b.to_dict()
    with pytest.raises(transcover.InputError, match="what must be"):
        transcover.approx("nothing")


def test_every_api_function_is_exported_and_documented():
    for name in ("analyze", "lipschitz", "perturb", "bound", "cover", "approx", "advise", "train"):
        assert name in transcover.__all__
        fn = getattr(transcover._api, name)
        assert fn.__doc__ and "Example" in fn.__doc__, f"transcover.{name} needs a docstring with an example"
        assert callable(getattr(transcover, name))


def test_import_stays_light_and_python_m_works():
    """``import transcover`` loads neither torch nor matplotlib; ``python -m transcover`` is the CLI."""
    code = "import sys, transcover; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    run = subprocess.run([sys.executable, "-m", "transcover", "--version"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == f"transcover {transcover.__version__}"


def test_result_views_come_from_report_without_an_upward_import():
    """``AnalysisResult.plot``/``repr``/DataFrames are report's views, found through the registry."""
    from transcover._views import registered_views

    names = set(registered_views())
    assert {"analysis.plot", "analysis.repr", "analysis.repr_html", "analysis.matrices_dataframe",
            "analysis.layers_dataframe", "lipschitz.plot", "perturbation.plot", "bound.plot"} <= names


def test_an_estimate_is_printed_with_approx_not_as_an_upper_bound(models):
    """Red team 210: ``analyze(model, fast=True)``'s repr read ``B_KQ≤0.06035`` for a Lanczos estimate."""
    a = models / "a.safetensors"
    fast, certified = repr(transcover.analyze(a, fast=True)), repr(transcover.analyze(a))
    assert "B_KQ≈" in fast and "≤" not in fast
    assert "B_KQ≤" in certified and "≈" not in certified


def test_to_dict_keeps_infinite_floats_and_the_envelope_writes_strings():
    """``to_dict`` is Python floats (inf included, for computing); ``--json`` files are strict JSON (red team 210:
    the envelope's docstring said the payloads already sanitised)."""
    from transcover._results import Interval
    from transcover.report._envelope import _safe

    d = Interval(0.0, float("inf")).to_dict()
    assert d["upper"] == float("inf")
    doc = json.loads(envelope_json({"upper": d["upper"]}, schema="x", schema_version="1"))
    assert doc["upper"] == "inf"
    assert "already" not in _safe.__doc__ and "to_dict" in _safe.__doc__


def test_the_bound_examples_last_line_gives_what_it_shows():
    """Red team 215: ``transcover.bound``'s example read ``b.generalisation[0].bound.kind.value``, an AttributeError
    (the examples are skipped by doctest: loading the bundled model is slow).  Its lines run here on a small model."""
    import torch

    from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec

    lines = [ln.strip() for ln in transcover._api.bound.__doc__.splitlines()]
    last = max(i for i, ln in enumerate(lines) if ln.startswith(">>>"))
    expression, shown = lines[last][3:].split("#")[0].strip(), lines[last + 1]
    assert expression.startswith("b.")
    torch.manual_seed(0)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8)))
    b = transcover.bound(spec, eps=0.1, n_samples=[1e6], seq_len=4)
    assert repr(eval(expression, {"b": b})) == shown
