"""Training loop, checkpoints and resume, tasks, the CLI, and a tiny staged experiment."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from transcover import InputError
from transcover.cli import main
from transcover.constrain import ConstraintConfig
from transcover.train import StagedConfig, TrainConfig, load_task, staged_experiment, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bound_memo import model_bound_once  # noqa: E402

TINY = TrainConfig(task="digits", n_train=200, epochs=4, batch_size=25, lr=3e-2, d_model=16, n_heads=2,
                   n_layers=1, d_ff=16, head_hidden=(16,))


@pytest.fixture(scope="module", autouse=True)
def _final_bounds_once():
    """Every ``train`` ends with ``model_bound`` of its model (most of its CPU); a resumed run's model is the
    uninterrupted one's bit for bit, so that bound is one computation several times here (each case of
    ``test_an_interrupted_checkpoint_write_keeps_a_complete_checkpoint``, each resume-equals-whole test).  Memoised
    on the exact spec and options (tests/bound_memo.py); no test of this file patches anything the bound reads."""
    with model_bound_once() as memo:
        yield memo


def test_digits_task_layout():
    task = load_task("digits", n_train=300, seed=1)
    assert task.X_train.shape == (300, 8, 8) and task.X_test.shape == (1797 - 300, 8, 8)
    assert float(task.X_train.max()) <= 1.0 and float(task.X_train.min()) >= 0.0
    assert set(task.y_train.tolist()) <= set(range(10)) and task.n_outputs == 10


def test_sparse_tasks():
    t = load_task("parity", n_train=64, n_test=32, seq_len=8, sparsity=2, seed=3)
    assert t.X_train.shape == (64, 8, 1) and t.kind == "classification" and t.n_outputs == 2
    assert set(t.y_train.tolist()) <= {0, 1}
    # an I-sparse target: the label is a function of two fixed positions only
    Z = torch.cat([t.X_train, t.X_test])[..., 0]
    y = torch.cat([t.y_train, t.y_test])
    pairs = [(i, j) for i in range(8) for j in range(i + 1, 8)]
    assert any(bool(((((Z[:, i] * Z[:, j]) + 1) / 2).round().long() == y).all()) for i, j in pairs)
    h = load_task("holder", n_train=16, n_test=8, seq_len=6, seed=0)
    assert h.kind == "regression" and h.n_outputs == 1


def test_training_learns_and_reports(tmp_path):
    cfg = replace(TINY, constraint=ConstraintConfig(method="project", radii={"KQ": 1.0, "OV": 1.0, "W1": 2.0}))
    res = train(cfg, out_dir=tmp_path)
    assert res.test_acc > 0.2  # chance is 0.1; 32 steps of a 16-wide model reach ~0.3
    assert res.norms["KQ"] <= 1.0 * (1 + 1e-4) and res.norms["W1"] <= 2.0 * (1 + 1e-4)
    assert res.capacity.kind.value == "estimate"
    assert res.bound is None or res.bound.kind.value == "certified upper bound"
    assert res.lipschitz is None or res.lipschitz.kind.value == "certified upper bound"
    hist = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(hist) == 4 * 8 + 4  # a record per step and one evaluation per epoch
    assert all(r["grad_norm"] > 0 for r in hist if r["loss"] is not None)
    assert json.loads(json.dumps(res.to_dict()))["epochs_done"] == 4


def test_resume_replays_exactly(tmp_path):
    from safetensors.torch import load_file

    cfg = replace(TINY, epochs=2, constraint=ConstraintConfig(
        method="penalty", radii={"W1": 0.5, "KQ": 0.5}, schedule="linear", penalty_weight=0.1))
    train(cfg, out_dir=tmp_path / "a")
    train(cfg, out_dir=tmp_path / "b", stop_after=1)
    with (tmp_path / "b" / "history.jsonl").open("a") as fh:  # a record written after the checkpoint
        fh.write(json.dumps({"step": 10_000, "loss": 1.0}) + "\n")
    res = train(cfg, out_dir=tmp_path / "b", resume=True)
    wa = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ha = (tmp_path / "a" / "history.jsonl").read_text().splitlines()
    hb = (tmp_path / "b" / "history.jsonl").read_text().splitlines()
    assert len(ha) == len(hb) and [json.loads(x)["loss"] for x in ha] == [json.loads(x)["loss"] for x in hb]
    assert res.epochs_done == 2 and len(res.history) == len(ha)
    assert (tmp_path / "a" / "history.csv").read_text() == (tmp_path / "b" / "history.csv").read_text()
    # the message names the setting that changed (red team 188: it did not say which)
    with pytest.raises(InputError, match=r"different configuration \(lr: 0\.03 -> 0\.5\)"):
        train(replace(cfg, lr=0.5), out_dir=tmp_path / "b", resume=True)
    with pytest.raises(InputError, match="does not exist"):
        train(cfg, out_dir=tmp_path / "c", resume=True)


@pytest.mark.parametrize("method,schedule", [("spectral", "constant"), ("spectral", "cosine"), ("project", "step"),
                                             ("lipschitz", "linear")])
def test_resume_is_bit_exact_for_every_method(tmp_path, method, schedule):
    """A spectral cap's power iteration took one step more on resume (the monitor read a parametrized weight's
    shape in training mode), so the resumed weights differed by up to 2.2e-4 (stop 39 red team)."""
    from safetensors.torch import load_file

    cfg = replace(TINY, n_train=96, epochs=2, batch_size=32, constraint=ConstraintConfig(
        method=method, radii={} if method == "lipschitz" else {"all": 0.5}, schedule=schedule))  # it uses none
    train(cfg, out_dir=tmp_path / "a")
    train(cfg, out_dir=tmp_path / "b", stop_after=1)
    train(cfg, out_dir=tmp_path / "b", resume=True)
    wa = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.mark.parametrize("argv,message", [
    (["train", "--epochs", "0"], "epochs must be a positive integer, but got epochs=0"),
    (["train", "--lr", "-1"], "lr must be a finite number > 0, but got lr=-1"),
    (["train", "--method", "project", "--radius", "KQ=-2"], r"radius\[KQ\] must be a finite number > 0"),
    (["train", "--method", "project", "--radius", "XY=2"], "unknown group 'XY'"),
    (["train", "--method", "project", "--radius", "KQ=2", "--start-fraction", "1.5"], "start_fraction must be in"),
    (["train", "--task", "cifar"], "task must be one of"),
    (["train", "--weight-decay", "inf"], "weight_decay must be a finite number >= 0"),  # NaN weights at step 1
    (["experiment", "staged", "--seeds", "0"], "seeds must be >= 1"),
])
def test_cli_bad_input_one_line(argv, message, capsys, tmp_path):
    assert main(argv + (["--out", str(tmp_path / "o")] if argv[0] == "train" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("transcover: error: ") and "\n" not in err
    assert pytest.importorskip("re").search(message, err), err
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_cli_train_and_resume(tmp_path, capsys):
    args = ["train", "--n-train", "100", "--epochs", "2", "--d-model", "8", "--d-ff", "8", "--n-layers", "1",
            "--method", "spectral", "--radius", "all=1", "--schedule", "cosine", "--start-fraction", "0.5",
            "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(args + ["--stop-after", "1"]) == 0
    assert main(args + ["--resume", "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["epochs_done"] == 2 and data["config"]["constraint"]["schedule"] == "cosine"
    for f in ("history.jsonl", "history.csv", "history.png", "checkpoint/state.json"):
        assert (tmp_path / "run" / f).is_file(), f
    assert "test accuracy" in capsys.readouterr().out


def test_tiny_staged_experiment(tmp_path):
    base = replace(TINY, n_train=100, epochs=2)
    cfg = StagedConfig(seeds=(0, 1), base=base, radii={"KQ": 0.5, "W1": 1.0}, loose_factor=4.0)
    res = staged_experiment(cfg)
    summ = res.summary()
    assert set(summ) == {"unconstrained", "tight", "staged"}
    for name in ("tight", "staged"):  # same final radii, exact projection
        assert all(r.norms["KQ"] <= 0.5 * (1 + 1e-4) and r.norms["W1"] <= 1.0 * (1 + 1e-4) for r in res.runs[name])
    assert all(r.norms["W1"] > 1.0 for r in res.runs["unconstrained"])  # so the constraint did bind
    res.plot(tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 10_000
    data = json.loads(json.dumps(res.to_dict()))
    table = res.table()
    assert table.row_count == 3
    # issue 10 defect 11: the gap bound never exceeds the loss range [0, 1]; a vacuous one says so
    for name, m in data["summary"].items():
        assert m["bound"][0] <= 1.0, name
        assert "bound_raw" in m and "bound_vacuous" in m
    for r in (r for runs in res.runs.values() for r in runs):
        assert r.bound.value <= 1.0 and r.bound.value == min(r.bound.raw, 1.0)
        assert r.bound.vacuous == (r.bound.raw >= 1.0) and r.bound.to_dict()["vacuous"] == r.bound.vacuous
    if all(r.bound.vacuous for runs in res.runs.values() for r in runs):
        assert "vacuous for every strategy" in table.caption and "vacuous" in data["notes"]["bound_note"]


def test_tightening_schedule_measures_against_the_radius_in_force():
    """Stop 38 red team: under ``project`` the forward of step k uses the weights step k - 1 projected at c_(k-1), and
    the monitor divided them by c_k: a step schedule showed "exceeded ... 1.75" where every stored weight was within
    its radius.  Now the ratio is against the radius in force, and a hard method stays <= 1 after its first
    projection."""
    cons = ConstraintConfig(method="project", radii={"KQ": 0.3, "OV": 0.3, "W1": 0.5}, schedule="step",
                            loose_factor=3.0, start_fraction=0.0, end_fraction=0.5)
    res = train(replace(TINY, epochs=2, constraint=cons))
    ratios = [r[f"ratio.{g}"] for r in res.history if r.get("step", 0) >= 2 for g in ("KQ", "OV", "W1")
              if r.get(f"ratio.{g}") is not None]
    assert ratios and max(ratios) <= 1.0 + 1e-9, max(ratios)  # exact sigma of weights projected at that radius
    assert max(ratios) > 0.99  # the projections were active
    assert not res.exceeded or all(r["max_ratio_step"] <= 1 for r in res.exceeded.values())


def test_resumed_run_measures_against_the_radius_in_force(tmp_path):
    """Stop 38 red team: the radii of the last projection were not in the checkpoint, so the first step after a resume
    divided by its own, tighter radius (ratio 1.083 where the uninterrupted run reads 0.99999988)."""
    cons = ConstraintConfig(method="project", radii={"KQ": 0.3, "OV": 0.3}, schedule="linear", loose_factor=3.0)
    cfg = replace(TINY, epochs=2, constraint=cons)
    whole = train(cfg, out_dir=tmp_path / "a")
    train(cfg, out_dir=tmp_path / "b", stop_after=1)
    resumed = train(cfg, out_dir=tmp_path / "b", resume=True)
    key = [k for k in whole.history[0] if k.startswith("ratio.KQ")][0]
    a = [(r["step"], r[key]) for r in whole.history if r.get(key) is not None]
    b = [(r["step"], r[key]) for r in resumed.history if r.get(key) is not None]
    assert a == b


def test_a_torn_checkpoint_is_refused_on_resume(tmp_path):
    """Stop 38 red team: each checkpoint file is atomic but the three are not; a kill after the new weights and before
    the new state.json resumed with mixed state without a word (test accuracy 0.10 against 0.17)."""
    cfg = replace(TINY, epochs=2)
    train(cfg, out_dir=tmp_path / "a", stop_after=1)
    ck = tmp_path / "a" / "checkpoint"
    state = (ck / "state.json").read_text()
    train(cfg, out_dir=tmp_path / "a", resume=True)  # the epoch-2 files
    (ck / "state.json").write_text(state)  # the torn set: epoch-2 weights, epoch-1 state
    with pytest.raises(InputError, match="is torn"):
        train(cfg, out_dir=tmp_path / "a", resume=True)


def test_a_diverging_capacity_proxy_is_inf_not_a_crash():
    """Stop 38 red team: a diverging seed's log proxy beyond 709 made math.exp raise in the monitor."""
    from transcover.constrain._penalties import capacity_proxy

    big = torch.tensor([1e50], dtype=torch.float64)  # a finite log proxy of 1382: its exp overflows
    sigmas = {"KQ.0": big, "OV.0": big, "W1.0": big, "W2.0": big, **{f"head.{j}": big for j in range(8)}}
    assert capacity_proxy(sigmas, 1) == float("inf")


