"""The shared argument checks of ``transcover._errors`` and the public functions that use them."""

from __future__ import annotations

import numpy as np
import pytest

from transcover import InputError
from transcover._errors import check_positive_int
from transcover.covering import bft_spectral_complexity, linear_linf_log_covering
from transcover.train import load_task


@pytest.mark.parametrize("good", [1, 7, 2**70])
def test_check_positive_int_returns_the_int(good):
    assert check_positive_int(good, "n") == good


@pytest.mark.parametrize("bad", [0, -3, True, False, 2.0, float("nan"), float("inf"), "3", None, np.float64(4),
                                 np.int64(3)])
def test_check_positive_int_names_the_argument(bad):
    with pytest.raises(InputError, match=r"^count must be a positive integer, but got count="):
        check_positive_int(bad, "count")


@pytest.mark.parametrize("call", [
    # True was an int >= 1 to these checks, so a flag passed in the wrong slot counted as 1
    lambda: bft_spectral_complexity([1.0], [0.5], width=True),
    lambda: linear_linf_log_covering(1.0, 1.0, 0.1, True),
    lambda: load_task("majority", n_train=True),
])
def test_counts_refuse_booleans(call):
    with pytest.raises(InputError, match="must be a positive integer"):
        call()



@pytest.mark.parametrize("bad", [True, 0.0, -1.0, float("nan"), float("inf"), "x", None, 10**400])
def test_check_radius_refuses_what_is_not_a_finite_positive_number(bad):
    from transcover._errors import check_radius

    with pytest.raises(InputError, match=r"^r must be a finite number > 0"):
        check_radius(bad, "r")
