"""A ``transcover train`` run is a model like any other: every command reads its run or checkpoint
folder, and ``--data`` takes its raw inputs (digits rows) or its own held-out task (``task``).

Before this, ``analyze``, ``lipschitz``, ``report`` and ``perturb`` refused a run ("no model
weights", "cannot tell the architecture"), and the local routes refused its Pi_norm layers.
"""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import transcover
from transcover.cli import main
from transcover.train import TrainConfig, checkpoint_spec, load_data, load_task, train

TINY = TrainConfig(task="digits", n_train=120, epochs=1, batch_size=40, lr=3e-2, d_model=8, n_heads=2,
                   n_layers=1, d_ff=8, head_hidden=(8,))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(TINY, out_dir=out)
    return out


def _flat(spec):
    return {f"{i}.{k}": v for i, layer in enumerate(spec.layers)
            for k, v in (("W_Q", layer.attention.W_Q), ("W_1", layer.ffn.W_1), ("W_2", layer.ffn.W_2))}


def test_load_reads_the_run_and_its_checkpoint_folder_as_the_exported_model(run):
    ref = checkpoint_spec(run / "checkpoint")[0]
    for source in (run, run / "checkpoint", str(run)):
        spec = transcover.load(source)
        assert spec.arch == "reference" and spec.d_model == TINY.d_model
        for k, v in _flat(spec).items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(_flat(ref)[k])), k


@pytest.mark.parametrize("argv", [["analyze"], ["analyze", "--describe"], ["lipschitz", "--no-lower"]])
def test_commands_take_a_run_folder(run, argv, capsys):
    assert main([*argv[:1], str(run), *argv[1:]]) == 0
    assert "error" not in capsys.readouterr().err


def test_raw_inputs_are_embedded_as_the_model_embeds_them(run):
    """The ``(n, T, d_in)`` digits rows give the rows the trained module's own ``embed_inputs`` forms."""
    from transcover.model import inputs_from_array
    from transcover.train import build_model, load_checkpoint

    task = load_task("digits", n_train=TINY.n_train, seed=TINY.seed)
    model = build_model(TINY, task).double()
    from transcover.constrain import constrain

    constrain(model, TINY.constraint)
    load_checkpoint(run / "checkpoint", model)
    spec = transcover.load(run).to_torch(torch.float64)
    raw = task.X_test[:3].double()
    got = inputs_from_array(spec, raw.numpy())
    want = model.double().embed_inputs(raw).detach()
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=1e-12)
    # the same through --data task (the checkpoint's own held-out inputs, in order)
    seqs = load_data(run, spec, "task", limit=3)
    assert all(torch.equal(a, b) for a, b in zip(seqs, got))


def test_lipschitz_at_the_data_of_a_run_with_pi_norm(run, tmp_path, capsys):
    """Pi_norm layers take the product route (the projection is 1-Lipschitz); every row is finite and at
    least its lower estimate (``local_table`` checks it), the whole network's too."""
    task = load_task("digits", n_train=TINY.n_train, seed=TINY.seed)
    np.save(tmp_path / "digits.npy", task.X_test[:2].double().numpy())
    out = tmp_path / "local.json"
    for data in (str(tmp_path / "digits.npy"), "task"):
        assert main(["lipschitz", str(run), "--data", data, "--limit", "2", "--rho", "1e-3,1e-1", "--rho-relative",
                     "--whole-network", "auto", "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        layer = [r for r in rows if r["component"] == "layer"]
        net = [r for r in rows if r["component"].startswith("network")]
        assert len(layer) == 2 and len(net) == 2
        for r in layer + net:
            assert math_finite(r["local_upper"]) and r["local_upper"] >= r["lower"] > 0
    capsys.readouterr()


def math_finite(x):
    return isinstance(x, (int, float)) and np.isfinite(x)


def test_layer_with_pi_norm_against_an_ascent_inside_the_ball():
    """The certified layer constant on B(X, rho) against a float64 pair ascent (``ball_lower``) at radii where the
    projection is active on some tokens and not on others."""
    from transcover.lipschitz import layer_local
    from transcover.lipschitz._local_lower import ball_lower
    from transcover.model import ReferenceConfig, ReferenceTransformer, layer_forward, reference_spec

    torch.manual_seed(0)
    m = ReferenceTransformer(ReferenceConfig(d_model=6, n_heads=2, n_layers=1, d_ff=12, norm="ball")).double()
    layer = reference_spec(m).to_torch(torch.float64).layers[0]
    X = torch.randn(5, 6, dtype=torch.float64) * torch.tensor([0.3, 0.9, 1.0, 1.1, 3.0], dtype=torch.float64)[:, None]
    for rho in (1e-3, 0.1, 1.0):
        ll = layer_local(layer, X, rho)
        assert ll.jacobian_ball == float("inf") and np.isfinite(ll.upper)
        lo = ball_lower(lambda Z: layer_forward(layer, Z), X, rho, steps=40, restarts=3, pair_restarts=3,
                        pair_steps=40, seed=1).value
        assert 0 < lo <= ll.upper, (rho, lo, ll.upper)


def test_task_data_needs_a_training_run(capsys):
    assert main(["lipschitz", "--data", "task"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint's own task" in err and len(err.strip().splitlines()) == 1


def test_raw_inputs_of_the_wrong_width_are_one_line(run, tmp_path, capsys):
    np.save(tmp_path / "bad.npy", np.zeros((2, 8, 5)))
    assert main(["lipschitz", str(run), "--data", str(tmp_path / "bad.npy")]) == 2
    err = capsys.readouterr().err
    assert "inputs must have shape (n, T, 8)" in err and "got (2, 8, 5)" in err and len(err.strip().splitlines()) == 1


def test_explicit_arch_reads_the_folder_the_ordinary_way(run):
    with pytest.raises(transcover.InputError):
        transcover.load(run / "checkpoint", arch="bert")


def test_bound_still_takes_the_run_folder(run):
    b = transcover.bound(run, eps=0.1)
    assert b.generalisation[0].n == pytest.approx(TINY.n_train)
    assert replace(TINY).n_train == 120
