"""Seeds of ``experiment staged`` through the sweep engine: same results as the serial loop, resumable."""

import json

import pytest

from transcover.scale import ResultStore
from transcover.scale._train import train_runner
from transcover.train import StagedConfig, TrainConfig, staged_experiment

TINY = TrainConfig(task="digits", n_train=100, epochs=2, batch_size=25, lr=3e-2, d_model=8, n_heads=2,
                   n_layers=1, d_ff=8, head_hidden=(8,))


@pytest.mark.slow
def test_parallel_seeds_match_the_serial_loop_and_resume(tmp_path):
    cfg = StagedConfig(seeds=(0,), base=TINY, radii={"KQ": 0.5, "W1": 1.0}, loose_factor=4.0)
    serial = staged_experiment(cfg)
    events = []
    with ResultStore(tmp_path / "s.sqlite") as store:
        pooled = staged_experiment(cfg, runner=train_runner(store=store, backend="process", workers=2,
                                                            on_result=events.append))
        assert json.dumps(pooled.to_dict(), sort_keys=True) == json.dumps(serial.to_dict(), sort_keys=True)
        assert [r.history for rs in pooled.runs.values() for r in rs] == \
            [r.history for rs in serial.runs.values() for r in rs]
        assert len(events) == 3 and not any(e.reused for e in events)
        events.clear()
        again = staged_experiment(cfg, runner=train_runner(store=store, on_result=events.append))
        assert len(events) == 3 and all(e.reused for e in events)  # nothing retrained
        assert json.dumps(again.to_dict(), sort_keys=True) == json.dumps(serial.to_dict(), sort_keys=True)
    again.plot(tmp_path / "s.png")
    assert again.table().row_count == 3
