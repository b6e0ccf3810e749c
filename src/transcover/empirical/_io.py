"""Reading a finite class's outputs from disk (.npy, .pt, .safetensors)."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from .._errors import InputError
from ._metrics import as_outputs

__all__ = ["load_outputs"]


def load_outputs(path: str | Path, key: str | None = None, *, allow_pickle: bool = False) -> Tensor:
    """The ``(M, n, b)`` outputs stored in ``path`` (validated by :func:`as_outputs`).

    ``.npy``: the array (no pickles).  ``.safetensors``: a file of tensors.  ``.pt`` is a pickle: read
    only with ``allow_pickle`` (``--allow-pickle``), as the model loader does, and then with
    ``torch.load(weights_only=True)``; before stop 36 it was read by default.  With several tensors,
    ``key`` picks one (default: the only one, or the one named "outputs").

    Raises:
        InputError: missing file, unknown suffix, a pickle without ``allow_pickle``, unreadable
            content, no/ambiguous tensor, bad shape.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"outputs file not found: {p}")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            import numpy as np

            data: object = np.load(p, allow_pickle=False)
        elif suffix == ".pt":
            if not allow_pickle:
                raise InputError(f"pickled outputs refused: {p} is a .pt file (a pickle); save them as .npy or "
                                 ".safetensors, or pass allow_pickle=True / --allow-pickle if you trust the file")
            import torch

            data = torch.load(p, map_location="cpu", weights_only=True)
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            data = load_file(str(p))
        else:
            raise InputError(f"unknown outputs format {suffix!r} for {p}; use .npy, .pt or .safetensors")
    except InputError:
        raise
    except Exception as err:  # numpy/torch/safetensors raise many types for corrupt files
        raise InputError(f"cannot read outputs from {p}: {type(err).__name__}: {err}") from None
    if key is not None and not isinstance(data, dict):  # a single array has no names: --key was ignored (red team 181)
        raise InputError(f"{p} holds one array, not named tensors; drop --key {key!r}")
    if isinstance(data, dict):
        if key is not None:
            if key not in data:
                raise InputError(f"{p} has no tensor {key!r}; it has {sorted(data)}")
            data = data[key]
        elif len(data) == 1:
            data = next(iter(data.values()))
        elif "outputs" in data:
            data = data["outputs"]
        else:
            raise InputError(f"{p} holds several tensors {sorted(data)}; pick one with --key")
    return as_outputs(data, name=str(p))
