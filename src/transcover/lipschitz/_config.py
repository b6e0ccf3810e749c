"""The choices of ``transcover lipschitz`` / ``perturb`` and their API calls, defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LipschitzConfig", "PerturbConfig"]


@dataclass(frozen=True)
class LipschitzConfig:
    """Domain, metric, constants and search effort of a Lipschitz bound and its lower estimate.

    ``radius``: R, every input token (embedded, before the input norm) has l2 norm <= R;
    ``metric``: "2,inf" (max over tokens of the l2 norm, T-independent) or "fro" (Frobenius over
    ``seq_len`` tokens); ``seq_len``: tokens per sampled input (and T for "fro"); ``c_sm``: softmax
    constant >= 1 (1 proven and tight, 2 Edelman et al.); ``sigma_min``: assumed floor on every
    LayerNorm input's std (0: the global eps-limited constant); ``samples`` random starts and
    ``steps`` ascent steps per search, ``seed`` of the lower-estimate search.
    """

    radius: float = 1.0
    metric: str = "2,inf"
    seq_len: int = 8
    c_sm: float = 1.0
    sigma_min: float = 0.0
    samples: int = 6
    steps: int = 30
    seed: int = 0

    @property
    def bound_seq_len(self) -> int | None:
        """T for the certified bound: only the Frobenius metric depends on it."""
        return self.seq_len if self.metric == "fro" else None

    def bound_options(self) -> dict[str, object]:
        """Keyword arguments of ``lipschitz_bounds`` / ``perturbation_bound``."""
        return {"radius": self.radius, "c_sm": self.c_sm, "metric": self.metric, "seq_len": self.bound_seq_len,
                "sigma_min": self.sigma_min}


@dataclass(frozen=True)
class PerturbConfig(LipschitzConfig):
    """The same choices for ``perturbation_bound`` and its measured lower (``transcover perturb``)."""
