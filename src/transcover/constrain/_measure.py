"""Norms of the weights a constrained model actually computes with: exact (float64) and certified.

"Actually computes with" means the parametrized value in eval mode: a spectral or product cap
then reuses its stored power-iteration vectors without refining them, which is bit for bit what
the training forward used right after it refined them (the vectors are not touched again before
the optimiser step), and what evaluation and export use.

* :func:`exact_slot_norms`: float64 SVD (products through the QR core of Note [product
  projection], O(d k^2) per head, never forming the d x d product); kind *exact* up to float64
  rounding (~1e-15 relative), not a certificate.
* :func:`certified_model_norms` / :func:`certified_slot_uppers`: what the monitors and the training
  result call *certified*: ``transcover.norms.measure_model`` on the spec of the module's forward
  weights (``model.spec_from_module`` of a plain, detached copy; float64 inside ``measure_model``),
  the same measurement ``transcover analyze``/``bound`` make of a saved model (Note [one engine] in
  ``norms._model``).  One source of truth: the history never certifies a matrix any other way.
* :func:`certified_slot_norm`: the per-slot certificate :meth:`Constrainer.finalize` checks its
  projections with (one slot at a time, re-measured after each retry; not recorded anywhere).

The exact norms are training signals (penalties, projections, the per-step monitor columns
``sigma.<G>``), never certificates.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .._results import rounding_pad
from ._projection import certified_product_sigma, certified_sigma, certified_vector_norm
from ._slots import Slot

__all__ = ["forward_weights", "exact_slot_norms", "certified_slot_norm", "product_sigmas", "certified_model_norms",
           "certified_slot_uppers"]


@contextmanager
def forward_weights(model: nn.Module):
    """Eval mode for reading parametrized values without advancing any power iteration."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def product_sigmas(A: Tensor, B: Tensor, scale: float) -> Tensor:
    """``||scale A_h B_h^T||_2`` per head in float64: QR of both factors, SVD of the k x k core."""
    A64, B64 = A.detach().double(), B.detach().double()
    _, Ra = torch.linalg.qr(A64)
    _, Rb = torch.linalg.qr(B64)
    return torch.linalg.matrix_norm(scale * Ra @ Rb.transpose(-1, -2), 2)


def _values(slot: Slot) -> list[Tensor]:
    """The tensors ``slot``'s norm reads: both factors of a product, else the one tensor."""
    return [slot.value("a"), slot.value("b")] if slot.kind == "product" else [slot.value()]


def exact_slot_norms(slot: Slot) -> Tensor:
    """Float64 norms of ``slot``'s current value (per head for products; call inside :func:`forward_weights`).

    Raises:
        InputError: a value with NaN or infinite entries (torch's SVD raised a bare LinAlgError, stop 38).
    """
    from .._errors import check_finite_tensor

    values = [check_finite_tensor(v, f"the weights of {slot.key}") for v in _values(slot)]
    if slot.kind == "product":
        return product_sigmas(*values, slot.scale)
    if slot.kind == "matrix":
        return torch.linalg.matrix_norm(values[0].detach().double(), 2)
    return values[0].detach().double().norm()


def _certified(slot: Slot, values: list[Tensor]) -> float:
    if slot.kind == "product":
        A, B = values
        return max(certified_product_sigma(A[h], B[h], slot.scale) for h in range(A.shape[0]))
    (W,) = values
    if slot.kind == "matrix":
        return max(certified_sigma(Wi) for Wi in W.reshape(-1, *W.shape[-2:]))
    return certified_vector_norm(W)


def certified_slot_norm(slot: Slot, cast: torch.dtype | None = None) -> float:
    """Certified upper bound on the largest norm of ``slot``'s current value (max over heads); with ``cast``, of
    that value and of its rounding to ``cast`` (the weights a ``torch.autocast`` forward computes with), whichever
    is larger.

    Raises:
        InputError: a value that overflows ``cast``.
    """
    values = _values(slot)
    out = _certified(slot, values)
    if cast is not None:
        from .._errors import InputError

        casts = [v.to(cast) for v in values]
        if not all(bool(torch.isfinite(c).all()) for c in casts):  # beyond the forward dtype's range
            raise InputError(f"the weights of {slot.key} overflow {cast} (the forward dtype): no norm bound holds there")
        out = max(out, _certified(slot, casts))
    return out


def certified_model_norms(model: nn.Module):  # -> transcover.norms.ModelNorms
    """``measure_model`` of the weights ``model`` computes with (eval-mode values of every cap).

    A plain deep copy (``export_plain(certify=False)``: the caps' values, nothing projected) goes
    through the module adapter of ``transcover.model.spec_from_module``, so the live parameters are
    never touched.  Returns the :class:`~transcover.norms.ModelNorms` and, for an MLP head, its
    matrices' certified intervals (``norms.matrix_interval``) as a tuple.
    """
    from ..model import spec_from_module
    from ..norms import matrix_interval, measure_model
    from ._export import export_plain

    with forward_weights(model):
        plain = export_plain(model, certify=False).eval()
    spec = spec_from_module(plain)
    head = () if spec.head is None else tuple(matrix_interval(W) for W in spec.head.weights)
    return measure_model(spec), head


def _bias_upper(b: float | None, n: int) -> float:
    """A certified upper end of ``||b||_2`` from its float64 value: one rounding pad (Note
    [rounding pad] in ``transcover._results``: a float64 vector norm)."""
    return 0.0 if b is None else b * (1.0 + rounding_pad(terms=n + 2))


def certified_slot_uppers(model: nn.Module, slots: list[Slot], measured=None) -> dict[str, float]:  # noqa: ANN001
    """Per slot key, the certified upper end of its largest norm (max over heads), read from
    :func:`certified_model_norms` (or ``measured``, its result): ``KQ`` from ``HeadMeasure.W_KQ``
    (scaled by the layer's softmax scale), ``OV`` from ``W_OV``, ``W1``/``W2`` from ``W_1``/``W_2``,
    biases from ``b_1``/``b_2`` rounded up, ``head`` from the MLP head's matrices."""
    norms, head = certified_model_norms(model) if measured is None else measured
    out: dict[str, float] = {}
    for s in slots:
        if s.group == "head":
            out[s.key] = head[s.layer].upper
            continue
        L = norms.layers[s.layer]
        if s.group == "KQ":
            out[s.key] = max(h.W_KQ(L.scale).upper for h in L.heads)
        elif s.group == "OV":
            out[s.key] = max(h.W_OV.upper for h in L.heads)
        elif s.group in ("W1", "W2"):
            out[s.key] = (L.W_1 if s.group == "W1" else L.W_2).upper
        else:
            n = L.shapes["W_1"][1] if s.group == "b1" else L.d_model
            out[s.key] = _bias_upper(L.b_1 if s.group == "b1" else L.b_2, n)
    return out
