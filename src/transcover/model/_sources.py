"""Where a model's tensors come from: safetensors files (one or many shards) or a state dict.

A :class:`TensorSource` is read lazily, tensor by tensor; :meth:`TensorSource.get` is the one place
where a tensor is checked before any later stage sees it:

* missing -> :class:`~transcover.WeightError` naming the tensor and the file;
* a shape other than the one the model's configuration implies -> ``WeightError`` with both shapes;
* integer or boolean dtype where a weight is expected -> ``WeightError``;
* NaN or Inf -> ``WeightError`` naming the tensor and how many entries are non-finite;
* bfloat16 and float16 are upcast to float32 (exact: every bf16/fp16 number is a float32 number);
  float32 and float64 are kept as they are.

Safetensors files are opened eagerly with ``safe_open`` (memory-mapped), which parses and checks
each header, so a truncated or corrupted file is reported when the model is loaded rather than when
its first layer is read.  This module imports only torch, safetensors and json: it is on the CLI's
start-up path.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from .._errors import InputError, WeightError

__all__ = ["TensorSource", "SafetensorsSource", "StateDictSource", "LazyTensors", "open_safetensors"]

_UPCAST = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
_KEPT = (torch.float32, torch.float64)


class TensorSource:
    """A named collection of tensors read one at a time, with validation (see the module docstring)."""

    #: What the user pointed at (a file, a directory, a module's class name); used in messages.
    name: str

    def keys(self) -> list[str]:
        raise NotImplementedError

    def where(self, key: str) -> str:
        """The file (or object) that holds, or should hold, ``key``, for error messages."""
        return self.name

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key`` without reading its data."""
        raise NotImplementedError

    def _raw(self, key: str) -> Tensor:
        raise NotImplementedError

    def metadata(self) -> dict[str, str]:
        return {}

    def __contains__(self, key: object) -> bool:
        return key in self._keyset()

    def _keyset(self) -> set[str]:
        cached = getattr(self, "_keys_cache", None)
        if cached is None:
            cached = set(self.keys())
            self._keys_cache = cached
        return cached

    def storage_dtype(self) -> str:
        """The dtype of the first floating tensor as stored (e.g. "float32", "bfloat16")."""
        for k in self.keys():
            dt = self._dtype(k)
            if dt is not None and dt.is_floating_point:
                return str(dt).removeprefix("torch.")
        return "unknown"

    def _dtype(self, key: str) -> torch.dtype | None:
        return None

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """The validated floating tensor ``key`` (bf16/fp16 upcast to float32).

        Raises:
            WeightError: ``key`` is missing, has another shape than ``shape``, an integer dtype,
                or holds NaN/Inf.
        """
        if key not in self:
            raise WeightError(f"tensor {key!r} is missing from {self.where(key)}")
        if shape is not None:
            got = tuple(self.shape(key))
            if got != tuple(shape):
                raise WeightError(
                    f"tensor {key!r} in {self.where(key)} has shape {list(got)}, but the model's "
                    f"configuration implies {list(shape)}"
                )
        t = self._raw(key)
        if not t.is_floating_point():
            raise WeightError(
                f"tensor {key!r} in {self.where(key)} has dtype {str(t.dtype).removeprefix('torch.')}, "
                "but a floating-point weight is expected"
            )
        if t.dtype in _UPCAST:
            t = t.to(_UPCAST[t.dtype])
        elif t.dtype not in _KEPT:
            t = t.to(torch.float64)  # float8 and other exotic floats: float64 holds them exactly
        # Note [finite check]: NaN and +-Inf survive summation (inf - inf = NaN), so a finite sum
        # proves every entry finite in one pass without a boolean copy; a non-finite sum (possibly
        # an overflow of finite entries) falls back to the exact elementwise count.
        if not bool(torch.isfinite(t.sum())) and (bad := int((~torch.isfinite(t)).sum())):
            raise WeightError(
                f"tensor {key!r} in {self.where(key)} holds {bad} non-finite value(s) (NaN/Inf)"
            )
        return t

    def get_optional(self, key: str, shape: tuple[int, ...] | None = None) -> Tensor | None:
        """Like :meth:`get`, but ``None`` when ``key`` is absent (optional biases)."""
        return self.get(key, shape) if key in self else None


