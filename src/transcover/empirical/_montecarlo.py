"""Monte-Carlo estimates of a parametric class's covering number on fixed samples (seed 6.1).

Given M functions drawn from a class F (``_classes``, ``_local``) and samples ``{x_i}``, the
greedy net and the strict packing of the drawn set (``_nets``) give, for the *class*:

.. math::

    \\log|\\text{packing}(\\varepsilon)| \\le \\log N_{ext}(F, \\varepsilon, \\{x_i\\})
    \\quad\\text{and}\\quad
    \\log|\\text{net}(\\varepsilon)| \\le \\log P(F, \\varepsilon, \\{x_i\\}),

where ``P(F, eps)`` is the class's eps-packing number.  The first holds because a packing of drawn
members is a packing of F (strictly 2eps-separated, see ``_nets``); the second because the net's
centres are strictly eps-separated members of F.  Both are therefore *empirical lower bounds*
(:attr:`Kind.EMPIRICAL_LOWER`), and both increase with M towards their limits: the net size is
the usual Monte-Carlo *estimate* of N(eps) (``N_int(eps) <= P(eps)``), and the result records its
growth with M (checkpoints) so a reader sees whether it has levelled off.  A curve still rising
at the largest M means the class's covering number is larger than any number reported.

Note [seed blocks]: :func:`sample_reference_class` draws all M members from one generator, tensor
by tensor, so member j's weights depend on M and the whole draw must sit in one process.  For
classes split across processes (``transcover.scale``) the members are instead drawn in *seed
blocks* of ``SEED_BLOCK`` members: block ``k`` is ``sample_reference_class(..., SEED_BLOCK,
seed=block_seed(seed, k))`` evaluated on its own, and member ``j`` is row ``j mod SEED_BLOCK`` of
block ``j // SEED_BLOCK``.  Member j then depends only on ``(seed, j)`` -- not on M, on how the
members are chunked, or on which process evaluates them -- so every chunking and backend gives the
same outputs bit for bit, and the first m members of a larger draw are the draw of size m.  It is
a different (equally valid) draw from the one-generator sample of the same seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from .._errors import InputError
from .._io import physical_memory
from .._results import Kind, Quantity
from ..covering import log_count
from ._metrics import as_outputs, check_eps, check_q
from ._nets import FORWARD_PAD_ASSUMPTION, FORWARD_REL_PAD, IncrementalNet, forward_pad, padded_radius, torch_threads

__all__ = ["FunctionSample", "MonteCarloCovering", "monte_carlo_covering", "covering_of_outputs",
           "default_checkpoints", "SEED_BLOCK", "block_seed", "reference_block_outputs", "check_output_memory",
           "check_outputs_memory", "outputs_bytes"]

SEED_BLOCK = 256  # members per seed block (Note [seed blocks]); changing it changes every block draw


class FunctionSample(Protocol):
    """What the Monte-Carlo and uniform estimators need from a sampled class."""

    n_functions: int
    description: str

    def evaluate(self, X: Tensor) -> Tensor:  # (n, T, d) -> (M, n, b)
        ...


@dataclass(frozen=True)
class MonteCarloCovering:
    """Net and packing sizes of M sampled functions, for each eps and each prefix size m <= M.

    ``net_sizes[e][c]`` / ``packing_sizes[e][c]``: sizes for ``eps[e]`` using the first
    ``checkpoints[c]`` functions.  ``forward_pad``: the distance margin of THEORY F109 (Note [forward pad]
    of ``_nets``) by which a pair must exceed ``eps`` (net centres) or ``2 eps`` (packing) to count as
    separated; ``rel_pad`` the relative output accuracy it assumes (0: the outputs taken as exact).
    """

    eps: tuple[float, ...]
    q: float
    checkpoints: tuple[int, ...]
    net_sizes: tuple[tuple[int, ...], ...]
    packing_sizes: tuple[tuple[int, ...], ...]
    n_samples: int
    n_outputs: int
    description: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    forward_pad: float = 0.0
    rel_pad: float = 0.0

    @property
    def n_functions(self) -> int:
        return self.checkpoints[-1]

    def _assumptions(self) -> tuple[str, ...]:
        return ((f"M={self.n_functions} sampled members", "members satisfy the class's constraints")
                + ((FORWARD_PAD_ASSUMPTION,) if self.rel_pad > 0 else ()))

    def log_packing_lower(self, e: int) -> Quantity:
        """log |net(eps)| at the largest M, rounded down (THEORY F112, logs of counts): a lower bound on the class's
        log eps-packing number."""
        return Quantity(log_count(self.net_sizes[e][-1], "down"), Kind.EMPIRICAL_LOWER,
                        "greedy eps-net of M sampled members: lower bound on log P(F, eps) "
                        ">= log N_int(F, eps); Monte-Carlo estimate of log N(eps)", self._assumptions())

    def log_N_estimate(self, e: int) -> Quantity:
        """log |net(eps)| read as the Monte-Carlo *estimate* of log N(eps) (an estimate, not a bound: a greedy
        net can exceed N_int and N_ext, e.g. values 0, 1, 2 at eps = 1 give a net of 2 where one centre covers).
        An estimate claims no side, so its log is rounded to nearest (THEORY F112, logs of counts)."""
        return Quantity(log_count(self.net_sizes[e][-1], "nearest"), Kind.ESTIMATE,
                        "greedy eps-net of M sampled members: Monte-Carlo estimate of log N(F, eps)",
                        self._assumptions())

    def log_covering_lower(self, e: int) -> Quantity:
        """log |packing(eps)| at the largest M, rounded down (THEORY F112, logs of counts): a lower bound on the
        class's log N_ext(eps)."""
        return Quantity(log_count(self.packing_sizes[e][-1], "down"), Kind.EMPIRICAL_LOWER,
                        "strict 2eps-packing of M sampled members: lower bound on log N_ext(F, eps)",
                        self._assumptions())

    def saturated(self, e: int, fraction: float = 0.5) -> bool:
        """True when the net holds more than ``fraction`` of the sampled functions (eps too small for M)."""
        return self.net_sizes[e][-1] > fraction * self.n_functions

    def still_growing(self, e: int, rel: float = 0.05) -> bool:
        """True when the net grew by more than ``rel`` over the last doubling-ish step of M."""
        s = self.net_sizes[e]
        return len(s) > 1 and s[-1] > (1.0 + rel) * s[-2]

    def to_dict(self) -> dict[str, object]:
        rows = []
        for e, eps in enumerate(self.eps):
            rows.append({
                "eps": eps, "net_sizes": list(self.net_sizes[e]), "packing_sizes": list(self.packing_sizes[e]),
                "log_N_estimate": self.log_N_estimate(e).to_dict(),
                "log_P_lower": self.log_packing_lower(e).to_dict(),
                "log_N_ext_lower": self.log_covering_lower(e).to_dict(),
                "saturated": self.saturated(e), "still_growing": self.still_growing(e),
            })
        return {"q": "inf" if self.q == math.inf else int(self.q), "checkpoints": list(self.checkpoints),
                "n_samples": self.n_samples, "n_outputs": self.n_outputs, "description": self.description,
                "forward_pad": self.forward_pad, "rel_pad": self.rel_pad, "rows": rows, **self.extra}


