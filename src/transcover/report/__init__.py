"""Views of results: tables, JSON, CSV, DataFrames, figures (thin layers over the API)."""

from ._io import atomic_write_bytes as atomic_write_bytes
from ._io import atomic_write_text as atomic_write_text

__all__ = ["atomic_write_bytes", "atomic_write_text"]

from ._analysis import analysis_csv as analysis_csv
from ._analysis import analysis_json as analysis_json
from ._analysis import render_analysis as render_analysis

__all__ += ["analysis_csv", "analysis_json", "render_analysis"]

from ._displays import AnalysisDisplay as AnalysisDisplay
from ._displays import BoundDisplay as BoundDisplay
from ._displays import CoveringDisplay as CoveringDisplay
from ._displays import HistoryDisplay as HistoryDisplay
from ._displays import LipschitzDisplay as LipschitzDisplay
from ._displays import PerturbationDisplay as PerturbationDisplay
from ._envelope import envelope as envelope
from ._envelope import envelope_json as envelope_json
from ._envelope import file_sha256 as file_sha256
from ._envelope import input_hashes as input_hashes
from ._paths import check_output_path as check_output_path
from ._progress import progress as progress
from ._progress import start_progress as start_progress

__all__ += ["AnalysisDisplay", "BoundDisplay", "CoveringDisplay", "HistoryDisplay", "LipschitzDisplay",
            "PerturbationDisplay", "envelope", "envelope_json", "file_sha256", "input_hashes", "check_output_path", "progress",
            "start_progress"]

from ._describe import Description as Description
from ._describe import describe_spec as describe_spec
from . import _register  # noqa: F401,E402  (the views result methods ask for: Note [views] in transcover._views)

__all__ += ["Description", "describe_spec"]