class SafetensorsSource(TensorSource):
    """One or more safetensors files, memory-mapped; tensor ``k`` lives in ``files[owner[k]]``."""

    def __init__(self, files: list[Path], name: str, index_file: Path | None = None):
        from safetensors import safe_open

        self.name = name
        self.files = list(files)
        self._index_file = index_file
        self._handles = []
        self._owner: dict[str, int] = {}
        for i, path in enumerate(self.files):
            if not path.is_file():
                raise InputError(f"safetensors file not found: {path}")
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except Exception as err:  # safetensors raises its own SafetensorError (not exported)
                reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise InputError(f"cannot read safetensors file {path}: {reason}") from err
            self._handles.append(handle)
            for k in keys:
                self._owner.setdefault(k, i)

    def keys(self) -> list[str]:
        return list(self._owner)

    def where(self, key: str) -> str:
        if key in self._owner:
            return str(self.files[self._owner[key]])
        if self._index_file is not None:
            return str(self._index_file)
        return str(self.files[0]) if len(self.files) == 1 else self.name

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._owner[key]].get_slice(key).get_shape())

    def _dtype(self, key: str) -> torch.dtype | None:
        code = self._handles[self._owner[key]].get_slice(key).get_dtype()
        return _SAFETENSORS_DTYPES.get(code)

    def _raw(self, key: str) -> Tensor:
        try:
            return self._handles[self._owner[key]].get_tensor(key)
        except Exception as err:
            raise InputError(f"cannot read tensor {key!r} from {self.where(key)}: {err}") from err

    def metadata(self) -> dict[str, str]:
        return dict(self._handles[0].metadata() or {}) if self._handles else {}


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class StateDictSource(TensorSource):
    """A ``{name: tensor}`` dict (a module's ``state_dict()`` or an unpickled checkpoint)."""

    def __init__(self, tensors: Mapping[str, object], name: str):
        self.name = name
        self._tensors = {k: v for k, v in tensors.items() if isinstance(v, Tensor)}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def _dtype(self, key: str) -> torch.dtype | None:
        return self._tensors[key].dtype

    def _raw(self, key: str) -> Tensor:
        # detach: the spec must never carry autograd history of a live module
        return self._tensors[key].detach()


def open_safetensors(path: Path) -> SafetensorsSource:
    """A single ``.safetensors`` file, or the shards listed by a ``*.safetensors.index.json``."""
    if path.name.endswith(".index.json"):
        try:
            index = json.loads(path.read_text())
            weight_map = index["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InputError(f"cannot read shard index {path}: {err}") from err
        shards = list(dict.fromkeys(weight_map.values()))
        if not shards:
            raise InputError(f"shard index {path} lists no files")
        return SafetensorsSource([path.parent / s for s in shards], name=str(path.parent), index_file=path)
    return SafetensorsSource([path], name=str(path))


class LazyTensors(Mapping[str, Tensor]):
    """A read-only mapping role -> tensor whose values are read (and validated) on access.

    ``names`` maps each role to the checkpoint tensor it comes from, for reports.  Used for
    ``TransformerSpec.embeddings`` so that loading a model never reads its (large) vocabulary
    matrices unless a later stage asks for them.
    """

    def __init__(self, entries: dict[str, tuple[str, Callable[[], Tensor]]]):
        self._entries = entries

    @property
    def names(self) -> dict[str, str]:
        return {role: name for role, (name, _) in self._entries.items()}

    def __getitem__(self, role: str) -> Tensor:
        return self._entries[role][1]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"LazyTensors({self.names!r})"