def test_a_run_stopped_mid_schedule_is_bounded_as_it_computes(tmp_path):
    """Red team 171: a spectral run stopped before finalize had a head above its radius (sigma/c 1.0097); its losses
    came from that model, but its Lipschitz and covering bounds (and ``transcover bound RUN``'s) from the certified
    export, which projected it: another function. Both now use the model as evaluated and checkpointed."""
    from transcover.constrain import constrain, export_plain
    from transcover.lipschitz import lipschitz_bounds
    from transcover.model import reference_spec
    from transcover.train import checkpoint_spec
    from transcover.train._checkpoint import load_checkpoint
    from transcover.train._loop import _checkpoint_task, build_model, evaluate

    cfg = TrainConfig(task="digits", n_train=128, epochs=4, batch_size=32, lr=0.05, d_model=8, n_heads=2, n_layers=1,
                      d_ff=16, constraint=ConstraintConfig(method="spectral", radii={"all": 0.7}, schedule="linear",
                                                           start_fraction=0.25))
    res = train(cfg, out_dir=tmp_path, stop_after=2)
    folder = tmp_path / "checkpoint"
    config, task = _checkpoint_task(folder)
    model = build_model(config, task)
    constrain(model, config.constraint)
    load_checkpoint(folder, model)
    live, projected = export_plain(model, certify=False).eval(), export_plain(model).eval()
    assert evaluate(live, task.X_test, task.y_test, task)[0] == pytest.approx(res.test_loss, rel=0, abs=0)
    assert evaluate(projected, task.X_test, task.y_test, task)[0] != res.test_loss  # a cap was over: it matters
    assert res.lipschitz.value == lipschitz_bounds(reference_spec(live)).upper.value
    spec, _, _ = checkpoint_spec(tmp_path)  # what `transcover bound RUN` reads
    assert lipschitz_bounds(spec).upper.value == res.lipschitz.value
    assert lipschitz_bounds(reference_spec(projected)).upper.value < res.lipschitz.value