def check_output_memory(n_bytes: int, what: str, lower: str) -> None:
    """Refuse up front a run whose arrays need more than a quarter of physical memory.

    ``n_bytes``: the estimate of the largest array (e.g. the concatenated float64 outputs, held up to three
    times while the chunks are joined and the nets built); ``what`` names it, ``lower`` the options to lower.
    ``cover reference --functions 1000000000`` started and would have needed about 128 GB (red team 191).
    """
    limit = physical_memory() // 4
    if n_bytes > limit:
        raise InputError(f"{what} need about {n_bytes / 1e9:.3g} GB, over the limit of {limit / 1e9:.3g} GB (a quarter "
                         f"of this machine's memory); lower {lower}")


def outputs_bytes(M: int, rows: int, width: int) -> int:
    """Bytes of the float64 outputs ``(M, rows, width)`` times three (chunks, concatenation, the nets' copy)."""
    return 3 * 8 * int(M) * int(rows) * int(width)


def check_outputs_memory(M: int, rows: int, width: int) -> None:
    """``check_output_memory`` for the outputs of ``M`` sampled functions, ``rows x width`` values each."""
    check_output_memory(outputs_bytes(M, rows, width),
                        f"the outputs of {M} functions ({rows} x {width} values each, float64, up to three copies)",
                        "--functions (or --samples)")


def default_checkpoints(M: int) -> tuple[int, ...]:
    """Roughly geometric prefix sizes 10, 20, 50, 100, ... up to and including M."""
    out = []
    base = 1
    while base <= M:
        for k in (1, 2, 5):
            if 10 <= k * base * 10 <= M:
                out.append(k * base * 10)
        base *= 10
    out = sorted(set(c for c in out if c < M)) + [M]
    return tuple(out)


def _check_eps_list(eps: Sequence[float] | float) -> tuple[float, ...]:
    eps_t = (eps,) if isinstance(eps, (int, float)) else tuple(eps)
    if not eps_t:
        raise InputError("need at least one eps")
    return tuple(check_eps(e) for e in eps_t)


