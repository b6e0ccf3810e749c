"""Which differences between two specs change the *function* beyond what their weights say.

Note [structural differences]: the perturbation lemma G.3 (THEORY F6-F8) bounds
``sup_X ||g(W_a)(X) - g(W_b)(X)||`` for two parameter sets *of one architecture*: it charges the
distance between corresponding matrices and nothing else.  Every other field of a spec that the
forward pass (``_functional``) reads changes the function by an amount no matrix distance sees, so
two specs that differ in such a field can only be compared after that difference is bounded by a
term of its own, or refused.  :func:`structural_differences` lists them; every comparison of two
models (``transcover.lipschitz.perturbation_bound`` and ``perturbation_coefficients(other=...)``,
``transcover perturb``, the covering bound's ``reference`` model) refuses through
:func:`require_same_structure`.

Differences that are *not* structural, because the bound already accounts for them exactly:

* the softmax ``scale`` (without RoPE it sits inside ``W_KQ^h = scale W_Q^h W_K^hT``, whose
  distance is charged; with RoPE it is charged through ``||scale W_Q - scale~ W~_Q||``), except
  with RoPE and query/key biases or query/key normalisation, where Lemma G.3 charges W_Q and W_K
  separately and a changed scale is refused by the measurement (Note [split scores] in ``norms._model``);
* grouped-query sharing and, without RoPE, the head dimension: the attention block depends on the
  weights only through the per-query-head ``W_KQ^h``, ``b_KQ^h``, ``W_OV^h`` and the folded output
  bias (Note [attention biases] in ``_spec``), all ``d x d`` or ``d``-sized whatever the layout;
* a bias or normalisation scale that one model has and the other lacks: the forward pass with
  ``None`` equals the one with zeros (biases, ``beta``) or ones (``gamma``), and the bound charges
  the distance to those;
* a missing normalisation (``None``) against ``NormKind.NONE``: both are the identity;
* LayerNorm/RMSNorm ``eps``: at a fixed input the change is at most ``max|gamma| sqrt(d)`` times a
  closed-form function of the two floors, charged as its own term (Note [eps change] in
  ``transcover.lipschitz._normalisation``);
* fields the forward pass never reads: names, ``arch``, ``config``, embeddings, ``RopeSpec.max_position``.

Structural (refused): T5's relative position bias presence and bucketing (its table is charged), width, depth, norm placement, sequential vs parallel residual, query/key normalisation (and its scope), branch-output norms (F26), the soft-capping constant, norm kind, attention kind (dot-product vs L2), causal masking, sliding-window size, RoPE presence / base / rotary dimension / scaled frequencies, the
head dimension under RoPE or L2 attention, the number of query heads, activation, gated vs plain
FFN, FFN width and, when the MLP head is part of the compared function, the head's layout.
"""

from __future__ import annotations

from ._spec import NormKind, NormSpec, TransformerSpec

__all__ = ["structural_differences", "require_same_structure"]


def _norm_key(n: NormSpec | None) -> tuple:
    return ((NormKind.NONE if n is None else n.kind).value,)


def _norm_diffs(na: NormSpec | None, nb: NormSpec | None, where: str) -> list[str]:
    ka, kb = _norm_key(na), _norm_key(nb)
    if ka[0] != kb[0]:
        return [f"normalisation kind: {where} {ka[0]} vs {kb[0]}"]
    return []


def _rope_key(rope, d_head: int) -> str:
    if rope is None:
        return "none"
    key = f"theta={float(rope.theta)!r}, rotary_dim={rope.rotary_dim or d_head}"  # None: the whole head
    if rope.inv_freq_values is not None:  # scaled RoPE (THEORY F22): the frequencies are compared themselves
        key += ", scaled frequencies " + ",".join(repr(float(v)) for v in rope.inv_freq_values)
    if getattr(rope, "dynamic", None) is not None:  # dynamic NTK: the frequencies follow the length
        key += f", dynamic factor {float(rope.dynamic[0])!r} above {int(rope.dynamic[1])}"
    return key


