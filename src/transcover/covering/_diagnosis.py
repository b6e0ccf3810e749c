"""Why a generalisation bound is vacuous, and which option would tighten it (issue 12 item 6).

A vacuous bound (``raw gap >= b``, Note [trivial gap bound] in ``_generalisation``) is still
informative if it says *where* it comes from.  The gap is ``2 R + concentration`` (THEORY F11);
``R`` is Dudley's integral of ``sqrt(log N(eps))``, and ``log N`` is a sum over matrices
(THEORY F9, Lemma G.1).  :func:`diagnose` reads those pieces off a :class:`ModelBound`: which of
the two gap terms dominates, the matrices and layers with the largest share of ``log N``, each
certified route's value, and the sample size at which the same class gets a non-vacuous bound.
Every number it reports is one the bound already computed or a certified bound of the same kind
(the sample-size search uses the same covering curve); the suggestions are labelled as advice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._printed import count_exact, count_up, up
from .._results import as_dict

__all__ = ["Diagnosis", "diagnose"]


@dataclass(frozen=True)
class Diagnosis:
    """What dominates a covering/generalisation bound and what would tighten it.

    ``dominant_term``: per sample size, ``"rademacher"`` (the covering term ``2R``) or
    ``"concentration"`` (``3b sqrt((ln(2/delta) + ln(1/prior))/(2n))``).  ``top``: ``(matrix, layer, cover, share
    of log N, log10 c_i)`` of the largest contributions, the MLP head's matrices (``head.W_j``, layer
    ``"head"``) ranked with the Transformer's; ``layers``: share of ``log N`` per layer and ``"head"``.
    Shares are of the whole class's ``log N`` (Theorem G.5's sum of the head's and the Transformer's).
    ``routes``: ``log10 log N`` at eps per cover family.  ``n_non_vacuous``: the smallest n (to 0.01
    in log10, as printed) whose certified gap (:meth:`ModelBound.gap_at`) is below the loss range,
    ``inf`` if none up to 1e300; ``None`` when the bound is not vacuous (nothing to search).
    ``suggestions``: advice, one line each (not certified claims).
    """

    vacuous: bool
    dominant_term: tuple[str, ...]
    top: tuple[tuple[str, int | str, str, float, float], ...]
    layers: tuple[tuple[int | str, float], ...]
    routes: dict[str, float]
    route: str
    n_non_vacuous: float | None
    suggestions: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, object]:
        return as_dict(
            self, exclude=("routes",), routes_log10_log_N=dict(self.routes),
            top=[{"matrix": m, "layer": ly, "cover": c, "share": s, "log10_c": lc} for m, ly, c, s, lc in self.top],
            layers=[{"layer": ly, "share": s} for ly, s in self.layers],
            n_non_vacuous=(None if self.n_non_vacuous is None else self.n_non_vacuous
                           if math.isfinite(self.n_non_vacuous) else "> 1e300"),
        )


def _fmt(ln_value: float) -> str:
    from .._printed import log10_up

    return f"10^{log10_up(ln_value, decimals=2)}"


def _shares(result, top: int):
    """The ``top`` largest terms and the per-layer split, as shares of the whole class's ``log N``: with an MLP head
    (Theorem G.5) its matrices are ranked with the Transformer's and summed as layer ``"head"`` (red team 198: a
    checkpoint's head held 47 % of log N and the diagnosis named only the Transformer's terms)."""
    rows = result.class_terms()
    if result.covering.log_log_N == -math.inf:  # log N = 0: no term and no layer has a share of it
        return (), ()
    ranked = sorted((r for r in rows if r[2].log_cost > -math.inf), key=lambda r: r[2].log_cost, reverse=True)
    top_rows = tuple((name, ly, c.cover, s, c.log_c / math.log(10)) for name, ly, c, s in ranked[:top])
    return top_rows, tuple(sorted(_layer_shares(rows).items(), key=lambda kv: kv[1], reverse=True))


def _layer_shares(rows) -> dict[int | str, float]:  # noqa: ANN001
    """``{layer: share}`` summed over :meth:`ModelBound.class_terms` rows."""
    out: dict[int | str, float] = {}
    for _, ly, _, s in rows:
        out[ly] = out.get(ly, 0.0) + s
    return out


def _names(rows) -> str:  # noqa: ANN001
    return ", ".join(f"{m} ({s:.0%})" for m, _, _, s, _ in rows)


def _data_tips(gens, n_nv: float | None, log_prior: float) -> list[str]:  # noqa: ANN001
    """Advice on n for a vacuous bound: from which n the class is non-vacuous, against each n given (red team 198:
    "now n <= 1e9" where 1e9 already was), and the concentration term where it alone reaches b (checked, not
    inferred from which term dominates), with the prior that is part of it."""
    b = gens[0].loss_bound
    vac, fine = [g.n for g in gens if g.vacuous], [g.n for g in gens if not g.vacuous]
    given = f"vacuous at n = {_ns(vac)}" + (f", non-vacuous at n = {_ns(fine)}" if fine else "")
    if n_nv is not None and math.isfinite(n_nv):
        tips = [f"more data: the same class has a non-vacuous certified gap from n ~ {count_up(n_nv)} ({given}); "
                "log N grows only as log(nT)"]
    else:
        tips = [f"more data alone does not help: no n up to 1e300 gives a gap below the loss range ({given})"]
    over = [g for g in gens if g.concentration >= b]
    if over:
        form = ("3b sqrt((ln(2/delta) + ln(1/prior))/(2n)), ln(1/prior) = "
                f"{up(log_prior, 4)} nats for the norm grid (F102)," if log_prior else "3b sqrt(ln(2/delta)/(2n))")
        at = ", ".join(f"{up(g.concentration, 4)} at n = {count_exact(g.n)}" for g in over)
        tips.append(f"concentration: the term {form} is {at}, alone >= the loss range b = {b:g}: "
                    "more data lowers it as 1/sqrt(n)")
    return tips


def _ns(ns) -> str:  # noqa: ANN001
    return ", ".join(count_exact(n) for n in ns)  # the n given, exactly (red team 215)


def diagnose(result, *, top: int = 3) -> Diagnosis:
    """Read a :class:`~transcover.covering.ModelBound` for the terms that dominate it.

    Args:
        result: the output of :func:`~transcover.covering.model_bound`.
        top: how many matrices to name.
    """
    gens = result.generalisation
    vacuous = any(g.vacuous for g in gens)
    dom = tuple("rademacher" if 2.0 * g.rademacher.value >= g.concentration else "concentration" for g in gens)
    tf = result.transformer
    top_rows, layers = _shares(result, top)
    routes = {k: v / math.log(10) for k, v in result.routes.items()}
    route = result.route or result.family
    b = gens[0].loss_bound
    opts = result.options
    n_nv: float | None = None  # searched only for a vacuous bound (the search costs ~16 Dudley integrals)
    if vacuous and result.curve is not None:
        # just below b: the reported gap is min(raw, b), so "< b" means the formula itself is below b; searched on
        # the very gap the result reports (its class, prior and quadrature: THEORY F102, red team 198)
        n_nv = result.n_for_gap(b * (1.0 - 1e-6))
    tips: list[str] = _data_tips(gens, n_nv, result.log_prior) if vacuous else []
    if result.covering.log_log_N == -math.inf:  # red team 198: "largest terms (0%)" and "--sigma-min would shrink it"
        tips.append("log N = 0: the class is a single function at this scale (every matrix it could vary is at "
                    "distance 0 from the reference or has coefficient 0), so no option on the weights, norms or "
                    "LayerNorm constants can shrink the covering term: the gap is the concentration term")
        return Diagnosis(vacuous, dom, top_rows, layers, routes, route, n_nv, tuple(tips))
    best = min(routes, key=routes.get) if routes else route
    if routes and routes[best] < routes.get(route, math.inf):
        tips.append(f"family: --family {best} gives log N = {_fmt(result.routes[best])} instead of "
                    f"{_fmt(result.routes[route])}")
    par = [r for r in top_rows if r[2].startswith("parametric")]
    norm = [r for r in top_rows if not r[2].startswith("parametric")]
    if par:
        tips.append(f"constraints / size: the largest terms {_names(par)} are parameter-count covers "
                    "p ln(1 + 2B/eps_i): fewer parameters (smaller or sparser matrices) shrink them "
                    "most; norm caps and smaller downstream constants act only through the log")
    if norm:
        tips.append(f"constraints: the largest terms {_names(norm)} are norm-based covers ~ (c_i ||W||_(2,1))^2/eps^2: "
                    "train under norm caps (transcover train --method project --radius GROUP=C) "
                    "or lower the downstream constants c_i")
    if float(opts.get("sigma_min", 0.0)) == 0.0 and "LayerNorm: global" in " ".join(result.assumptions):
        worst = max((c.log_c for c in tf.contributions if c.log_c > -math.inf), default=-math.inf)
        # bound has no --data (red team 198): the certified local constants are lipschitz's, not used here
        tips.append("LayerNorm: every c_i carries the global constant max|gamma|/sqrt(eps) (largest c_i = "
                    f"{_fmt(worst) if math.isfinite(worst) else 'n/a'}); --sigma-min S, an assumed floor S on every "
                    "LayerNorm input's std (an assumption on the inputs, listed with the bound), would shrink it; "
                    "certified local constants at given inputs are reported by `transcover lipschitz --data`, "
                    "which bound does not use")
    if not opts.get("reference", False):
        tips.append("reference: --reference INIT measures distances from the initialisation instead of 0 "
                    "(a smaller ball when training moved the weights little)")
    return Diagnosis(vacuous, dom, top_rows, layers, routes, route, n_nv, tuple(tips))
