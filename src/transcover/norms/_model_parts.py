"""Two pieces of :func:`~transcover.norms.measure_model` kept out of ``_model`` (private): the
distances of *split* scores (Note [split scores] in ``_model``: RoPE with query/key biases, THEORY
F22; query/key normalisation, F23) and the per-expert intervals of a mixture of experts (F29).

They use ``_model``'s one route per matrix (imported when called: ``_model`` imports this module).
"""

from __future__ import annotations

from .._results import Interval, Kind
from ..model import AttentionSpec, MoESpec
from . import _entrywise

__all__ = ["split_scores", "split_distances", "moe_intervals"]


def split_scores(a: AttentionSpec) -> bool:
    """Whether the scores are not a function of ``W_Q W_K^T`` and the folded query bias: RoPE with
    query/key biases (THEORY F22) or query/key normalisation (F23); Note [split scores]."""
    return (a.rope is not None and (a.b_Q is not None or a.b_K is not None)) or a.q_norm is not None \
        or a.k_norm is not None


def split_distances(aa: AttentionSpec, ab: AttentionSpec, i: int, entrywise: bool) -> dict:
    """Note [split scores]: ``||dW_Q^h||``, ``||dW_K^kv||`` (spectral), ``||db_Q^h||``, ``||db_K^kv||``
    (l2, absent = zeros) per query head, and ``||d gamma||_inf`` of the query/key norms."""
    from .._errors import InputError
    from ._model import Distance, _diff, _np, matrix_interval

    if aa.softmax_scale != ab.softmax_scale:
        raise InputError(f"layer {i}: the two models' softmax scales differ ({aa.softmax_scale!r} vs "
                         f"{ab.softmax_scale!r}) under RoPE with query/key biases or query/key normalisation, "
                         "where Lemma G.3 charges W_Q and W_K separately (THEORY F22/F23): not bounded")
    out: dict[tuple[int, str], Distance] = {}
    for h in range(aa.n_heads):
        for role, ma, mb in (("W_Q", aa.W_Q[h], ab.W_Q[h]), ("W_K", aa.W_K[aa.kv_index(h)], ab.W_K[ab.kv_index(h)])):
            D = _diff(ma, mb, f"layer {i} {role} head {h}")
            out[(i, f"{role}.{h}")] = Distance("spectral", matrix_interval(D).upper,
                                               _entrywise.l21_interval(_np(D)).upper if entrywise else None)
        for role, ba, bb, g in (("b_Q", aa.b_Q, ab.b_Q, h), ("b_K", aa.b_K, ab.b_K, aa.kv_index(h))):
            if ba is not None or bb is not None:
                va = None if ba is None else ba[g]
                vb = None if bb is None else bb[g]
                out[(i, f"{role}.{h}")] = Distance("l2", float(_diff(va, vb, f"layer {i} {role} head {h}").norm()))
    for role, na, nb in (("q_norm", aa.q_norm, ab.q_norm), ("k_norm", aa.k_norm, ab.k_norm)):
        if na is None:
            continue
        if float(na.eps) != float(nb.eps):
            raise InputError(f"layer {i}: the two models' {role} variance floors differ ({na.eps!r} vs "
                             f"{nb.eps!r}); Lemma G.3 for query/key normalisation (THEORY F23) needs one eps")
        out[(i, f"{role}.gamma")] = Distance(
            "linf", float(_diff(na.weight, nb.weight, f"layer {i} {role} weight", 1.0).abs().max()))
    return out


def moe_intervals(moe: MoESpec, entrywise: bool) -> tuple[dict, dict, dict, dict[str, Interval]]:
    """A mixture of experts' (spectral, l21, shapes) of W_1, W_2, W_gate, each the max over the experts
    (``max_e ||W_e||`` lies in ``[max_e lower_e, max_e upper_e]``), and every expert's, the router's and a
    shared expert's own certified interval (THEORY F29)."""
    from ._model import _np, matrix_interval

    own: dict[str, Interval] = {}
    spectral: dict[str, Interval | None] = {}
    l21: dict[str, Interval] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for role in ("W_1", "W_2", "W_gate"):
        W = getattr(moe, role)
        if W is None:
            spectral[role] = None
            continue
        ivs = []
        for e in range(moe.n_experts):
            We = _np(W[e])
            own[f"expert.{e}.{role}"] = iv = matrix_interval(We)
            ivs.append((iv, _entrywise.l21_interval(We) if entrywise else None))
        shapes[role] = tuple(W.shape[1:])
        spectral[role] = Interval(max(i.lower for i, _ in ivs), max(i.upper for i, _ in ivs),
                                  Kind.CERTIFIED_INTERVAL, "max over experts")
        if entrywise:
            l21[role] = Interval(max(x.lower for _, x in ivs), max(x.upper for _, x in ivs),
                                 Kind.CERTIFIED_INTERVAL, "max over experts")
    own["router"] = matrix_interval(_np(moe.W_router))
    if moe.shared is not None:
        for role in ("W_1", "W_2", "W_gate"):
            own[f"shared.{role}"] = matrix_interval(_np(getattr(moe.shared, role)))
    return spectral, l21, shapes, own