def _layer_diffs(la, lb, i: int) -> list[str]:
    out: list[str] = []
    if la.placement is not lb.placement:
        out.append(f"norm placement: layer {i} {la.placement.value} vs {lb.placement.value}")
    if la.residual is not lb.residual:
        out.append(f"residual: layer {i} {la.residual.value} vs {lb.residual.value}")
    out += _norm_diffs(la.norm_attn, lb.norm_attn, f"layer {i} norm_attn")
    out += _norm_diffs(la.norm_ffn, lb.norm_ffn, f"layer {i} norm_ffn")
    for site in ("post_norm_attn", "post_norm_ffn"):  # branch-output norms (THEORY F26)
        out += _norm_diffs(getattr(la, site), getattr(lb, site), f"layer {i} {site}")
    aa, ab = la.attention, lb.attention
    if aa.kind != ab.kind:
        out.append(f"attention kind: layer {i} {aa.kind} vs {ab.kind}")
    if bool(aa.causal) != bool(ab.causal):
        out.append(f"masking: layer {i} causal={bool(aa.causal)} vs {bool(ab.causal)}")
    if aa.window != ab.window:
        out.append(f"masking: layer {i} sliding window={aa.window} vs {ab.window}")
    ra, rb = _rope_key(aa.rope, aa.d_head), _rope_key(ab.rope, ab.d_head)
    if ra != rb:
        out.append(f"rotary position embedding: layer {i} {ra[:80]} vs {rb[:80]}")
    qa = tuple(n is not None for n in (aa.q_norm, aa.k_norm))
    qb = tuple(n is not None for n in (ab.q_norm, ab.k_norm))
    if qa != qb:
        out.append(f"query/key normalisation: layer {i} (q, k) {qa} vs {qb}")
    pa, pb = (None if x is None else (x.num_buckets, x.max_distance, x.bidirectional)
              for x in (aa.position_bias, ab.position_bias))
    if pa != pb:  # the tables' values are charged by G.3; presence and bucketing are the function's shape
        out.append(f"relative position bias (buckets, max distance, bidirectional): layer {i} {pa} vs {pb}")
    if any(qa) and aa.qk_norm_scope != ab.qk_norm_scope:
        out.append(f"query/key normalisation scope: layer {i} {aa.qk_norm_scope} vs {ab.qk_norm_scope}")
    if aa.softcap != ab.softcap:
        out.append(f"attention soft-capping: layer {i} {aa.softcap} vs {ab.softcap}")
    if aa.n_heads != ab.n_heads:
        out.append(f"number of heads: layer {i} {aa.n_heads} vs {ab.n_heads}")
    if aa.d_head != ab.d_head and (aa.rope is not None or ab.rope is not None or "l2" in (aa.kind, ab.kind)):
        # RoPE rotates within the head dimension and L2 attention's A_h = W_Q W_Q^T / sqrt(d_head)
        # depends on it: the per-head matrices no longer tell the whole function.
        out.append(f"head dimension: layer {i} d_head={aa.d_head} vs {ab.d_head} (with RoPE or L2 attention)")
    fa, fb = la.ffn, lb.ffn
    if fa.activation != fb.activation:
        out.append(f"activation: layer {i} {fa.activation.value} vs {fb.activation.value}")
    if fa.gated != fb.gated:
        out.append(f"gated FFN: layer {i} gated={fa.gated} vs {fb.gated}")
    if fa.d_ff != fb.d_ff:
        out.append(f"FFN width: layer {i} d_ff={fa.d_ff} vs {fb.d_ff}")
    return out


