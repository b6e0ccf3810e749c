"""The sink: every table, figure and JSON envelope of transcover's results (issue 11).

Nothing here computes a bound; everything here shows one.  Result types of the lower packages ask
for their views by name (``transcover._views``; registered by ``._register`` on import), command
modules print and write only what these functions render.  Figures follow the scikit-learn display
style (``XDisplay.from_result(r).plot(ax=None)``); matplotlib and pandas are imported on first use.
"""

from ._io import atomic_write_bytes as atomic_write_bytes
from ._io import atomic_write_text as atomic_write_text
from ._io import write_outputs as write_outputs

__all__ = ["atomic_write_bytes", "atomic_write_text", "write_outputs"]

from ._analysis import analysis_csv as analysis_csv
from ._analysis import analysis_json as analysis_json
from ._analysis import render_analysis as render_analysis
from ._analysis import analysis_sweep_table as analysis_sweep_table
from ._analysis import plot_sweep as plot_sweep
from ._cover import CoveringCurveDisplay as CoveringCurveDisplay
from ._nonvacuous import write_nonvacuous_plot as write_nonvacuous_plot

__all__ += ["analysis_csv", "analysis_json", "render_analysis", "analysis_sweep_table", "plot_sweep", "CoveringCurveDisplay", "write_nonvacuous_plot"]

from ._bound_tables import bound_payload as bound_payload
from ._bound_tables import bound_png as bound_png
from ._bound_tables import render_bound as render_bound
from ._lipschitz_tables import figure_bytes as figure_bytes
from ._lipschitz_tables import lipschitz_payload as lipschitz_payload
from ._lipschitz_tables import global_rows as global_rows
from ._lipschitz_tables import local_figure as local_figure
from ._lipschitz_tables import local_payload as local_payload
from ._lipschitz_tables import render_local as render_local
from ._lipschitz_tables import lipschitz_rows as lipschitz_rows
from ._lipschitz_tables import perturb_payload as perturb_payload
from ._lipschitz_tables import render_lipschitz as render_lipschitz
from ._lipschitz_tables import render_perturb as render_perturb

__all__ += ["bound_payload", "bound_png", "render_bound", "figure_bytes", "local_payload", "render_local",
            "global_rows", "local_figure",
            "lipschitz_payload", "lipschitz_rows", "perturb_payload",
            "render_lipschitz", "render_perturb"]

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
from ._fit import print_table as print_table
from ._paths import check_output_path as check_output_path
from ._progress import close_all as close_progress_bars
from ._progress import progress as progress
from ._progress import start_progress as start_progress

__all__ += ["AnalysisDisplay", "BoundDisplay", "CoveringDisplay", "HistoryDisplay", "LipschitzDisplay",
            "PerturbationDisplay", "envelope", "envelope_json", "file_sha256", "input_hashes", "check_output_path",
            "print_table", "progress", "start_progress", "close_progress_bars"]

from ._approx import AdviceDisplay as AdviceDisplay
from ._approx import AttentionRateDisplay as AttentionRateDisplay
from ._approx import FailureCurveDisplay as FailureCurveDisplay
from ._approx import MLPRateDisplay as MLPRateDisplay
from ._approx import advice_table as advice_table
from ._approx import axes_png as axes_png
from ._approx import capacity_line as capacity_line
from ._approx import construct_table as construct_table
from ._approx import encodings_line as encodings_line
from ._approx import failures_lines as failures_lines
from ._approx import rate_sweep_line as rate_sweep_line
from ._approx import rate_sweep_table as rate_sweep_table
from ._cover import EmpiricalCoveringDisplay as EmpiricalCoveringDisplay
from ._cover import cover_table as cover_table
from ._describe import Description as Description
from ._describe import describe_spec as describe_spec
from ._figures import display_bytes as display_bytes
from ._local import local_block as local_block
from ._staged import StagedDisplay as StagedDisplay
from ._staged import staged_table as staged_table
from ._train import TrainingDisplay as TrainingDisplay
from ._train import constraint_warnings as constraint_warnings
from ._train import train_table as train_table

__all__ += ["AdviceDisplay", "AttentionRateDisplay", "FailureCurveDisplay", "MLPRateDisplay", "advice_table", "axes_png", "capacity_line", "construct_table", "encodings_line", "failures_lines",
            "rate_sweep_line", "rate_sweep_table", "EmpiricalCoveringDisplay", "cover_table", "Description", "describe_spec",
            "display_bytes", "local_block", "StagedDisplay", "staged_table", "TrainingDisplay", "constraint_warnings", "train_table"]

from ._build import ReportOptions as ReportOptions
from ._build import compute_report as compute_report
from ._build import render_report as render_report

__all__ += ["ReportOptions", "compute_report", "render_report"]

from . import _register  # noqa: E402,F401  (the views result methods ask for: Note [views] in transcover._views)
