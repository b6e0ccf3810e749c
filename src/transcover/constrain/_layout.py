"""Where the per-head factors of a product (W_KQ^h, W_OV^h) live inside a real weight tensor.

Every supported architecture stores W_Q^h, W_K^h, W_V^h and W_O^h differently: the reference model
keeps them stacked ``(H, d, d_head)``, ``nn.Linear`` keeps ``(out, in)`` with heads as row blocks,
GPT-2's ``Conv1D`` keeps ``(in, out)`` with heads as column blocks, ``nn.MultiheadAttention`` fuses
Q, K and V into one ``in_proj_weight`` of shape ``(3 d, d)``.  A :class:`HeadLayout` names one of
these storage schemes so that a product constraint can (i) read the factor of every head as a
``(H, d, d_head)`` stack in the row-vector convention of ``transcover.model._spec`` and (ii) scale
each head's block of the tensor by a per-head factor without touching anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["HeadLayout"]

_KINDS = ("stacked", "stacked_t", "rows", "cols")


@dataclass(frozen=True)
class HeadLayout:
    """How a tensor holds the ``(d, d_head)`` factor of each of ``n_heads`` heads.

    * ``stacked``:   tensor ``(H, d, d_head)``; head h is ``T[h]``  (reference W_Q, W_K, W_V).
    * ``stacked_t``: tensor ``(H, d_head, d)``; head h is ``T[h].T`` (reference W_O, read as W_O^hT).
    * ``rows``:      head h is ``T[offset + h*dh : offset + (h+1)*dh, :].T`` (``nn.Linear`` Q/K/V
      weights, fused ``in_proj_weight`` with ``offset`` 0, d, 2d; GPT-2 ``c_proj`` as W_O^T).
    * ``cols``:      head h is ``T[:, offset + h*dh : offset + (h+1)*dh]`` (GPT-2 ``c_attn``;
      ``nn.Linear`` output projection read as W_O^hT).
    """

    kind: str
    n_heads: int
    d_head: int
    offset: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"layout kind must be one of {_KINDS}, but got kind={self.kind!r}")

    @property
    def width(self) -> int:
        return self.n_heads * self.d_head

    def heads(self, T: Tensor) -> Tensor:
        """The factor of every head, ``(H, d, d_head)`` (a view where possible)."""
        H, dh, o = self.n_heads, self.d_head, self.offset
        if self.kind == "stacked":
            return T
        if self.kind == "stacked_t":
            return T.transpose(-1, -2)
        if self.kind == "rows":
            d = T.shape[1]
            return T[o : o + H * dh].reshape(H, dh, d).transpose(1, 2)  # (H, d, dh)
        d = T.shape[0]
        return T[:, o : o + H * dh].reshape(d, H, dh).permute(1, 0, 2)  # (H, d, dh)

    def multiplier(self, T: Tensor, f: Tensor) -> Tensor:
        """A tensor broadcastable to ``T`` that is ``f[h]`` on head h's block and 1 elsewhere."""
        if self.kind in ("stacked", "stacked_t"):
            return f[:, None, None]
        per_index = f.repeat_interleave(self.d_head)  # (H * dh,)
        axis = 0 if self.kind == "rows" else 1
        n = T.shape[axis]
        if self.offset or self.width != n:
            ones = torch.ones(n, dtype=f.dtype, device=f.device)
            per_index = torch.cat([ones[: self.offset], per_index, ones[self.offset + self.width :]])
        return per_index[:, None] if axis == 0 else per_index[None, :]

    def check(self, T: Tensor, what: str) -> None:
        """Raise ``ValueError`` naming ``what`` when ``T`` cannot hold this layout."""
        H, dh, o = self.n_heads, self.d_head, self.offset
        ok = {
            "stacked": T.dim() == 3 and T.shape[0] == H and T.shape[2] == dh,
            "stacked_t": T.dim() == 3 and T.shape[0] == H and T.shape[1] == dh,
            "rows": T.dim() == 2 and T.shape[0] >= o + H * dh,
            "cols": T.dim() == 2 and T.shape[1] >= o + H * dh,
        }[self.kind]
        if not ok:
            raise ValueError(f"{what} has shape {tuple(T.shape)}, which cannot hold {self}")
