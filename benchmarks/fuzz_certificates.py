"""Long fuzz of every certified Lipschitz / G.3 bound against an independent float64 attacker.

Runs the attacks of ``tests/lipschitz/_fuzzcase.py`` (the same as the suite's bounded fuzz, with a
bigger search budget) over random cases of every kind -- attention dot/L2, LayerNorm/RMSNorm/
Pi_norm/none (with and without a variance floor), pre/post, every activation, gated FFN, biases,
causal masks, GQA, RoPE, (2,inf)/Frobenius, float64/float32/bf16 weights -- until ``--cases`` or
``--seconds`` runs out, and prints the number of cases, of checks, the violations (must be 0) and
the largest measured/bound ratio per bound kind.  Exit code 1 if any violation was found.

Usage: python benchmarks/fuzz_certificates.py [--cases N] [--seconds S] [--seed K]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "lipschitz"))

from _fuzzcase import Case, run_case  # noqa: E402


def draw(rng: random.Random, seed: int) -> Case:
    norm = rng.choice(["layernorm", "rmsnorm", "ball", "none"])
    floor = norm in ("layernorm", "rmsnorm") and rng.random() < 0.4
    placement = rng.choice(["post", "pre"])
    return Case(
        seed=seed, kind=rng.choice(["dot", "dot", "dot", "l2"]), norm=norm, placement=placement,
        post_norm=placement == "pre" and rng.random() < 0.3,  # branch-output norms (F26)
        act=rng.choice(["relu", "gelu", "gelu_tanh", "silu", "identity"]), gated=rng.random() < 0.3,
        biases=rng.random() < 0.5, causal=rng.random() < 0.5, rope=rng.random() < 0.3, gqa=rng.random() < 0.3,
        metric=rng.choice(["2,inf", "fro"]), radius=rng.uniform(0.2, 4.0), scale=rng.uniform(0.4, 3.0),
        sigma_min=rng.uniform(0.05, 0.8) if floor else 0.0, L=rng.choice([1, 1, 2]),
        final_norm=rng.random() < 0.3, perturb=rng.choice([1e-4, 1e-2, 0.3]),
        dtype=rng.choice(["float64", "float32", "bfloat16"]), T=rng.choice([2, 3, 4]),
        qk=rng.choice([1.0, 1.0, 4.0, 12.0]),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000, help="stop after this many cases")
    ap.add_argument("--seconds", type=float, default=300.0, help="stop after this many seconds (default 5 min)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restarts", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if args.cases < 1 or args.seconds <= 0:
        print("error: --cases must be >= 1 and --seconds > 0", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    n_cases = n_checks = 0
    worst: dict[str, tuple[float, Case]] = {}
    bad = []
    while n_cases < args.cases and time.monotonic() - t0 < args.seconds:
        c = draw(rng, rng.randrange(10**6))
        for kind, measured, slack, bound in run_case(c, restarts=args.restarts, steps=args.steps):
            n_checks += 1
            ratio = measured / bound if bound > 0 else (0.0 if measured == 0 else float("inf"))
            if ratio > worst.get(kind, (-1.0, c))[0]:
                worst[kind] = (ratio, c)
            if measured - slack > bound:
                bad.append((kind, measured, bound, c))
        n_cases += 1
    print(f"cases: {n_cases}   checks: {n_checks}   violations: {len(bad)}   "
          f"time: {time.monotonic() - t0:.0f} s   (restarts {args.restarts}, steps {args.steps})")
    print(f"{'bound kind':<28}{'max measured/bound':>20}")
    for kind in sorted(worst):
        print(f"{kind:<28}{worst[kind][0]:>20.9f}")
    for kind, measured, bound, c in bad[:20]:
        print(f"VIOLATION {kind}: measured {measured!r} > certified {bound!r} on {c}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
