"""Views of results: tables, JSON, CSV, DataFrames, figures (thin layers over the API)."""

from ._io import atomic_write_bytes as atomic_write_bytes
from ._io import atomic_write_text as atomic_write_text

__all__ = ["atomic_write_bytes", "atomic_write_text"]

from ._analysis import analysis_csv as analysis_csv
from ._analysis import analysis_json as analysis_json
from ._analysis import render_analysis as render_analysis

__all__ += ["analysis_csv", "analysis_json", "render_analysis"]
