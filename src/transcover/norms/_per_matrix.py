"""Any model, per matrix: certified norms of every 2-D weight, outside the decomposition.

For an architecture no adapter reads (any ``nn.Module``, any safetensors checkpoint), ``analyze``
still reports, for each 2-D weight on its own, certified enclosures of ``||W||_2``, ``||W||_F`` and
``||W||_{2,1}`` (the same certificates as ``analyze``'s matrices: ``spectral_norm_interval``,
``frobenius_interval``, ``l21_interval``, row-blocked for large matrices).  Nothing here needs the
architecture, and nothing that does is reported: no per-head products (``B_KQ``, ``B_V``), no
Lipschitz constant, no perturbation or covering bound.  Every result says so in ``scope``.

Orientation (Note [per-matrix orientation]).  The spectral and Frobenius norms do not depend on it;
the (2,1) norm does: it is ``sum_j ||W[:, j]||_2`` for ``x @ W`` (a sum over output units, as in
``analyze``).  ``nn.Linear`` weights are stored ``(d_out, d_in)`` and enter transposed; GPT-2's
``Conv1D`` is stored ``(d_in, d_out)`` and enters as stored; embeddings (``nn.Embedding``, or in a
file a tensor whose name says embed/wte/wpe) enter as stored (a token maps to a row).  From a
module the class says which; from a file, a tensor that is not an embedding is taken to be an
``nn.Linear`` weight, and the row says so (``orientation="linear (assumed from the file)"``).
Tensors of other ranks (biases, norm scales, convolution kernels) and integer buffers (position
ids) are listed as skipped.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._errors import InputError
from .._results import Interval, Kind
from ._blocked import BLOCK_BYTES, blocked_matrix_norms
from ._entrywise import frobenius_interval, l21_interval
from ._spectral import spectral_norm_interval

__all__ = ["MatrixRow", "PerMatrixResult", "per_matrix_norms", "PER_MATRIX_SCHEMA", "SCOPE"]

PER_MATRIX_SCHEMA = "transcover.analyze.per_matrix"
SCOPE = ("outside the decomposition: each matrix on its own (no per-head products, no bounds that need "
         "the architecture)")
_EMBEDDING_NAME = re.compile(r"(^|[._])(embed[a-z_]*|wte|wpe|word_embeddings|position_embeddings)([._]|$)")


@dataclass(frozen=True)
class MatrixRow:
    """One 2-D weight: certified ``||W||_2``, ``||W||_F``, ``||W||_{2,1}`` in the ``x @ W`` orientation."""

    name: str
    shape: tuple[int, int]  # as stored
    orientation: str  # how the stored tensor becomes x @ W (Note [per-matrix orientation])
    spectral: Interval
    frobenius: Interval
    l21: Interval

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "orientation": self.orientation,
                "spectral": self.spectral.to_dict(), "frobenius": self.frobenius.to_dict(),
                "l21": self.l21.to_dict()}


@dataclass(frozen=True)
class PerMatrixResult:
    """``analyze`` of a model outside every adapter: one row per 2-D weight."""

    model: str
    rtol: float
    matrices: tuple[MatrixRow, ...]
    skipped: tuple[str, ...] = ()  # tensors that are not 2-D weights, "name (shape)"
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    scope: str = SCOPE
    kind: Kind = field(default=Kind.CERTIFIED_INTERVAL)

    def to_dict(self) -> dict[str, object]:
        return {"schema": PER_MATRIX_SCHEMA, "schema_version": "1.0", "model": self.model, "scope": self.scope,
                "kind": self.kind.value, "rtol": self.rtol, "seconds": self.seconds,
                "matrices": [m.to_dict() for m in self.matrices], "skipped": list(self.skipped),
                "notes": list(self.notes)}

    def to_dataframe(self):
        import pandas as pd

        rows = [{"name": m.name, "shape": m.shape, "orientation": m.orientation,
                 **{f"{k}_{e}": getattr(getattr(m, k), e) for k in ("spectral", "frobenius", "l21")
                    for e in ("lower", "upper")}} for m in self.matrices]
        return pd.DataFrame(rows).set_index("name")


def _norms(name: str, W_rv: np.ndarray, stored_shape: tuple[int, int], orientation: str, rtol: float) -> MatrixRow:
    """Certified norms of ``W_rv`` (the x @ W orientation); large matrices in row blocks (no float64 copy)."""
    if W_rv.size * 8 > BLOCK_BYTES:
        spec, fro, l21, _ = blocked_matrix_norms(W_rv, rtol=rtol)
    else:
        W64 = np.asarray(W_rv, dtype=np.float64)
        spec, fro, l21 = spectral_norm_interval(W64, rtol=rtol), frobenius_interval(W64), l21_interval(W64)
    return MatrixRow(name, stored_shape, orientation, spec, fro, l21)


def _module_entries(module) -> list[tuple[str, object, str]]:
    """(name, stored 2-D tensor, orientation) of every distinct 2-D parameter of a module, and the skipped."""
    from torch import nn

    seen: set[int] = set()
    out, skipped = [], []
    for mname, mod in module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if id(p) in seen:
                continue  # a tied weight (e.g. an LM head sharing the embedding) is one matrix
            seen.add(id(p))
            if p.ndim != 2:
                skipped.append(f"{name} {tuple(p.shape)}")
                continue
            if isinstance(mod, nn.Embedding):
                orient = "embedding (as stored)"
            elif type(mod).__name__ == "Conv1D":  # transformers' GPT-2 Conv1D: (d_in, d_out)
                orient = "conv1d (as stored)"
            elif isinstance(mod, nn.Linear):
                orient = "linear (transposed)"
            else:
                orient = f"{type(mod).__name__} parameter (as stored)"
            out.append((name, p, orient))
    return out, skipped


def _file_source(path: Path):
    from ..model import open_safetensors

    if path.is_dir():
        for candidate in ("model.safetensors", "model.safetensors.index.json"):
            if (path / candidate).is_file():
                return open_safetensors(path / candidate)
        found = sorted(path.glob("*.safetensors"))
        if len(found) == 1:
            return open_safetensors(found[0])
        raise InputError(f"no safetensors weights in {path} for per-matrix norms")
    if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return open_safetensors(path)
    raise InputError(f"per-matrix norms read safetensors checkpoints; got {path}")


def per_matrix_norms(model, *, rtol: float = 1e-3, note: str | None = None) -> PerMatrixResult:
    """Certified ``||W||_2``, ``||W||_F``, ``||W||_{2,1}`` of every 2-D weight of ``model``, each on its own.

    .. math:: \\sigma_{\\max}(W),\\quad \\|W\\|_F,\\quad \\|W\\|_{2,1} = \\sum_j \\|W_{:,j}\\|_2 \\ (x \\mapsto xW)

    Source: seed 2.1's matrix norms (THEORY F1-F3 read them per matrix); the certificates are those of
    :func:`~transcover.norms.spectral_norm_interval` and the entrywise enclosures.  Assumptions: the
    stored values are the weights (bf16/fp16 are widened exactly); orientation per Note
    [per-matrix orientation].  No bound that needs the architecture is computed.

    Args:
        model: an ``nn.Module``, a ``.safetensors`` file, a shard index, or a directory holding one.
        rtol: target relative gap of each spectral interval.
        note: one line saying why the per-matrix route was taken (kept in ``notes``).

    Raises:
        InputError: no readable safetensors weights; WeightError for NaN/Inf or integer weights.
        UnsupportedArchitectureError: a module with parametrisations, pruning or forward hooks (its stored
            tensors are not the weights its forward uses).
    """
    t0 = time.perf_counter()
    rows: list[MatrixRow] = []
    if hasattr(model, "named_modules"):
        from ..model import StateDictSource, refuse_rewritten_forward

        # the stored tensors must be the weights: a parametrised or pruned weight is stored raw (weight_orig,
        # parametrizations.weight.original) and was certified as such (red team 210)
        refuse_rewritten_forward(model)
        entries, skipped = _module_entries(model)
        label = type(model).__name__
        src = StateDictSource({n: p for n, p, _ in entries}, label)
        for name, _, orient in entries:
            t = src.get(name).double().cpu().numpy()  # validated: floating, finite
            rows.append(_norms(name, t.T if orient.startswith("linear") else t, tuple(t.shape), orient, rtol))
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise InputError(f"model path not found: {path} (only local files are read; nothing is downloaded)")
        src = _file_source(path)
        label, skipped = str(path), []
        for key in src.keys():
            shape = tuple(src.shape(key))
            dtype = src._dtype(key) or "float"
            if len(shape) != 2 or not dtype.startswith(("float", "bfloat")):
                # integer buffers (position ids, masks) are not weights
                skipped.append(f"{key} {shape}" + ("" if dtype.startswith(("float", "bfloat")) else f" {dtype}"))
                continue
            t = src.get(key)
            embedding = bool(_EMBEDDING_NAME.search(key))
            orient = "embedding (as stored)" if embedding else "linear (assumed from the file: transposed)"
            rows.append(_norms(key, t if embedding else t.T, shape, orient, rtol))
    if not rows:
        raise InputError(f"{label} holds no 2-D weights")
    notes = ((note,) if note else ()) + (SCOPE,)
    return PerMatrixResult(label, rtol, tuple(rows), tuple(skipped), notes, time.perf_counter() - t0)
