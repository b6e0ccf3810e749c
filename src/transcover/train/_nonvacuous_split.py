"""The data-dependent-prior variant of ``experiment nonvacuous`` (THEORY F20): a reference from half A, the bound on half B.

1. Train, quantise and compress a reference ``R`` on the first ``prior_split`` share ``A`` of the
   training set, exactly as :func:`~transcover.train._nonvacuous.run_case` does on all of it.  With
   ``prior_select``, its recipe is first chosen from :data:`PRIOR_RECIPES` on A alone: a reference per recipe
   from A's first half, scored by its mistakes on A's second half (THEORY F20a).
2. Fine-tune on all training samples (A and B) with the forward pass on ``R``'s grids (fixed
   level counts and scales), quantise, and revert changed integers to ``R``'s while that lowers the
   kl bound on B (:func:`_revert`).
3. Bound the model on B with the relative code of :mod:`transcover.compress._delta` (``R`` is fixed
   before B is looked at, so the code is a prior for B); the reference itself (no change) is a
   candidate too and costs 2 bits.  Every length is paid the recipe's own codeword more (THEORY F20b,
   Note [recipe code]): the prior is the mixture over every recipe, each weighted by its codeword, so the
   bound holds whichever recipe was used, also one chosen from runs that saw B.

Every training sample is used; the bound's ``n`` is ``|B|``; A's samples enter only the prior.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from ..compress import (
    ModelDescription,
    QuantisedTensor,
    changed_entries,
    delta_bits,
    encode,
    encode_delta,
    materialise,
    quantise,
)
from ..covering import occam_bounds
from ._nonvacuous import (
    ARCHITECTURE_MENUS,
    NonvacuousCase,
    NonvacuousConfig,
    _finetune,
    _fit,
    _float_model,
    _greedy,
    _prune,
    finish_case,
    mistakes,
    task_data,
)
from ._nonvacuous_search import chunk_descent

__all__ = ["run_split_case", "PRIOR_RECIPES", "recipe_code_bits"]

# THEORY F20a: the recipes the reference may be trained with, fixed in code (field overrides of the case's
# config). The stop-38 red team found the digits reference's recipe picked from plain-digits runs on all the
# images, B included; R must be a function of A alone, so the choice is now made on A.
PRIOR_RECIPES: tuple[dict[str, object], ...] = ({}, {"levels": 3}, {"l1": 1e-3}, {"l1": 1e-3, "levels": 3})


def _on_grid(model: torch.nn.Module, ref: ModelDescription) -> ModelDescription:
    """``model``'s weights quantised on ``ref``'s grids (same m and k per tensor; m = 0 stays zero)."""
    state = model.state_dict()
    tensors = tuple(QuantisedTensor(t.name, t.m, t.k, quantise(state[t.name], t.m, t.k) if t.m else t.Q.clone())
                    for t in ref.tensors)
    return ModelDescription(ref.menu, ref.arch, tensors)


def _with_reverted(desc: ModelDescription, ref: ModelDescription, flat: list[int]) -> ModelDescription:
    tensors, start = [], 0
    for t, r in zip(desc.tensors, ref.tensors):
        Q, size = t.Q.clone().flatten(), t.Q.numel()
        local = [i - start for i in flat if start <= i < start + size]
        Q[local] = r.Q.flatten()[local]
        tensors.append(QuantisedTensor(t.name, t.m, t.k, Q.reshape(t.Q.shape)))
        start += size
    return ModelDescription(desc.menu, desc.arch, tuple(tensors))


def _revert(desc: ModelDescription, ref: ModelDescription, X: Tensor, y: Tensor, delta: float,
            max_evals: int = 60, extra_bits: int = 0) -> ModelDescription:
    """Revert chunks of changed integers to the reference's while the kl bound on ``(X, y)`` improves
    (a rejected chunk is halved; the scoring is exact: all of B); ``extra_bits``: F20b's recipe codeword."""
    n = X.shape[0]

    def score(d: ModelDescription) -> float:
        return occam_bounds(mistakes(d, X, y), n, delta_bits(d, ref) + extra_bits, delta).kl

    order = changed_entries(desc, ref) or []
    return chunk_descent(desc, len(order), lambda best, a, b: _with_reverted(best, ref, order[a:b]), score,
                         first_chunk=max(1, len(order) // 8), max_evals=max_evals)


def _reference(config: NonvacuousConfig, menu, X: Tensor, y: Tensor, say):  # noqa: ANN001, ANN202
    """Step 1 on ``(X, y)``: the float model, its weights, the restarts run, the reference and its level count."""
    model, restarts = _float_model(config, menu, X, y, say)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref, levels = _finetune(model, config, menu, X, y, say)
    ref = _greedy(ref, model, X, y, config.delta, config.greedy_passes, config.search_samples)
    if config.greedy_passes:
        ref = _prune(ref, model, X, y, config.delta, config.search_samples)
    return model, trained, restarts, ref, levels


def _select_recipe(config: NonvacuousConfig, menu, XA: Tensor, yA: Tensor, say):  # noqa: ANN001, ANN202
    """F20a: the recipe of :data:`PRIOR_RECIPES` whose reference from A's first half makes the fewest mistakes on
    A's second half (ties: the earlier recipe); returns the config with it and the scores."""
    half = XA.shape[0] // 2
    X1, y1, X2, y2 = XA[:half], yA[:half], XA[half:], yA[half:]
    scores, seen = [], []
    for i, over in enumerate(PRIOR_RECIPES):
        candidate = replace(config, **over)
        if candidate in seen:  # a recipe the case's own already is (l1 = 1e-3 by default): trained once
            continue
        seen.append(candidate)
        say(f"{config.task}: recipe {i + 1}/{len(PRIOR_RECIPES)} for the reference, chosen on A ({over or 'as given'})")
        ref = _reference(_sub(candidate, half), menu, X1, y1, say)[3]
        scores.append({"recipe": dict(over), "mistakes_on_A2": mistakes(ref, X2, y2), "n_A2": int(X2.shape[0])})
    best = min(range(len(scores)), key=lambda i: (scores[i]["mistakes_on_A2"], i))
    chosen = scores[best]["recipe"]
    return replace(config, **chosen), {"chosen": chosen, "scores": scores}


def _sub(config: NonvacuousConfig, n: int) -> NonvacuousConfig:
    """The config of a reference trained on ``n`` samples of A: no split of its own (the share check of the whole
    case re-ran on A and refused cases it had accepted, stop 38)."""
    return replace(config, n_train=n, prior_split=0.0, prior_select=False)


# Note [recipe code] (THEORY F20b): every field of the config that can change the reference R or the code built from
# it, written in a generic prefix code fixed before any data: the architecture as its menu index in ceil(log2 |menu|)
# bits, a switch in one bit, an integer v >= 0 as a selector bit then Elias gamma of v + 1 or its decimal form
# (v = M 10^e, e >= 0: gamma(M), gamma(e + 1)), whichever is shorter (an optional integer after a presence bit), a real
# as a zero bit, then the digits M and exponent e of its shortest decimal spelling (repr) as gamma(M) and a sign bit
# with gamma(|e| + 1). Left out: the data's fields (task, sizes), the label (variant) and delta, the bound's own
# confidence, which every bound of this kind takes as fixed in advance.
_RECIPE_SKIP = ("task", "n_train", "n_test", "variant", "prior_recipe_bits", "delta")


def _gamma_bits(v: int) -> int:
    """Length of the Elias gamma codeword of the integer ``v >= 1``."""
    return 2 * (int(v).bit_length() - 1) + 1


def _int_bits(v: int) -> int:
    """Length of Note [recipe code]'s codeword of an integer ``v >= 0``."""
    decimal = math.inf
    if v > 0:
        e = len(str(v)) - len(str(v).rstrip("0"))
        decimal = _gamma_bits(v // 10**e) + _gamma_bits(e + 1)
    return 1 + min(_gamma_bits(v + 1), decimal)


def _real_bits(x: float) -> int:
    """Length of Note [recipe code]'s codeword of a real ``x >= 0``."""
    from decimal import Decimal

    if x == 0:
        return 1
    sign, digits, exp = Decimal(repr(float(x))).normalize().as_tuple()
    mant = int("".join(map(str, digits)))
    return 1 + 1 + _gamma_bits(mant) + 1 + _gamma_bits(abs(exp) + 1)  # zero bit, sign, M, exponent sign, |e| + 1


def recipe_code_bits(config: NonvacuousConfig) -> int:
    """Bits of ``config``'s recipe in the generic recipe code (Note [recipe code]); the data-dependent prior's bound
    pays them on top of the relative code (THEORY F20b)."""
    import dataclasses

    menu = ARCHITECTURE_MENUS[config.task]
    bits = 0
    for f in dataclasses.fields(config):
        if f.name in _RECIPE_SKIP:
            continue
        v = getattr(config, f.name)
        if f.name == "arch":
            bits += max(1, (len(menu) - 1).bit_length())
        elif f.name == "code":
            bits += 1  # "entropy" or "fixed"
        elif isinstance(v, bool):
            bits += 1
        elif v is None:
            bits += 1  # absent (the default rule applies)
        elif isinstance(v, int):
            bits += (1 if f.name in ("epochs", "qat_epochs") else 0) + _int_bits(v)
        elif isinstance(v, float):
            bits += (1 if f.name == "qat_lr" else 0) + _real_bits(v)
        else:  # a new field must be given a code here before it can steer R
            raise TypeError(f"the recipe code has no rule for field {f.name!r} ({type(v).__name__})")
    return bits


def run_split_case(config: NonvacuousConfig, progress: Callable[[str], None] | None = None) -> NonvacuousCase:
    """Steps 1-3 of the module docstring; the case's ``bound`` is the kl bound on B with the relative code."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    say = progress or (lambda _msg: None)
    X, y, X_te, y_te = task_data(config.task, config.n_train, config.n_test, config.seed)
    menu = ARCHITECTURE_MENUS[config.task]
    n_a = int(round(config.prior_split * config.n_train))
    XA, yA, XB, yB = X[:n_a], y[:n_a], X[n_a:], y[n_a:]
    selection = None
    asked = config
    if config.prior_select:
        config, selection = _select_recipe(config, menu, XA, yA, say)
    model, trained, restarts, ref, levels = _reference(_sub(config, n_a), menu, XA, yA, say)
    with torch.no_grad():
        float_err = float((model(X_te).argmax(-1) != y_te).double().mean())
    say(f"{config.task} n={config.n_train}: fine-tuning on A and B on the reference's grids")
    tuned = materialise(ref, torch.float64).train()
    grid = {t.name: (t.m, t.k) for t in ref.tensors}
    _fit(tuned, X, y, epochs=config.finetune_epochs, lr=config.lr / 10, l1=0.0, batch_size=config.batch_size,
         seed=config.seed + 2, grid=grid, refit_scales=False)
    # F20b: every length pays the recipe's own codeword (step 3 of the module docstring; Note [recipe code]); the
    # config as the case was asked for, before F20a's choice on A (that choice is a function of A and the config)
    union = recipe_code_bits(asked) if config.prior_recipe_bits is None else config.prior_recipe_bits
    final = _revert(_on_grid(tuned, ref), ref, XB, yB, config.delta, extra_bits=union)
    candidates = [(occam_bounds(mistakes(d, XB, yB), XB.shape[0], delta_bits(d, ref) + union, config.delta), d)
                  for d in (ref, final)]
    bound, desc = min(candidates, key=lambda c: c[0].kl)
    split = {"prior_share": config.prior_split, "n_prior": n_a, "n_bound": int(XB.shape[0]),
             "reference_codeword": {"hex": encode(ref).to_bytes().hex(), "bits": len(encode(ref))},
             "changed_integers": len(changed_entries(desc, ref) or []),
             "relative_code_bits": bound.description_bits - union, "recipe_code_bits": union,
             "bound_bits": bound.description_bits,
             "reference_bound_on_B": candidates[0][0].kl, "fine_tuned_bound_on_B": candidates[1][0].kl,
             "recipe_selection": selection,
             "decode": "transcover.compress.decode_delta(bits, decode(reference bits, menu))",
             "kind": "kl bound on B; the code is built from A only (data-dependent prior, THEORY F20), and the "
                     f"reference's recipe paid by its {union}-bit codeword in the generic recipe code (F20b)"}
    pairs = {"float model trained on A": trained, "fine-tuned weights (A and B)": tuned.state_dict()}
    return finish_case(config, desc, bound, encode_delta(desc, ref).to_bytes().hex(), pairs, (X, y, X_te, y_te),
                       t0=t0, restarts=restarts, levels=levels, float_err=float_err, say=say, split=split,
                       cpu0=cpu0)
