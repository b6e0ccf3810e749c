"""Views of results: tables, JSON, CSV, DataFrames, figures (thin layers over the API)."""

from ._io import atomic_write_bytes as atomic_write_bytes
from ._io import atomic_write_text as atomic_write_text

__all__ = ["atomic_write_bytes", "atomic_write_text"]
