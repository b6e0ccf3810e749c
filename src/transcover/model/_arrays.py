"""Backend-neutral helpers: a spec's arrays are numpy arrays (read from files) or torch tensors.

Note [no torch on the file path]: models read from files carry numpy arrays (read from
safetensors), so ``transcover analyze`` never imports torch, which alone costs about 1.7 s of
start-up.  Live modules and pickles carry torch tensors.  These helpers work on both without
importing torch: an object can only be a torch tensor when torch has already been imported, so
``sys.modules`` tells which backend an array belongs to.  Forward passes (``_functional``) convert
numpy arrays to torch tensors with :func:`to_tensor`, importing torch there.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = [
    "is_tensor", "is_floating", "dtype_name", "contiguous", "permute", "concat",
    "to_tensor", "max_abs", "norm2_f64", "astype_like_storage",
]


def is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor (False without importing torch when torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_floating(x: Any) -> bool:
    return bool(x.is_floating_point()) if is_tensor(x) else np.issubdtype(x.dtype, np.floating)


def dtype_name(x: Any) -> str:
    """``"float32"``, ``"bfloat16"``, ``"int64"``... for either backend (torch's spelling)."""
    return str(x.dtype).removeprefix("torch.")


def contiguous(x: Any) -> Any:
    return x.contiguous() if is_tensor(x) else np.ascontiguousarray(x)


def permute(x: Any, *axes: int) -> Any:
    """``x.permute(*axes)`` (torch) / ``x.transpose(axes)`` (numpy), made contiguous."""
    return x.permute(*axes).contiguous() if is_tensor(x) else np.ascontiguousarray(x.transpose(axes))


def concat(parts: list[Any], axis: int = 0) -> Any:
    if is_tensor(parts[0]):
        import torch

        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


def to_tensor(x: Any, like: Any = None, dtype: Any = None) -> Any:
    """A torch tensor of ``x`` with the dtype of ``like`` (a tensor) or ``dtype``; imports torch.

    Numpy arrays are copied only when they are read-only (``torch.from_numpy`` warns on those) or
    need a dtype conversion; torch tensors are returned as they are when the dtype already matches.
    """
    import torch

    if dtype is None and like is not None:
        dtype = like.dtype
    if not isinstance(x, torch.Tensor):
        x = np.asarray(x)
        if not x.flags.writeable:
            x = np.array(x)
        x = torch.from_numpy(x)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def max_abs(x: Any) -> float:
    return float(x.abs().max()) if is_tensor(x) else float(np.abs(x).max())


def norm2_f64(x: Any) -> float:
    """||x||_2 of all entries, accumulated in float64."""
    if is_tensor(x):
        return float(x.detach().double().norm())
    return float(np.linalg.norm(np.asarray(x, dtype=np.float64).ravel()))


def astype_like_storage(x: Any, name: str) -> Any:
    """``x`` converted to the float dtype named ``name`` ("float32"/"float64"), either backend."""
    if is_tensor(x):
        import torch

        return x.to(getattr(torch, name))
    return np.asarray(x, dtype=np.dtype(name))
