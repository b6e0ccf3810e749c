"""Norms of the weights a constrained model actually computes with: exact (float64) and certified.

"Actually computes with" means the parametrized value in eval mode: a spectral or product cap
then reuses its stored power-iteration vectors without refining them, which is bit for bit what
the training forward used right after it refined them (the vectors are not touched again before
the optimiser step), and what evaluation and export use.

* :func:`exact_slot_norms`: float64 SVD (products through the QR core of Note [product
  projection], O(d k^2) per head, never forming the d x d product); kind *exact* up to float64
  rounding (~1e-15 relative), not a certificate.
* :func:`certified_slot_norm`: ``transcover.norms`` (Gram + Cholesky certificates), a certified
  upper bound on the stored values (upcast to float64 exactly).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ._projection import certified_product_sigma, certified_sigma, certified_vector_norm
from ._slots import Slot

__all__ = ["forward_weights", "exact_slot_norms", "certified_slot_norm", "product_sigmas"]


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


def exact_slot_norms(slot: Slot) -> Tensor:
    """Float64 norms of ``slot``'s current value (per head for products; call inside :func:`forward_weights`)."""
    if slot.kind == "product":
        return product_sigmas(slot.value("a"), slot.value("b"), slot.scale)
    if slot.kind == "matrix":
        return torch.linalg.matrix_norm(slot.value().detach().double(), 2)
    return slot.value().detach().double().norm()


def certified_slot_norm(slot: Slot) -> float:
    """Certified upper bound on the largest norm of ``slot``'s current value (max over heads)."""
    if slot.kind == "product":
        A, B = slot.value("a"), slot.value("b")
        return max(certified_product_sigma(A[h], B[h], slot.scale) for h in range(A.shape[0]))
    if slot.kind == "matrix":
        W = slot.value()
        if W.dim() == 2:
            return certified_sigma(W)
        return max(certified_sigma(Wi) for Wi in W.reshape(-1, *W.shape[-2:]))
    return certified_vector_norm(slot.value())
