"""The capacity of a construction, in the quantities the covering bounds consume (seed 2.1, F9/F10).

``B_KQ = max_h ||W_KQ^h||_2`` (``W_KQ^h = W_Q^h W_K^hT / sqrt(d_head)``), ``B_V = max_h ||W_OV^h||_2``,
the spectral norms of the MLP head's layers and their product (a Lipschitz bound of the head), and
the non-zero parameter count.  Float64 SVD norms (``Kind.ESTIMATE`` up to rounding): the certified
intervals are ``transcover.norms``' job, which reads the same ``reference_spec``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._results import Kind
from ..model import reference_spec
from ._construction import Construction

__all__ = ["Capacity", "construction_capacity"]


@dataclass(frozen=True)
class Capacity:
    B_KQ: float
    B_V: float
    head_norms: tuple[float, ...]
    head_lipschitz: float  # product of the head's spectral norms (ReLU is 1-Lipschitz)
    n_params: int
    n_nonzero: int
    kind: Kind = Kind.ESTIMATE

    def to_dict(self) -> dict[str, object]:
        return {"B_KQ": self.B_KQ, "B_V": self.B_V, "head_norms": list(self.head_norms),
                "head_lipschitz": self.head_lipschitz, "n_params": self.n_params,
                "n_nonzero": self.n_nonzero, "kind": self.kind.value}


def _sn(W: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(W.double(), 2))


def construction_capacity(c: Construction) -> Capacity:
    """Norms of the construction read from its spec (so they are what ``analyze`` would see)."""
    spec = reference_spec(c.model, name="lemma-H.1 construction")
    attn = spec.layers[0].attention
    scale = attn.softmax_scale
    B_KQ = max(_sn(scale * attn.W_Q[h] @ attn.W_K[h].T) for h in range(attn.n_heads))
    B_V = max(_sn(attn.W_V[h] @ attn.W_O[h]) for h in range(attn.n_heads))
    norms = tuple(_sn(W) for W in spec.head.weights)
    params = list(c.model.parameters())
    return Capacity(B_KQ, B_V, norms, math.prod(norms), sum(p.numel() for p in params),
                    sum(int(torch.count_nonzero(p)) for p in params))
