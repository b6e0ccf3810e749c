"""``report --history``: a history is drawn only where it can be the model's training monitor (stop 39 red team:
step-only and foreign files drew four empty panels, concatenated histories zig-zags, a 5 000-digit integer crashed,
another run's history was drawn under this model without a word), and a training run reports its own history."""

import json
import warnings
from dataclasses import replace

import pytest

from transcover import InputError, TranscoverWarning
from transcover.cli import main
from transcover.report import ReportOptions, compute_report
from transcover.train import TrainConfig, train

TINY = TrainConfig(task="digits", n_train=80, epochs=1, batch_size=40, lr=3e-2, d_model=8, n_heads=2, n_layers=1,
                   d_ff=8, head_hidden=(8,))
FAST = ReportOptions(lower=False, seq_len=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    train(TINY, out_dir=a)
    train(replace(TINY, seed=1), out_dir=b)
    return a, b


def _lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("records,message", [
    ([{"step": i} for i in range(3)], "holds no training series"),
    ([{"step": i, "foo": 1.0, "bar": [1, 2]} for i in range(3)], "holds no training series"),
    ([{"step": 2, "loss": 1.0}, {"step": 1, "loss": 0.9}], "the steps go backwards"),
    ([{"step": 0, "loss": 1.0, "sigma.KQ.3": 0.5}], "records layer 3, but the model has 1 layers"),
])
def test_histories_that_cannot_be_this_models_monitor_are_refused(runs, tmp_path, records, message):
    with pytest.raises(InputError, match=message):
        compute_report(runs[0], options=FAST, history=_lines(tmp_path / "h.jsonl", records))


def test_a_huge_integer_is_one_line(runs, tmp_path, capsys):
    h = tmp_path / "h.jsonl"
    h.write_text('{"step": 0, "loss": ' + "9" * 5000 + "}\n")
    out = tmp_path / "r.html"
    assert main(["report", str(runs[0]), "--history", str(h), "--no-lower", "--quiet", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 1 is not JSON" in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_run_reports_its_own_history_and_flags_another(runs):
    a, b = runs
    own = compute_report(a, options=FAST)
    assert own.history is not None and own.history_path == str(a / "history.jsonl")
    assert not any("not the run's own" in w for w in own.warnings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = compute_report(a, options=FAST, history=b / "history.jsonl")
    assert any(issubclass(w.category, TranscoverWarning) and "not the run's own" in str(w.message) for w in caught)
    assert any("not the run's own" in w for w in other.warnings)
