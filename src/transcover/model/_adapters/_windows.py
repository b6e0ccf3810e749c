"""Which layers of a decoder use sliding-window attention, from an HF configuration.

transformers 5 decides it per layer:

* ``layer_types`` (Qwen2, and any config that lists it): ``"sliding_attention"`` layers use a window
  of ``sliding_window`` keys, ``"full_attention"`` layers none;
* otherwise Qwen2 (``use_sliding_window``) windows the layers ``i >= max_window_layers``;
* otherwise Mistral windows every layer when ``sliding_window`` is set (``MistralModel.forward``
  builds ``create_sliding_window_causal_mask`` whenever ``config.sliding_window`` is not None).

A window is the mask "query ``i`` sees key ``j`` iff ``i - window < j <= i``" (Note [window mask]
in ``transcover.model._functional``).
"""

from __future__ import annotations

from ..._errors import InputError, UnsupportedArchitectureError

__all__ = ["sliding_windows"]


def sliding_windows(config: dict, n_layers: int, *, arch: str, name: str) -> list[int | None]:
    """The window of each layer (``None``: full causal attention).

    Raises:
        InputError: a ``layer_types`` list of the wrong length, or a non-positive window.
        UnsupportedArchitectureError: a layer type other than full or sliding attention.
    """
    window = config.get("sliding_window")
    use = config.get("use_sliding_window")
    if window is None or use is False:
        # Qwen2Config sets sliding_window=None itself when use_sliding_window is off; a stale value
        # left in an older config.json is not used by the model either.
        types = config.get("layer_types")
        if types and any(t != "full_attention" for t in types):
            bad = sorted({t for t in types if t != "full_attention"})
            raise InputError(f"{arch} configuration of {name} lists layer_types {bad} but no sliding_window")
        return [None] * n_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError(f"{arch} configuration of {name} has sliding_window={window!r}; expected a positive integer")
    types = config.get("layer_types")
    if types:
        if len(types) != n_layers:
            raise InputError(f"{arch} configuration of {name} lists {len(types)} layer_types for {n_layers} layers")
        out: list[int | None] = []
        for i, t in enumerate(types):
            if t not in ("full_attention", "sliding_attention"):
                raise UnsupportedArchitectureError(
                    f"{arch}: layer {i} has attention type {t!r}; only full and sliding-window attention are supported")
            out.append(window if t == "sliding_attention" else None)
        return out
    if use is True and config.get("model_type") in ("qwen2_moe", "qwen3_moe"):
        # transformers 5.25 windows Qwen2-MoE's layers with (i + 1) % 2 and i < max_window_layers and every
        # Qwen3-MoE layer, where 4.x read Qwen2's i >= max_window_layers: the function depends on the version
        raise InputError(f"{arch} configuration of {name} ({config['model_type']}) turns use_sliding_window on "
                         "without layer_types, and transformers versions window different layers of it; save the "
                         "configuration with its layer_types (as transformers 5 writes it)")
    if use is True and config.get("max_window_layers") is not None:
        first = int(config["max_window_layers"])
        return [window if i >= first else None for i in range(n_layers)]
    return [window] * n_layers