def _head_diffs(ha, hb) -> list[str]:
    if (ha is None) != (hb is None):
        return [f"MLP head: {'present' if ha is not None else 'absent'} vs {'present' if hb is not None else 'absent'}"]
    if ha is None:
        return []
    out = []
    sa, sb = [tuple(w.shape) for w in ha.weights], [tuple(w.shape) for w in hb.weights]
    if sa != sb:
        out.append(f"MLP head: layer shapes {sa} vs {sb}")
    if ha.activation != hb.activation:
        out.append(f"MLP head: activation {ha.activation.value} vs {hb.activation.value}")
    if ha.readout != hb.readout:
        out.append(f"MLP head: readout {ha.readout} vs {hb.readout}")
    return out


def structural_differences(spec_a: TransformerSpec, spec_b: TransformerSpec, *,
                           include_head: bool = False) -> list[str]:
    """Every difference between two specs that changes the function and no weight distance bounds.

    Each entry reads ``"<what>: <where> <value in a> vs <value in b>"``, e.g.
    ``"masking: layer 0 causal=True vs False"``.  The list is empty when the two specs are one
    architecture in the sense of Note [structural differences] (they may still differ in weights,
    softmax scale, grouped-query layout and bias presence, which the perturbation lemma charges).

    Args:
        spec_a, spec_b: the two models.
        include_head: also compare the MLP heads (off for ``g_L``, which excludes the head).

    Returns:
        A list of one-line descriptions, in forward order; empty if there is nothing structural.
    """
    out: list[str] = []
    if spec_a.d_model != spec_b.d_model:
        out.append(f"width: d_model={spec_a.d_model} vs {spec_b.d_model}")
    if spec_a.n_layers != spec_b.n_layers:
        out.append(f"depth: {spec_a.n_layers} layers vs {spec_b.n_layers}")
    out += _norm_diffs(spec_a.input_norm, spec_b.input_norm, "input_norm")
    if not out:  # the layers line up only when width and depth agree
        for i, (la, lb) in enumerate(zip(spec_a.layers, spec_b.layers)):
            out += _layer_diffs(la, lb, i)
    out += _norm_diffs(spec_a.final_norm, spec_b.final_norm, "final_norm")
    ra, rb = _source_activation(spec_a), _source_activation(spec_b)
    if (ra == "gelu_fast") != (rb == "gelu_fast") and not any(o.startswith("activation:") for o in out):
        # both read as tanh GELU, but HF's FastGELU uses the constant 0.7978845608 for sqrt(2/pi): the two functions
        # differ (by 3.6e-13 relative), which G.3's weight distances do not see (a certified 0 was beaten by 3.2e-14,
        # red team 165)
        out.append(f"activation: {ra} vs {rb} (HF's gelu_fast uses the constant 0.7978845608, not sqrt(2/pi))")
    if include_head:
        out += _head_diffs(spec_a.head, spec_b.head)
    return out


def _source_activation(spec: TransformerSpec) -> str | None:
    """The checkpoint config's own activation name (``hidden_act`` and its aliases), lower case; None if absent."""
    cfg = spec.config.get("source_config") if isinstance(spec.config, dict) else None
    if not isinstance(cfg, dict):
        return None
    for key in ("hidden_act", "activation_function", "hidden_activation"):
        if isinstance(cfg.get(key), str):
            return cfg[key].lower()
    return None


def require_same_structure(spec_a: TransformerSpec, spec_b: TransformerSpec, *,
                           message: str = "cannot bound the change between models that differ in",
                           include_head: bool = False) -> None:
    """Raise one clear :class:`~transcover._errors.InputError` if the specs differ structurally.

    The message names the first difference (and how many more there are), e.g. ``cannot bound the
    change between models that differ in masking: layer 0 causal=True vs False``; ``message`` is
    the text before the difference.

    Raises:
        InputError: :func:`structural_differences` is not empty.
    """
    from .._errors import InputError

    diffs = structural_differences(spec_a, spec_b, include_head=include_head)
    if diffs:
        more = f" (and {len(diffs) - 1} more difference{'s' if len(diffs) > 2 else ''})" if len(diffs) > 1 else ""
        raise InputError(f"{message} {diffs[0]}{more}")
