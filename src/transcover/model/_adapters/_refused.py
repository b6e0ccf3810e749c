"""Architectures recognised but outside the decomposition, each refused with what bounding it would need.

:class:`OutsideDecompositionError` (an :class:`~transcover.UnsupportedArchitectureError`) marks
"the layers cannot be written as the seed's blocks": ``transcover analyze`` then falls back to the
per-matrix report (``transcover.norms._per_matrix``), while every bound that needs the
architecture (``lipschitz``, ``bound``, ``perturb``) refuses with the same line.
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._sources import TensorSource
from .._spec import TransformerSpec

__all__ = ["OutsideDecompositionError", "build_deberta_v2", "DEBERTA_REASON", "MOE_REASON", "moe_refusal"]


class OutsideDecompositionError(UnsupportedArchitectureError):
    """The architecture is unknown or its blocks are not the seed's; per-matrix norms still apply."""


#: DeBERTa(-v2)'s disentangled attention (He et al. 2021, eq. 4; transformers
#: ``DisentangledSelfAttention``): the score of query i and key j is
#: ``q_i k_j^T + q_i (k^r_{δ(i,j)})^T + k_j (q^r_{δ(j,i)})^T`` scaled by ``1/sqrt(3 d_head)``, with
#: ``q^r, k^r`` projections of relative-position embeddings shared by all layers.  The seed's head
#: has one bilinear form ``x_i W_KQ x_j^T``; the two extra terms are linear in one token each with
#: position-dependent coefficients.
DEBERTA_REASON = (
    "disentangled attention adds content-to-position and position-to-content scores "
    "(q_i·k^r_δ(i,j) + k_j·q^r_δ(j,i)) to q_i·k_j; bounding it would need per-head norms of the maps "
    "x -> x W_Q (W_K,r R_δ)^T and x -> x W_K (W_Q,r R_δ)^T over the relative embeddings R and "
    "their Lipschitz terms in the attention bound, which the decomposition does not have"
)


def build_deberta_v2(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    kinds = config.get("pos_att_type") or []
    if config.get("relative_attention") and kinds:
        raise OutsideDecompositionError(f"deberta_v2: {DEBERTA_REASON}; refused ({name})")
    # Without relative attention the scores are q_i·k_j alone, but the block still differs
    # (the 1/sqrt(scale_factor d_head) scale, the optional conv layer); refused rather than guessed.
    raise OutsideDecompositionError(
        f"deberta_v2 without relative attention is not mapped onto the decomposition either "
        f"(no adapter reads its attention scale factor or conv layer); refused ({name})"
    )


#: Mixture-of-experts FFNs with top-k routing (Mixtral, Qwen-MoE): THEORY F25.  Read by the MoE
#: adapter (``_moe``); every bound that needs a Lipschitz constant refuses with this line.
MOE_REASON = (
    "its FFN routes each token to the top-k experts, and when the selected set changes an expert's "
    "weight jumps from 0, so the block is discontinuous and has no Lipschitz constant (THEORY F25); "
    "a bound would need a dense router or inputs away from the switching set"
)


def moe_refusal(layer: int, detail: str = "") -> UnsupportedArchitectureError:
    """The one refusal of every bound that needs a Lipschitz constant of an MoE layer (F25), in one line."""
    return UnsupportedArchitectureError(f"layer {layer} is a mixture of experts: {MOE_REASON}" + (f"; {detail}" if detail else ""))