def covering_of_outputs(Y, eps: Sequence[float] | float, q: float | str = math.inf, *,
                        checkpoints: Sequence[int] | None = None, description: str = "",
                        chunk_size: int = 4096, workers: int | None = None,
                        rel_pad: float = FORWARD_REL_PAD) -> MonteCarloCovering:
    """Net and packing sizes of the rows of ``Y`` (M, n, b) at each eps, after each prefix size.

    One streaming pass per eps (``IncrementalNet``): no M x M matrix, and the prefix sizes come
    free because the greedy net is online.  ``Y`` is taken as the float64 forward's outputs of sampled
    members: a pair counts as separated only beyond ``eps`` (net) or ``2 eps`` (packing) plus
    ``forward_pad(Y, q, rel_pad)`` (THEORY F109); ``rel_pad=0`` takes the outputs as exact.
    """
    Y = as_outputs(Y)
    eps_t = _check_eps_list(eps)
    qf = check_q(q)
    M, n, b = Y.shape
    cps = default_checkpoints(M) if checkpoints is None else tuple(sorted(set(int(c) for c in checkpoints)))
    if not cps or cps[0] < 1 or cps[-1] > M:
        raise InputError(f"checkpoints must lie in [1, M={M}], but got {list(cps)}")
    pad = forward_pad(Y, qf, rel_pad)
    nets, packs = [], []
    with torch_threads(workers):
        for e in eps_t:
            net = IncrementalNet(padded_radius(e, pad), qf, chunk_size=chunk_size)
            pack = IncrementalNet(padded_radius(2.0 * e, pad), qf, chunk_size=chunk_size)
            net.add(Y)
            pack.add(Y)
            nets.append(tuple(net.size_after(cps)))
            packs.append(tuple(pack.size_after(cps)))
    return MonteCarloCovering(eps_t, qf, cps, tuple(nets), tuple(packs), n, b, description, {}, pad, float(rel_pad))


def monte_carlo_covering(sample: FunctionSample, X: Tensor, eps: Sequence[float] | float,
                         q: float | str = math.inf, *, checkpoints: Sequence[int] | None = None,
                         workers: int | None = None) -> MonteCarloCovering:
    """Monte-Carlo lower estimates of ``log N(F, eps, {x_i})`` for a sampled class.

    Args:
        sample: drawn members (:func:`sample_reference_class`, :func:`sample_local_class`).
        X: the samples ``(n, T, d)``.
        eps: one or several accuracies > 0.
        q: the per-sample output norm (1, 2, inf).
        checkpoints: prefix sizes m at which the net size is recorded (default: 10, 20, 50, ..., M).
        workers: torch threads (None: torch's default).

    Returns:
        :class:`MonteCarloCovering` (both numbers are :attr:`Kind.EMPIRICAL_LOWER` for the class).
    """
    eps_t = _check_eps_list(eps)
    qf = check_q(q)
    if hasattr(sample, "output_shape"):
        rows, width = sample.output_shape(X)
        check_outputs_memory(sample.n_functions, rows, width)
    with torch_threads(workers):
        Y = sample.evaluate(X)
    res = covering_of_outputs(Y, eps_t, qf, checkpoints=checkpoints,
                              description=getattr(sample, "description", ""), workers=workers)
    scale = float(np.asarray(Y.abs().amax()).item())
    return dataclasses.replace(res, extra={"max_abs_output": scale})


def block_seed(seed: int, block: int) -> int:
    """The seed of block ``block`` of a draw with ``seed`` (Note [seed blocks]): 63 bits of
    ``numpy.random.SeedSequence((seed, block))``, so distinct ``(seed, block)`` give unrelated streams."""
    if not isinstance(seed, (int, np.integer)) or not isinstance(block, (int, np.integer)) or block < 0:
        raise InputError(f"seed must be an integer and block >= 0, but got seed={seed!r}, block={block!r}")
    entropy = (int(seed) % (1 << 64), int(block))  # SeedSequence takes non-negative words
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def reference_block_outputs(config, radii, X: Tensor, start: int, stop: int, *, seed: int = 0,
                            radial: str = "volume", output: str = "head",
                            block_size: int = SEED_BLOCK) -> Tensor:
    """Outputs ``(stop - start, n, b)`` (float64) of members ``start <= j < stop`` of the block-seeded
    reference class (Note [seed blocks]) on the samples ``X`` (n, T, d).

    Each block overlapping the range is drawn whole and evaluated alone, then sliced, so a
    member's outputs do not depend on the range it is asked for in.

    Raises:
        InputError: an empty or negative range, or anything :func:`sample_reference_class` refuses.
    """
    from ._classes import sample_reference_class

    if not (0 <= start < stop) or not isinstance(block_size, int) or block_size < 1:
        raise InputError(f"need 0 <= start < stop and block_size >= 1, but got start={start}, stop={stop}, "
                         f"block_size={block_size}")
    outs = []
    for k in range(start // block_size, (stop - 1) // block_size + 1):
        sample = sample_reference_class(config, radii, block_size, radial=radial, seed=block_seed(seed, k),
                                        output=output)
        lo, hi = max(start, k * block_size), min(stop, (k + 1) * block_size)
        outs.append(sample.evaluate(X)[lo - k * block_size: hi - k * block_size])
    return torch.cat(outs, dim=0)
