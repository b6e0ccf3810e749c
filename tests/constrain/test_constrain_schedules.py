"""Schedules hit their endpoints and move monotonically between them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import InputError
from transcover.constrain import SCHEDULE_KINDS, RadiusSchedule

radii = st.floats(0.01, 100.0)
fractions = st.floats(0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(SCHEDULE_KINDS), c0=radii, c1=radii, t0=fractions, t1=fractions,
       n=st.integers(1, 10), ts=st.lists(fractions, min_size=2, max_size=8))
def test_schedule_endpoints_and_monotone(kind, c0, c1, t0, t1, n, ts):
    t0, t1 = min(t0, t1), max(t0, t1)
    s = RadiusSchedule(target=c1, start=c0, kind=kind, start_fraction=t0, end_fraction=t1, n_steps=n)
    assert s(1.0) == c1  # the target, exactly, at the end of training
    assert s(t1) == c1
    if kind == "constant":
        assert s(0.0) == c1
    elif t0 < t1:
        assert s(0.0) == c0 and s(t0) == c0  # the loose start, exactly, until tightening begins
    lo, hi = min(c0, c1), max(c0, c1)
    values = [s(t) for t in sorted(ts)]
    assert all(lo <= v <= hi for v in values)
    # monotone from c0 towards c1
    sign = 1 if c1 >= c0 else -1
    assert all(sign * (b - a) >= -1e-12 * hi for a, b in zip(values, values[1:]))


def test_shapes_at_midpoint():
    mid = {k: RadiusSchedule(1.0, 3.0, k, 0.0, 1.0, n_steps=4)(0.5) for k in SCHEDULE_KINDS}
    assert mid == {"constant": 1.0, "linear": 2.0, "cosine": pytest.approx(2.0), "step": 2.0}
    assert RadiusSchedule(1.0, 3.0, "step", 0.0, 1.0, n_steps=4)(0.49) == 2.5


@pytest.mark.parametrize("kwargs,message", [
    (dict(target=0.0), "target radius must be a finite number > 0, but got target radius=0.0"),
    (dict(target=1.0, start=-2.0), "start radius must be a finite number > 0"),
    (dict(target=1.0, kind="exp"), "schedule must be one of constant, linear, cosine, step, but got schedule='exp'"),
    (dict(target=1.0, start_fraction=1.5), r"start_fraction must be in \[0, 1\], but got start_fraction=1.5"),
    (dict(target=1.0, end_fraction=-0.1), r"end_fraction must be in \[0, 1\]"),
    (dict(target=1.0, start_fraction=0.8, end_fraction=0.2), "end_fraction must be >= start_fraction"),
    (dict(target=1.0, n_steps=0), "n_steps must be a positive integer"),
])
def test_bad_schedules(kwargs, message):
    with pytest.raises(InputError, match=message):
        RadiusSchedule(**kwargs)


def test_a_nan_progress_is_refused_and_the_rest_is_clamped():
    """Red team 190, D3: ``set_progress(nan)`` made every radius NaN (a spectral cap then wrote NaN weights) and a
    schedule returned NaN.  Outside [0, 1], infinities included, the progress is clamped (the documented range)."""
    import torch

    from transcover.constrain import ConstraintConfig, constrain
    from transcover.model import ReferenceConfig, ReferenceTransformer

    s = RadiusSchedule(target=1.0, start=4.0, kind="linear")
    with pytest.raises(InputError, match="progress must be a number"):
        s(float("nan"))
    assert (s(-float("inf")), s(-3.0), s(2.0), s(float("inf"))) == (4.0, 4.0, 1.0, 1.0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12))
    cons = constrain(model, ConstraintConfig(method="spectral", radii={"W1": 0.5}, schedule="linear"))
    buf = model.blocks[0].parametrizations.W_1[0].radius
    cons.set_progress(0.5)
    with pytest.raises(InputError, match="progress must be a number"):
        cons.set_progress(float("nan"))
    assert cons.progress == 0.5 and float(buf) == cons.radius("W1.0") == 1.25  # untouched
    cons.set_progress(float("inf"))
    assert cons.progress == 1.0 and float(buf) == 0.5
    cons.set_progress(-float("inf"))
    assert cons.progress == 0.0 and float(buf) == 2.0
    assert bool(torch.isfinite(model.blocks[0].W_1).all())
