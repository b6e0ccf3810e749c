"""The at-the-data block of ``transcover report --data``: local certified constants with their caption."""

from __future__ import annotations

__all__ = ["local_block"]


def local_block(result, data) -> dict:
    """``{"rows", "caption", "assumptions"}`` of a :class:`transcover._api_results.LocalLipschitzResult`
    computed at the sequences of ``data`` (what ``render_report`` shows as its local section)."""
    return {
        "rows": [r.to_dict() for r in result.rows],
        "caption": (f"certified local upper bounds at {result.n_sequences} sequences of {data} ((2,inf) metric), "
                    "rho as a factor of each layer's median token norm; global (radius R) and domain "
                    "(sigma >= sigma_0) bounds beside them; lower = the Jacobian norm at the data point "
                    "(the network row: the larger of it and a pair ascent inside the ball; empirical lower bound)"),
        "assumptions": ["every token of the input moves by at most rho (l2) around the data",
                        "float64 evaluation with rounding pads (THEORY F14, F17)"],
    }