@pytest.mark.parametrize("kw, needle", [
    ({"schedule": "constant"}, "not 'constant'"), ({"loose_factor": 1.0}, "loose_factor must be > 1"),
    ({"method": "log_penalty"}, "enforces the radii's values"), ({"method": "lipschitz"}, "enforces the radii's"),
    ({"start_fraction": 0.0, "end_fraction": 0.0}, "end_fraction must be > 0"),
])
def test_a_staged_arm_that_is_the_tight_one_is_refused(kw, needle, tmp_path, capsys):
    """Red team 188: these settings made the staged arm bit-identical to the tight arm, and the table presented the two
    as strategies compared (exit 0)."""
    with pytest.raises(InputError, match=needle):
        StagedConfig(**kw)
    flags = {"schedule": "--schedule", "loose_factor": "--loose-factor", "method": "--method"}
    argv = [x for k, v in kw.items() if k in flags for x in (flags[k], str(v))]
    if argv:
        assert main(["experiment", "staged", "--out", str(tmp_path / "o"), *argv]) == 2
        assert needle.split("'")[0][:20] in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def test_an_experiment_output_path_that_is_a_file_is_one_line(tmp_path, capsys):
    """Red team 188: ``experiment staged --out FILE`` printed the raw "[Errno 17] File exists" without naming --out, and
    a refused --workers 0 left an empty --out folder behind."""
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["experiment", "staged", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert "cannot use --out" in err and "Errno" not in err
    assert main(["experiment", "staged", "--out", str(tmp_path / "o"), "--workers", "0"]) == 2
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--ray-address", "foo:1"], "--ray-address needs --backend ray"),
    (["--resume"], "--resume applies to the results store"),
    (["--no-resume"], "--no-resume applies to the results store"),
])
def test_staged_refuses_scale_options_it_would_ignore(argv, needle, tmp_path, capsys):
    """Red team 207: ``experiment staged`` took ``--ray-address`` without ``--backend ray`` and ``--resume`` /
    ``--no-resume`` without ``--store`` and dropped them (exit 0); one line and exit 2, as the other commands,
    before any training or output folder."""
    assert main(["experiment", "staged", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("transcover: error: ") and "\n" not in err and needle in err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def three_epoch_runs(tmp_path_factory):
    """``replace(TINY, epochs=3)`` trained whole, and a run of it stopped after its first epoch: the same two runs (no
    patch active) each case below trained for itself; a case resumes a copy of the stopped run's folder."""
    cfg = replace(TINY, epochs=3)
    base = tmp_path_factory.mktemp("three")
    whole = train(cfg, out_dir=base / "whole")
    train(cfg, out_dir=base / "a", stop_after=1)
    return cfg, whole, base


@pytest.mark.parametrize("cut", range(1, 9))
def test_an_interrupted_checkpoint_write_keeps_a_complete_checkpoint(three_epoch_runs, tmp_path, monkeypatch, cut):
    """Red team 188: a SIGTERM between two of a checkpoint's files left a torn set, refused on --resume, and every
    earlier epoch was lost.  A new set is written whole beside the old one and swapped in by renames (Note
    [checkpoint swap]); an interrupt at any of the writes and renames leaves the previous checkpoint or the new one,
    and the resumed run ends bit for bit where an uninterrupted one does."""
    import os as os_mod
    import shutil

    from transcover.train import _checkpoint as ckpt

    cfg, whole, base = three_epoch_runs  # whole = train(cfg, out_dir=base / "whole")
    shutil.copytree(base / "a", tmp_path / "a")  # train(cfg, out_dir=tmp_path / "a", stop_after=1)
    calls = [0]
    real_replace, real_write = os_mod.replace, ckpt.atomic_write_bytes

    def counted(fn):  # noqa: ANN001, ANN202
        def inner(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            if calls[0] == cut:
                raise KeyboardInterrupt  # the kill, before this write or rename
            return fn(*a, **k)
        return inner

    monkeypatch.setattr(ckpt.os, "replace", counted(real_replace))
    monkeypatch.setattr(ckpt, "atomic_write_bytes", counted(real_write))
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out_dir=tmp_path / "a", resume=True)
    monkeypatch.undo()
    resumed = train(cfg, out_dir=tmp_path / "a", resume=True)
    assert resumed.test_acc == whole.test_acc and resumed.test_loss == whole.test_loss
    a = ckpt.load_checkpoint(tmp_path / "a" / "checkpoint", build_model_for(cfg))
    b = ckpt.load_checkpoint(base / "whole" / "checkpoint", build_model_for(cfg))
    assert a["epoch"] == b["epoch"] == 3
    assert not (tmp_path / "a" / "checkpoint.new").exists() and not (tmp_path / "a" / "checkpoint.prev").exists()


def build_model_for(cfg):  # noqa: ANN001, ANN201
    from transcover.train._loop import build_model

    return build_model(cfg, load_task(cfg.task, n_train=cfg.n_train, seed=cfg.seed))


def test_a_new_run_that_fails_at_once_leaves_the_earlier_run_as_it_was(tmp_path):
    """Red team 188: a new run in an existing --out emptied the earlier history at its start; when it then failed
    (lr 1e308: NaN at the first step), the folder held the earlier checkpoint beside an empty history.  The fresh
    history replaces the old one, and the old checkpoint goes, only with the new run's first row."""
    cfg = replace(TINY, epochs=1, constraint=ConstraintConfig(method="project", radii={"all": 1.0}))
    out = tmp_path / "run"
    train(cfg, out_dir=out)
    before = {p.name: p.read_bytes() for p in out.glob("history.*")}
    state = (out / "checkpoint" / "state.json").read_bytes()
    with pytest.raises(InputError):
        train(replace(cfg, lr=1e308), out_dir=out)
    assert {p.name: p.read_bytes() for p in out.glob("history.*")} == before and before
    assert (out / "checkpoint" / "state.json").read_bytes() == state
    again = train(cfg, out_dir=out)  # a new run that works replaces both
    assert again.test_acc >= 0 and len((out / "history.jsonl").read_text().splitlines()) == len(
        before["history.jsonl"].decode().splitlines())
