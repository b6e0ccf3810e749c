"""The search of ``experiment nonvacuous`` over describable models, scored by the bound itself.

Every step here picks a model by looking at the training data; that is allowed because the
finite-class bound (THEORY F18) holds simultaneously for every model the code can describe.  A
step's score is the kl bound with the code length of the case's code (``bits``: the entropy code
:func:`~transcover.compress.description_bits` or the fixed-length comparison code
:func:`~transcover.compress.fixed_length_bits`) and the error on the first ``search_samples``
training samples, scaled to ``n`` (a heuristic for speed: the reported bound always counts every
training sample exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from ..compress import (
    ModelDescription,
    QuantisedTensor,
    best_scale_index,
    description_bits,
    fixed_length_bits,
    materialise,
    quantise,
    scale_of,
)
from ..covering import occam_bounds
from ..model import ReferenceConfig, ReferenceTransformer

__all__ = ["CODES", "describe", "mistakes", "search_align", "search_greedy", "search_prune", "search_refine"]

# The model codes a case can be bounded with: the prefix-free length function of each.
CODES: dict[str, Callable[[ModelDescription], int]] = {"entropy": description_bits, "fixed": fixed_length_bits}
Bits = Callable[[ModelDescription], int]


def describe(model: ReferenceTransformer, menu: tuple[ReferenceConfig, ...], arch: int,
             grid: dict[str, tuple[int, int]]) -> ModelDescription:
    """Quantise every parameter of ``model`` on its ``(m, k)`` grid; an all-zero tensor gets m = 0."""
    tensors = []
    for name, w in model.state_dict().items():
        m, k = grid[name]
        Q = quantise(w, m, k)
        if m == 0 or not bool(Q.any()):
            tensors.append(QuantisedTensor(name, 0, 0, torch.zeros_like(Q)))
        else:
            tensors.append(QuantisedTensor(name, m, k, Q))
    return ModelDescription(menu, arch, tuple(tensors))


@torch.no_grad()
def mistakes(desc: ModelDescription, X: Tensor, y: Tensor, batch: int = 8192) -> int:
    """Exact count of 0-1 errors of the described model (float64 forward, argmax, first index on ties)."""
    model = materialise(desc, torch.float64)
    wrong = 0
    for s in range(0, X.shape[0], batch):
        wrong += int((model(X[s : s + batch].double()).argmax(dim=-1) != y[s : s + batch]).sum())
    return wrong


def _scorer(X: Tensor, y: Tensor, delta: float, search_samples: int, bits: Bits) -> Callable[[ModelDescription], float]:
    n = X.shape[0]
    Xs, ys = X[:search_samples], y[:search_samples]

    def score(d: ModelDescription) -> float:
        return occam_bounds(min(n, round(mistakes(d, Xs, ys) * n / Xs.shape[0])), n, bits(d), delta).kl

    return score


def _zero_or(t: QuantisedTensor, Q: Tensor) -> QuantisedTensor:
    return QuantisedTensor(t.name, 0, 0, torch.zeros_like(Q)) if not Q.any() else QuantisedTensor(t.name, t.m, t.k, Q)


def search_greedy(desc: ModelDescription, model: ReferenceTransformer, X: Tensor, y: Tensor, delta: float,
                  passes: int, search_samples: int, bits: Bits = description_bits,
                  shared_scale: bool = False) -> ModelDescription:
    """Coordinate search over (m, k) per matrix minimising the kl bound of the quantised model.

    ``shared_scale``: every non-zero tensor keeps the one common scale index (the "one scale for
    the whole model" arm of the from-scratch check); only the level counts are searched.
    """
    score = _scorer(X, y, delta, search_samples, bits)
    state = model.state_dict()
    best, best_score = desc, score(desc)
    common = next((t.k for t in desc.tensors if t.m), 0)
    for _ in range(passes):
        improved = False
        for i, t in enumerate(best.tensors):
            w = state[t.name]
            for m in range(0, max(t.m, 1) + 1):
                base_k = best_scale_index(w, m)
                ks = (0,) if m == 0 else (common,) if shared_scale else (base_k, base_k + 2, base_k + 4, base_k + 8)
                for k in ks:
                    Q = quantise(w, m, k)
                    qt = QuantisedTensor(t.name, 0, 0, torch.zeros_like(Q)) if m == 0 or not Q.any() \
                        else QuantisedTensor(t.name, m, k, Q)
                    cand = replace(best, tensors=best.tensors[:i] + (qt,) + best.tensors[i + 1 :])
                    s = score(cand)
                    if s < best_score:
                        best, best_score, improved = cand, s, True
        if not improved:
            break
    return best


def search_prune(desc: ModelDescription, model: ReferenceTransformer, X: Tensor, y: Tensor, delta: float,
                 search_samples: int, max_evals: int = 60, bits: Bits = description_bits) -> ModelDescription:
    """Zero the non-zero integers whose weights are smallest relative to their scale, in chunks,
    while the kl bound improves; a rejected chunk is halved."""
    score = _scorer(X, y, delta, search_samples, bits)
    state = model.state_dict()
    order = []
    for i, t in enumerate(desc.tensors):
        if t.m:
            w = state[t.name].flatten().abs() / scale_of(t.k)
            order += [(float(w[j]), i, j) for j in torch.nonzero(t.Q.flatten()).flatten().tolist()]
    order.sort()

    def zeroed(best: ModelDescription, a: int, b: int) -> ModelDescription:
        by_tensor: dict[int, list[int]] = {}
        for _, i, j in order[a:b]:
            by_tensor.setdefault(i, []).append(j)
        tensors = list(best.tensors)
        for i, flat in by_tensor.items():
            Q = tensors[i].Q.clone().flatten()
            Q[flat] = 0
            tensors[i] = _zero_or(tensors[i], Q.reshape(tensors[i].Q.shape))
        return replace(best, tensors=tuple(tensors))

    return chunk_descent(desc, len(order), zeroed, score, first_chunk=max(1, len(order) // 16), max_evals=max_evals)


def chunk_descent(start: ModelDescription, n_moves: int, apply: Callable[[ModelDescription, int, int], ModelDescription],
                  score: Callable[[ModelDescription], float], *, first_chunk: int, max_evals: int) -> ModelDescription:
    """First-improvement descent over an ordered list of ``n_moves`` moves taken in chunks: ``apply(best, a,
    b)`` makes moves ``a..b-1`` on ``best``; a chunk that lowers ``score`` is kept and the next one tried, a
    rejected chunk is halved, a rejected single move skipped; at most ``max_evals`` scores."""
    best, best_score = start, score(start)
    pos, chunk, evals = 0, first_chunk, 0
    while pos < n_moves and evals < max_evals:
        cand = apply(best, pos, pos + chunk)
        s, evals = score(cand), evals + 1
        if s < best_score:
            best, best_score, pos = cand, s, pos + chunk
        elif chunk > 1:
            chunk //= 2
        else:
            pos += 1
    return best


def _moves(q: int, m: int) -> list[int]:
    """Candidate new values of one integer on its grid ``{-m..m}``, cheapest first: 0, one and two
    steps towards 0, one and two steps away; a zero may become +-1."""
    if q == 0:
        return [1, -1]
    s = 1 if q > 0 else -1
    out = dict.fromkeys(v for v in (0, q - s, q - 2 * s, q + s, q + 2 * s) if abs(v) <= m and v != q)
    return list(out)


def search_refine(desc: ModelDescription, X: Tensor, y: Tensor, delta: float, search_samples: int,
                  passes: int, bits: Bits = description_bits) -> ModelDescription:
    """Local search on the bound over the described model's integers and scales (first improvement).

    A sweep tries, for every integer of every non-zero tensor, the values of :func:`_moves` (the
    tensor keeps its grid ``(m, k)``), then for every non-zero tensor its scale index ``k +- 1, 2``
    with the same integers; a move is kept when it lowers the kl bound.  At most ``passes`` sweeps,
    fewer when one changes nothing.  Moves towards 0 shorten the entropy code (the histogram
    concentrates on 0 and the small levels); every move may change the training errors; the score
    weighs both exactly (digits: 218 integers, a sweep is about 600 forward passes over 1437
    images).  The float weights play no part: this searches the code's own models directly.
    """
    score = _scorer(X, y, delta, search_samples, bits)
    best, best_score = desc, score(desc)

    def put(i: int, t: QuantisedTensor) -> ModelDescription:
        return replace(best, tensors=best.tensors[:i] + (t,) + best.tensors[i + 1 :])

    for _ in range(passes):
        improved = False
        for i in range(len(best.tensors)):
            for j in range(best.tensors[i].Q.numel()):
                t = best.tensors[i]
                if not t.m:  # a zero tensor (or one the moves emptied) keeps m = 0
                    break
                flat = t.Q.flatten()
                for new in _moves(int(flat[j]), t.m):
                    Q = flat.clone()
                    Q[j] = new
                    cand = put(i, _zero_or(t, Q.reshape(t.Q.shape)))
                    s = score(cand)
                    if s < best_score:
                        best, best_score, improved = cand, s, True
                        break
        for i, t in enumerate(best.tensors):
            if not t.m:
                continue
            for dk in (-1, 1, -2, 2):
                cand = put(i, QuantisedTensor(t.name, t.m, t.k + dk, t.Q))
                s = score(cand)
                if s < best_score:
                    best, best_score, improved = cand, s, True
                    break
        if not improved:
            break
    return best


def _rescaling_groups(config: ReferenceConfig) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Pairs ``(up, down)`` of tensor names whose scales may move by ``+j`` and ``-j`` grid steps
    without changing the function: per block, ``W_Q`` against ``W_K`` (the scores use
    ``W_Q W_K^T`` only), ``W_V`` against ``W_O`` (the values use ``W_V W_O`` only) and, for the
    positively homogeneous ReLU (``relu(c z) = c relu(z)`` for ``c > 0``), ``(W_1, b_1)`` against
    ``W_2``.  Multiplying a grid scale ``2^{k/8}`` by ``2^{j/8}`` is the step ``k -> k + j``, so
    the integers stay as they are and only the headers change."""
    out = []
    for b in range(config.n_layers):
        p = f"blocks.{b}."
        out += [((p + "W_Q",), (p + "W_K",)), ((p + "W_V",), (p + "W_O",))]
        if config.activation == "relu":
            out.append(((p + "W_1",) + ((p + "b_1",) if config.ffn_bias else ()), (p + "W_2",)))
    return out


def _shifted(desc: ModelDescription, group: tuple[tuple[str, ...], tuple[str, ...]], j: int) -> ModelDescription:
    up, down = group
    tensors = tuple(QuantisedTensor(t.name, t.m, t.k + (j if t.name in up else -j if t.name in down else 0), t.Q)
                    if t.m else t for t in desc.tensors)
    return replace(desc, tensors=tensors)


def _relevelled(desc: ModelDescription, i: int, m: int) -> ModelDescription:
    t = desc.tensors[i]
    return replace(desc, tensors=desc.tensors[:i] + (QuantisedTensor(t.name, m, t.k, t.Q),) + desc.tensors[i + 1 :])


def search_align(desc: ModelDescription, X: Tensor, y: Tensor, delta: float, search_samples: int,
                 bits: Bits = description_bits, span: int = 24, rounds: int = 3) -> ModelDescription:
    """The same function under a shorter codeword: two kinds of moves that keep every weight.

    1. Move the grid scales of the rescaling pairs of :func:`_rescaling_groups` against each other
       (``j in [-span, span]`` steps), so that neighbouring tensors' scale indices agree: the delta
       headers of code version 3 then cost a bit or two instead of ~8.
    2. Give a non-zero tensor another level count ``m' >= max|Q|`` (up to the largest ``m`` of the
       model): the weights ``s_k Q`` are unchanged, and tensors with one ``m`` share one composition
       in the payload and a 1-bit ``m`` header, so a tensor whose integers fit a smaller grid can be
       cheaper on the common one.

    Coordinate descent on the code length.  Move 2 is exact; move 1 is exact in real arithmetic,
    so the (strictly shorter) result is kept only if its kl bound, scored like every other step on
    the model as the code decodes it (float64 rounding included), is not higher.  Zero tensors
    (``m = 0``) have no scale and stay as they are."""
    groups = _rescaling_groups(desc.menu[desc.arch])
    top = max((t.m for t in desc.tensors), default=0)
    best, best_len = desc, bits(desc)
    for _ in range(rounds):
        improved = False
        for g in groups:
            for j in range(-span, span + 1):
                if not j:
                    continue
                cand = _shifted(best, g, j)
                length = bits(cand)
                if length < best_len:
                    best, best_len, improved = cand, length, True
        for i, t in enumerate(best.tensors):
            if not t.m:
                continue
            for m in range(int(t.Q.abs().max()), top + 1):
                if m == best.tensors[i].m:
                    continue
                cand = _relevelled(best, i, m)
                length = bits(cand)
                if length < best_len:
                    best, best_len, improved = cand, length, True
        if not improved:
            break
    if best is desc:
        return desc
    score = _scorer(X, y, delta, search_samples, bits)
    return best if score(best) <= score(desc) else desc
