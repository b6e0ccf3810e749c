"""A torch-free safetensors reader: the header parsed and checked here, the data read per tensor into numpy.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes, an unsigned little-endian
64-bit ``N``; ``N`` bytes of UTF-8 JSON mapping each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets relative to the byte after the header) plus an optional
``"__metadata__"`` string-to-string map; then the data, little-endian, row-major.  The checks mirror
the reference implementation's (``SafeTensors::read_metadata``): the header fits in the file, is a
JSON object, every entry's byte span equals ``prod(shape) * itemsize``, and the spans tile the data
region exactly, without gaps or overlaps.  Any failure is an :class:`~transcover.InputError`
naming the file, raised when the file is opened (i.e. at ``load()`` time).

Decoding: every tensor is read with ``readinto`` into a fresh array of its decoded dtype
(Note [no mapping]): F64 / F32 straight into it; F16 and BF16 in chunks of at most ``_CHUNK`` bytes (8 MiB),
each widened into its slice of the float32 result: F16 with numpy (exact), BF16 as the upper half
of a float32 (``uint16 << 16`` viewed as float32, exact).  So decoding a tensor needs its float32
size plus one chunk, never a uint32 or float32 temporary of the whole tensor.  Integer and boolean tensors are reported by dtype (the caller refuses them as
weights).  Float8 tensors, rare in checkpoints, are decoded by safetensors' torch backend (the only
case that imports torch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .._errors import InputError
from ._files import identity, record_read

__all__ = ["SafetensorsFile"]

# safetensors dtype code -> (numpy dtype of the stored bytes, torch's name of the dtype)
_DTYPES: dict[str, tuple[str | None, str]] = {
    "F64": ("<f8", "float64"), "F32": ("<f4", "float32"), "F16": ("<f2", "float16"),
    "BF16": ("<u2", "bfloat16"),
    "I64": ("<i8", "int64"), "I32": ("<i4", "int32"), "I16": ("<i2", "int16"), "I8": ("i1", "int8"),
    "U64": ("<u8", "uint64"), "U32": ("<u4", "uint32"), "U16": ("<u2", "uint16"), "U8": ("u1", "uint8"),
    "BOOL": ("?", "bool"),
    "F8_E4M3": (None, "float8_e4m3fn"), "F8_E5M2": (None, "float8_e5m2"),
}
_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100_000_000  # the reference implementation's limit
_CHUNK = 1 << 23  # bytes of half-precision data widened per step (8 MiB)

# Note [no mapping]: an earlier version memory-mapped each file and returned views of the mapping.
# Every page a view touched then stayed resident and counted in the process's RSS (file-backed
# pages are only dropped under memory pressure), so analysing a sharded checkpoint layer by layer
# still grew the RSS to the size of the checkpoint.  Reading each tensor into its own array costs
# the same copy from the page cache, and the memory is returned when the array is dropped.


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose names are unique: a tensor named twice in one header kept its last entry, and the file was
    refused for a gap in the offsets instead of the duplicate (red team 175)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the header names {twice!r} twice")
    return out


def _identity(f) -> tuple[int, ...]:  # noqa: ANN001
    """Which file an open handle reads, and its version (``_files.identity``: device, inode, size, modification and
    change times).  Each tensor is read through a new handle (Note [no mapping]), so a checkpoint replaced or rewritten
    between two tensors mixed two models without a word (stop 38 red team: layer 0 from one file, layer 1 from the
    other).  The change time is set by the kernel on every write and cannot be put back, as the mtime can
    (``os.utime``: a shard rewritten in place at the same size with its mtime restored was read half old, half new;
    red team 175)."""
    return identity(f)


class SafetensorsFile:
    """One ``.safetensors`` file: header checked on construction, tensors read on :meth:`get`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._identity = _identity(f)
                size = f.seek(0, 2)
                if size < 8:
                    raise ValueError(f"file of {size} bytes is shorter than the 8-byte header length")
                f.seek(0)
                n = int.from_bytes(f.read(8), "little")
                if n > _MAX_HEADER or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit in a file of {size} bytes")
                header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_unique_keys)
                if not isinstance(header, dict):
                    raise ValueError("header is not a JSON object")
                meta = header.pop("__metadata__", {})
                meta = {} if meta is None else meta  # a null is absent; [] or 0 is no map (red team 175)
                if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                    raise ValueError("__metadata__ is not a map of strings")
                self.metadata: dict[str, str] = meta
                self._start = 8 + n
                self._entries = self._check(header, size - self._start)
                self._size = size
            record_read(self.path, self._identity)  # what the JSON envelope's checksum must match (Note [inputs read])
        except RecursionError:
            raise InputError(f"cannot read safetensors file {self.path}: its JSON header is nested too "
                             "deeply") from None
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise InputError(f"cannot read safetensors file {self.path}: {err}") from err

    @staticmethod
    def _check(header: dict, data_size: int) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
        entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            if not isinstance(info, dict):
                raise ValueError(f"entry {key!r} is not an object")
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in _DTYPES:  # a list was "unhashable": internal error (175)
                raise ValueError(f"tensor {key!r} has unknown dtype {dtype!r}")
            # a JSON true is a Python int too: [true, 32] was read as a shape [True, 32] (red team 201)
            if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
                raise ValueError(f"tensor {key!r} has invalid shape {shape!r}")
            if not (isinstance(offsets, list) and len(offsets) == 2
                    and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
                raise ValueError(f"tensor {key!r} has invalid data_offsets {offsets!r}")
            np_dtype = _DTYPES[dtype][0]
            itemsize = _ITEMSIZE[dtype] if np_dtype is None else np.dtype(np_dtype).itemsize
            if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
                raise ValueError(f"tensor {key!r}: data_offsets {offsets} do not match shape {shape} of {dtype}")
            entries[key] = (dtype, tuple(shape), offsets[0], offsets[1])
        end = 0
        for key, (_, _, begin, stop) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
            if begin != end:
                raise ValueError(f"tensor {key!r} starts at byte {begin}, expected {end} (gap or overlap)")
            end = stop
        if end != data_size:
            raise ValueError(f"the tensors end at byte {end} of a data region of {data_size} bytes (truncated?)")
        return entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype_name(self, key: str) -> str:
        return _DTYPES[self._entries[key][0]][1]

    def nbytes(self, key: str) -> int:
        """Bytes of ``key`` as stored."""
        _, _, begin, stop = self._entries[key]
        return stop - begin

    def read_bytes(self, key: str) -> int:
        """Bytes of the array :meth:`get` returns for ``key`` (half precision widened to 4 bytes, float8 to 8)."""
        dtype, shape, _, _ = self._entries[key]
        np_dtype = _DTYPES[dtype][0]
        size = 4 if dtype in ("BF16", "F16") else 8 if np_dtype is None else np.dtype(np_dtype).itemsize
        return math.prod(shape) * size

    def get(self, key: str) -> np.ndarray:
        """Tensor ``key`` as a fresh numpy array: float64/float32 kept, float16/bfloat16 widened to float32."""
        dtype, shape, begin, stop = self._entries[key]
        np_dtype = _DTYPES[dtype][0]
        if np_dtype is None:  # float8: rare; torch decodes it exactly into float64
            from safetensors import safe_open

            with safe_open(str(self.path), framework="pt") as handle:
                return handle.get_tensor(key).double().numpy()
        count = math.prod(shape)
        half = dtype in ("BF16", "F16")
        out = np.empty(count, dtype=np.float32 if half else np_dtype)
        if count:
            try:
                with open(self.path, "rb") as f:
                    if self._size != f.seek(0, 2):
                        raise OSError("the file changed size since it was opened")
                    self._unchanged(f)
                    f.seek(self._start + begin)
                    if half:
                        self._read_widened(f, out, dtype)
                    else:
                        self._read_exact(f, out.view(np.uint8))
                    # a write landing during the read itself (a tensor alone in its shard, read half old, half new,
                    # was certified as one matrix; red team 219)
                    self._unchanged(f)
            except OSError as err:
                raise InputError(f"cannot read tensor {key!r} from {self.path}: {err}") from err
        out = out.reshape(shape)
        if not half and not out.dtype.isnative:  # big-endian machines
            out = out.astype(out.dtype.newbyteorder("="))
        return out

    def _unchanged(self, f) -> None:  # noqa: ANN001
        """OSError where the file read through ``f`` is no longer the one opened: replaced (new inode) or rewritten."""
        if _identity(f) != self._identity:
            raise OSError("the file was replaced or rewritten since it was opened; its tensors would "
                          "mix two checkpoints (rerun on a copy that does not change)")

    @staticmethod
    def _read_exact(f, buf: np.ndarray) -> None:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"unexpected end of file after {done} of {len(view)} bytes")
            done += n

    def _read_widened(self, f, out: np.ndarray, dtype: str) -> None:
        """Read half-precision values chunk by chunk, each widened into its slice of ``out`` (exact)."""
        step = _CHUNK // 2
        raw = np.empty(min(step, out.size), dtype="<u2")
        for lo in range(0, out.size, step):
            part = raw[: min(step, out.size - lo)]
            self._read_exact(f, part.view(np.uint8))
            if dtype == "BF16":
                dst = out[lo: lo + part.size].view(np.uint32)
                np.left_shift(part, 16, out=dst, dtype=np.uint32)
            else:
                out[lo: lo + part.size] = part.view("<f2")
