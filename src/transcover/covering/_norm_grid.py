"""A union bound over a geometric grid of norm levels: the class of a trained model, paid for (THEORY F102).

``model_bound`` covers the class "every weight whose norms are at most this model's".  Read off the
trained weights, that class depends on the sample, and the gap's ``ln(2/delta)`` pays for no such
choice.  Following Bartlett, Foster and Telgarsky (2017, Lemma A.9), every norm ``v`` the bound reads is
rounded up to a level of a grid fixed in advance,

    ``G(j) = fl(2^(j/k))`` for integers ``j`` (``k`` levels per octave), and the level 0,

and the gap is taken for the class of the levels, with the failure probability ``delta`` spread over all
level vectors by a prior that is fixed before the data: ``1/2`` on the level 0, and
``1/(3(|j| + 1)(|j| + 2))`` on ``G(j)``, independently per norm.  These sum to 1: ``sum_{j >= 1}
1/((j + 1)(j + 2)) = 1/2`` telescopes, so ``sum_{j in Z} 1/((|j| + 1)(|j| + 2)) = 1/2 + 2 * 1/2 = 3/2``.
The union bound then holds at every level vector at once, so at the one the trained model lands in; its
price is ``ln(1/prior)`` summed over the norms, added to ``ln(2/delta)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from .._errors import InputError, check_positive_int
from ._outward import exact, to_float

__all__ = ["NormGrid", "grid_class_bounds", "MAX_STEPS", "NORM_GRID_MAX_STEPS"]

MAX_STEPS = 2**20  # levels per octave: 2^(1/k) - 1 stays ~k/ln 2 ulps of 1 apart, so every level is its own float
NORM_GRID_MAX_STEPS = MAX_STEPS  # the package's name for it


@dataclass
class NormGrid:
    """Rounds norms up to the grid ``{0} ∪ {fl(2^(j/k)) : j ∈ Z}`` and records what each choice costs.

    ``steps`` is ``k``, the levels per octave (fixed before the data: it is part of the prior).  Every
    :meth:`up` is one more norm in the union bound; :attr:`log_prior` is the certified upper bound of
    ``sum ln(1/prior)`` over them (F102).
    """

    steps: int = 4
    levels: list[int | None] = field(default_factory=list)  # j of each rounded norm; None: the level 0

    def __post_init__(self) -> None:
        check_positive_int(self.steps, "norm grid steps")
        if self.steps > MAX_STEPS:  # beyond, consecutive levels coincide as floats and the search walked them
            raise InputError(f"norm grid steps must be <= {MAX_STEPS} levels per octave, but got {self.steps}")

    def level(self, j: int) -> float:
        """``fl(2^(j/k))``: any fixed function of ``j`` would do; this one is evaluated the same way every time."""
        q, r = divmod(j, self.steps)
        try:
            return math.ldexp(2.0 ** (r / self.steps), q)
        except OverflowError:
            return math.inf

    def up(self, v: float) -> float:
        """The smallest grid level ``>= v`` (recorded); ``v`` a norm bound, ``>= 0`` (``inf`` stays ``inf``)."""
        if not (isinstance(v, (int, float)) and v >= 0):  # NaN fails too
            raise InputError(f"a norm bound must be a number >= 0, but got {v!r}")
        if v == 0:
            self.levels.append(None)
            return 0.0
        if math.isinf(v):  # no level holds it: the class is unbounded there and so is every bound it enters
            self.levels.append(None)
            return math.inf
        j = math.ceil(self.steps * math.log2(v))
        while self.level(j) < v:  # log2's rounding: the comparison, not the logarithm, decides
            j += 1
        while self.level(j - 1) >= v:
            j -= 1
        self.levels.append(j)
        return self.level(j)

    @property
    def count(self) -> int:
        return len(self.levels)

    @property
    def log_prior(self) -> float:
        """``sum ln(1/prior)`` over the recorded norms, rounded up: ``ln 2`` for the level 0 (and an
        unbounded norm), ``ln(3(|j| + 1)(|j| + 2))`` for ``G(j)``; one exact integer product, one logarithm."""
        product = 1
        for j in self.levels:
            product *= 2 if j is None else 3 * (abs(j) + 1) * (abs(j) + 2)
        return 0.0 if product == 1 else to_float(exact(product).ln(), "up")


def _up_value(grid: NormGrid, v):  # noqa: ANN001, ANN202
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, tuple):
        return tuple(grid.up(x) for x in v)
    return grid.up(v)


# The class bounds that are norms of the weights (read off them, so rounded and paid for); every other field
# (widths, eps, the score scale, flags, the RoPE length) is the architecture's and fixed before the data.
_LAYER_NORMS = ("B_KQ", "B_bKQ", "B_OV", "B_V", "B_O", "B_bout", "B_W1", "B_W2", "B_b1", "B_b2", "B_Wg", "B_bg",
                "B_Q", "B_K", "B_bQ", "B_bK", "qn_lip", "qn_out", "kn_lip", "kn_out")
_NORM_SITES = ("norm_attn", "norm_ffn", "post_norm_attn", "post_norm_ffn")
_LAYER_ARCH = ("index", "placement", "d_model", "activation", "attention_kind", "d_head", "has_query_bias",
               "has_output_bias", "has_b1", "has_b2", "has_bg", "residual", "has_rope_qk_bias", "has_q_norm",
               "has_k_norm", "softmax_scale", "has_b_Q", "has_b_K", "has_pos_bias", "rope_positions", "qk_joint")


def _grid_norm(grid: NormGrid, n):  # noqa: ANN001, ANN202
    if n is None:
        return None
    return replace(n, gamma_max=grid.up(n.gamma_max), beta_norm=grid.up(n.beta_norm))


def grid_class_bounds(bounds, grid: NormGrid):  # noqa: ANN001, ANN201
    """``bounds`` (a ``lipschitz.ClassBounds``) with every norm rounded up to ``grid`` (recorded there)."""
    layers = []
    for L in bounds.layers:
        names = {f.name for f in fields(L)}
        unknown = names.symmetric_difference((*_LAYER_NORMS, *_NORM_SITES, *_LAYER_ARCH))
        if unknown:  # every class-bound field must be classified here: a norm (rounded) or the architecture's
            raise AssertionError(f"grid_class_bounds does not know the layer bounds {sorted(unknown)}")
        kw = {n: _up_value(grid, getattr(L, n)) for n in _LAYER_NORMS}
        for site in _NORM_SITES:
            kw[site] = _grid_norm(grid, getattr(L, site))
        layers.append(replace(L, **kw))
    return replace(bounds, input_norm=_grid_norm(grid, bounds.input_norm), layers=tuple(layers),
                   final_norm=_grid_norm(grid, bounds.final_norm))
