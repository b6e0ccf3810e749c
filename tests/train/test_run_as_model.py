"""A ``transcover train`` run is a model like any other: every command reads its run or checkpoint
folder, and ``--data`` takes its raw inputs (digits rows) or its own held-out task (``task``).

Before this, ``analyze``, ``lipschitz``, ``report`` and ``perturb`` refused a run ("no model
weights", "cannot tell the architecture"), and the local routes refused its Pi_norm layers.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import transcover
from transcover.cli import main
from transcover.train import TrainConfig, checkpoint_spec, load_data, load_task, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bound_memo import local_table_once, model_bound_once  # noqa: E402

TINY = TrainConfig(task="digits", n_train=120, epochs=1, batch_size=40, lr=3e-2, d_model=12, n_heads=2,
                   n_layers=1, d_ff=8, head_hidden=(8,))


@pytest.fixture(scope="module", autouse=True)
def _bounds_once():
    """``bound RUN``, ``report RUN`` (and ``train``'s final bound) of the module's one run compute the same
    ``model_bound`` several times: memoised on the exact spec and options (tests/bound_memo.py); no test of this file
    patches anything the bound reads."""
    with model_bound_once() as memo:
        yield memo


@pytest.fixture(scope="module", autouse=True)
def _local_tables_once():
    """``lipschitz RUN --data X.npy`` and ``--data task`` read the same sequences (the task's first held-out rows,
    ``test_raw_inputs_are_embedded_as_the_model_embeds_them``), and the CSV/plot test asks for the same table again:
    ``local_table`` memoised on the exact spec, sequences, radii and options (tests/bound_memo.py); no test of this
    file patches anything the table reads."""
    with local_table_once() as memo:
        yield memo


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


def test_the_report_names_the_checkpoints_stored_dtype(run):
    """Red team 215: the model card of a `train` checkpoint said "stored dtype | ?"."""
    from transcover.report._build import ReportOptions, compute_report, render_report

    assert checkpoint_spec(run / "checkpoint")[0].config["storage_dtype"] == "float32"
    html = render_report(compute_report(str(run), options=ReportOptions(lower=False)))
    assert "<td>stored dtype</td><td>float32</td>" in html


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


def test_explicit_arch_reads_the_folder_the_ordinary_way(run, capsys):
    """``load``, ``bound`` (API) and ``transcover bound`` share one rule: an explicit arch reads the folder's weights
    the ordinary way (the bound's CLI and API had read a run as a run whatever --arch said, stop 39's list)."""
    with pytest.raises(transcover.InputError):
        transcover.load(run / "checkpoint", arch="bert")
    with pytest.raises(transcover.InputError):
        transcover.bound(run / "checkpoint", arch="bert", eps=0.1)
    assert main(["bound", str(run / "checkpoint"), "--arch", "bert", "--quiet"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_bound_still_takes_the_run_folder(run):
    b = transcover.bound(run, eps=0.1)
    assert b.generalisation[0].n == pytest.approx(TINY.n_train)
    assert replace(TINY).n_train == 120


def _copy_run(run, dst):
    import shutil

    shutil.copytree(run, dst)
    return dst


def test_sweep_keys_cover_the_run_checkpoint(run, tmp_path):
    """Every run folder had the same (empty) fingerprint, so a sweep of two runs showed the first one's numbers
    for both (stop 39 red team): the key covers the checkpoint's weights and state.json."""
    from transcover.scale import fingerprint

    other = tmp_path / "other"
    train(replace(TINY, d_model=16, d_ff=12), out_dir=other)
    assert fingerprint(str(run), "full") != fingerprint(str(other), "full")
    edited = _copy_run(run, tmp_path / "edited")
    state = json.loads((edited / "checkpoint" / "state.json").read_text())
    state["config"]["seed"] = 5  # the config rebuilds the task: a changed state.json is another item
    (edited / "checkpoint" / "state.json").write_text(json.dumps(state))
    assert fingerprint(str(run), "full") != fingerprint(str(edited), "full")
    out = tmp_path / "sweep.json"
    assert main(["analyze", str(other), str(run), "--json", str(out), "--quiet", "--store",
                 str(tmp_path / "s.sqlite")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["d_model"] for r in rows] == [16, TINY.d_model]


def test_item_backends_read_a_run(run, tmp_path):
    out = tmp_path / "l.json"
    assert main(["lipschitz", str(run), "--data", "task", "--limit", "2", "--backend", "serial", "--quiet",
                 "--store", str(tmp_path / "s.sqlite"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n_sequences"] == 2


def test_a_run_without_optimizer_state_is_still_a_model(run, tmp_path):
    shared = _copy_run(run, tmp_path / "shared")
    (shared / "checkpoint" / "optimizer.pt").unlink()
    assert transcover.load(shared).d_model == TINY.d_model


def test_a_state_json_that_does_not_fit_the_weights_is_one_line(run, tmp_path, capsys):
    bad = _copy_run(run, tmp_path / "bad")
    state = json.loads((bad / "checkpoint" / "state.json").read_text())
    state["config"]["d_model"] = 2 * TINY.d_model
    (bad / "checkpoint" / "state.json").write_text(json.dumps(state))
    assert main(["analyze", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "does not fit the model its state.json describes" in err and len(err.strip().splitlines()) == 1


def test_the_inputs_of_a_run_are_the_checkpoint_files_read(run, tmp_path, capsys):
    """Red team 222: a run folder's JSON listed ``"inputs": []`` (the envelope globbed the folder given, which holds
    no weights), and a checkpoint folder every file of a model suffix in it, read or not: optimizer.pt, a stray
    notes.json, another model's stray.safetensors.  The inputs are the files the load reads: state.json (the model
    and its task) and model.safetensors."""
    from transcover.report import file_sha256, input_hashes

    ck = _copy_run(run, tmp_path / "run") / "checkpoint"
    (ck / "notes.json").write_text("{}")
    (ck / "stray.safetensors").write_bytes((ck / "model.safetensors").read_bytes())
    want = [{"path": str(ck / n), "sha256": file_sha256(ck / n), "bytes": (ck / n).stat().st_size}
            for n in ("state.json", "model.safetensors")]
    js = tmp_path / "a.json"
    for source in (ck.parent, ck):
        assert main(["analyze", str(source), "--quiet", "--json", str(js)]) == 0
        assert json.loads(js.read_text())["inputs"] == want, source
    assert input_hashes(ck.parent) == want


def test_a_run_state_rewritten_after_it_was_read_is_refused(run, tmp_path):
    """Red team 222: state.json, which rebuilds the model and its task, was hashed without being held to what the load
    read; a state rewritten after the load was listed with its new content's hash."""
    from transcover.report import input_hashes

    ck = _copy_run(run, tmp_path / "run") / "checkpoint"
    transcover.load(ck)
    state = ck / "state.json"
    state.write_text(state.read_text() + "\n")  # the same state, other bytes: the checksum would not be of the read
    with pytest.raises(transcover.InputError, match="state.json was replaced or rewritten after it was read"):
        input_hashes(ck)


def test_report_takes_the_runs_own_n_and_t_as_bound_does(run):
    """Red team 222: ``report`` of a run certified the gap at n = 1e6 (and T = 128) while ``bound`` took the run's
    n_train and its task's T; given values still win."""
    from transcover.report._build import ReportOptions, compute_report

    b = transcover.bound(run, eps=0.1)
    d = compute_report(str(run), options=ReportOptions(lower=False))
    assert d.bound.generalisation[0].n == b.generalisation[0].n == TINY.n_train
    assert d.bound.seq_len == b.seq_len and d.options.n_samples == TINY.n_train
    d = compute_report(str(run), options=ReportOptions(lower=False, n_samples=1e6, seq_len=4))
    assert d.bound.generalisation[0].n == 1e6 and d.bound.seq_len == 4


def test_a_model_folder_holding_a_run_is_read_as_the_model(run, tmp_path):
    from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference

    both = _copy_run(run, tmp_path / "both")
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=10, n_heads=2, n_layers=1, d_ff=8)),
                   both / "model.safetensors")
    assert transcover.load(both).d_model == 10
    assert transcover.load(both / "checkpoint").d_model == TINY.d_model


def test_csv_and_plot_of_the_local_table(run, tmp_path):
    import pandas as pd

    paths = {k: tmp_path / f"l.{k}" for k in ("json", "csv", "png")}
    assert main(["lipschitz", str(run), "--data", "task", "--limit", "2", "--rho", "1e-3,1e-1", "--rho-relative",
                 "--whole-network", "auto", "--quiet", "--json", str(paths["json"]), "--csv", str(paths["csv"]),
                 "--plot", str(paths["png"])]) == 0
    rows = json.loads(paths["json"].read_text())["rows"]
    table = pd.read_csv(paths["csv"])
    assert len(table) == len(rows) and list(table["local_upper"]) == [float(r["local_upper"]) for r in rows]
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["lipschitz", str(run), "--no-lower", "--quiet", "--csv", str(tmp_path / "g.csv")]) == 0
    g = pd.read_csv(tmp_path / "g.csv")
    assert {"stage", "layer", "network"} == set(g["kind"]) and (g["upper"] > 0).all()


def test_the_network_row_is_never_above_the_global_chain_on_the_ball(run):
    """Every token of B(X, rho) has norm <= max ||X_t|| + rho, so the global chain at that radius bounds the ball
    (Note [global on the ball]); the composed local route alone reached 1e72 at rho = 0.1 on a Pi_norm run."""
    from transcover.lipschitz import compose, local_table
    from transcover.lipschitz._weights import spec_norms

    spec = transcover.load(run).to_torch(torch.float64)
    seqs = load_data(run, spec, "task", limit=2)
    rows = local_table(spec, seqs, [1e-3, 30.0], whole="auto", lower=True)
    net = [r for r in rows if r.layer == -1]
    for r in net:
        rho = [r.rho_factor * float(X.norm(dim=1).median()) for X in seqs]
        g = max(compose(spec_norms(spec), radius=float(X.norm(dim=1).max()) + p).upper.value
                for X, p in zip(seqs, rho))
        assert r.lower <= r.local_upper <= g * (1 + 1e-9), (r.rho_factor, r.local_upper, g)
    assert net[-1].component == "network (global)"


def test_report_at_the_data_of_a_run_with_the_whole_network(run, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--data", "task", "--limit", "2", "--rho", "1e-3", "--whole-network", "auto",
                 "--no-lower", "--quiet", "-o", str(out)]) == 0
    html = out.read_text()
    assert "network (product)" in html and "Training monitor" in html  # the run's own history, unasked
    assert main(["report", str(run), "--whole-network", "auto", "-o", str(tmp_path / "x.html")]) == 2
    assert "it needs --data" in capsys.readouterr().err and not (tmp_path / "x.html").exists()


def test_one_width_for_raw_inputs_and_embeddings_says_which_reading(tmp_path):
    """A digits model of width 8: an (n, T, 8) array could be either; it is read as raw inputs, and said so."""
    from transcover import TranscoverWarning

    run8 = tmp_path / "run8"
    train(replace(TINY, d_model=8), out_dir=run8)
    spec = transcover.load(run8).to_torch(torch.float64)
    with pytest.warns(TranscoverWarning, match="read as raw inputs"):
        load_data(run8, spec, "task", limit=1)


def test_data_of_huge_norm_is_not_blamed_on_a_radius(run, tmp_path, capsys):
    """Token norms near 1e200 overflowed torch's unscaled norm in the table's radii: 'radius=inf' (a radius the
    user never gave); the norms are now formed at powers of two."""
    np.save(tmp_path / "big.npy", np.full((1, 3, 8), 1e200))
    rc = main(["lipschitz", str(run), "--data", str(tmp_path / "big.npy"), "--no-lower", "--quiet"])
    assert rc == 0 and "radius=inf" not in capsys.readouterr().err


def test_a_run_whose_task_cannot_be_rebuilt_is_refused(run, tmp_path):
    """Stop 39's list: ``--data task`` and ``bound`` rebuild a run's split from ``state.json``'s seed, which nothing
    protected: an edited seed certified at another split, and a run trained on a task given through the API was
    read as the standard task's, silently.  Every checkpoint now records its task's digest (Note [task digest])."""
    import shutil

    from transcover import InputError

    run = _copy_run(run, tmp_path / "run")  # train(TINY, out_dir=run): the module's run, trained alike
    spec = transcover.load(run)
    assert len(load_data(run, spec, "task", limit=2)) == 2
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["task_sha256"] == load_task("digits", n_train=TINY.n_train, seed=TINY.seed).digest()
    edited = tmp_path / "edited"
    shutil.copytree(run, edited)
    state["config"]["seed"] += 1
    (edited / "checkpoint" / "state.json").write_text(json.dumps(state))
    for call in (lambda: load_data(edited, spec, "task"), lambda: checkpoint_spec(edited)):
        with pytest.raises(InputError, match="not the data this run trained on"):
            call()
    assert main(["lipschitz", str(edited), "--data", "task", "--limit", "1", "--no-lower", "--quiet"]) == 2
    # a task given through the API: the run is trained, but its state cannot rebuild that data
    task = load_task("digits", n_train=TINY.n_train, seed=TINY.seed)
    task = replace(task, X_train=task.X_train.flip(0), y_train=task.y_train.flip(0))
    api = tmp_path / "api"
    train(TINY, out_dir=api, task=task, stop_after=1)
    with pytest.raises(InputError, match="through the API"):
        checkpoint_spec(api)
    # and a resume with other data than the checkpoint's is refused before any training
    two = replace(TINY, epochs=2)
    half = tmp_path / "half"
    train(two, out_dir=half, stop_after=1)
    with pytest.raises(InputError, match="other data than this call's task"):
        train(two, out_dir=half, resume=True, task=task)


def test_task_digest_reads_raw_bytes_of_any_dtype():
    """Red team 166: ``Task.digest`` went through numpy, which has no bfloat16 (a raw TypeError from ``train`` given a
    bf16 task). It hashes the tensors' raw bytes, with dtype and shape, so the same values in another dtype differ."""
    from transcover.train._tasks import Task

    task = load_task("digits", n_train=TINY.n_train, seed=TINY.seed)
    half = Task(task.name, task.X_train.bfloat16(), task.y_train, task.X_test.bfloat16(), task.y_test,
                task.n_outputs, task.kind, task.source)
    assert len(half.digest()) == 64 and half.digest() != task.digest() == load_task(
        "digits", n_train=TINY.n_train, seed=TINY.seed).digest()

