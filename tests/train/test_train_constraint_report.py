"""Red team 207: the constraint rows of ``transcover train`` (table and JSON) and the first step of a hard method.

F1: a group's row took its value (the largest sigma over layers) from one slot and its radius, ratio and
certificate from another ("2.0000 | target 0.3 | certified <= 0.3 <= target").  F2: a run stopped before its
schedule ended showed the loose radius in force as the "target", with no warning.  F3: ``project`` left the
initial weights unprojected, so step 1's forward and gradient ran on sigma far above the radius.
"""

import pytest


@pytest.mark.parametrize("method", ["project", "clip"])
def test_step_one_runs_on_weights_within_the_first_radius(method):
    """F3: the hard methods act after each step, so the initial weights must be projected (clipped) before the
    first one: the history's step-1 record (the weights step 1's forward used) is within the radius, and a
    tight constant radius is not reported as exceeded."""
    from transcover.constrain import ConstraintConfig
    from transcover.train import TrainConfig, train

    cfg = TrainConfig(task="parity", n_train=64, n_test=32, seq_len=8, epochs=1, batch_size=32, d_model=16,
                      d_ff=32, constraint=ConstraintConfig(method=method, radii={"all": 0.5 if method == "project"
                                                                                  else 0.05}))
    res = train(cfg)
    first = next(r for r in res.history if r["step"] == 1 and r.get("loss") is not None)
    if method == "project":
        sigmas = {k: v for k, v in first.items() if k.startswith("sigma.") and v is not None}
        assert sigmas and max(sigmas.values()) <= 0.5 * (1 + 1e-6), sigmas
        assert max(first[k] for k in first if k.startswith("ratio.") and first[k] is not None) <= 1 + 1e-6
        assert res.exceeded == {}
    else:  # clipping bounds the entries: the step-1 weights are the clipped ones
        assert all(first[f"radius.{g}"] == 0.05 for g in ("W1", "KQ"))
        assert first["sigma.W1"] <= 0.05 * (16 * 32) ** 0.5  # every entry within 0.05: sigma <= ||W1||_F
