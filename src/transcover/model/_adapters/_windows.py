"""Which layers of a decoder use sliding-window attention, from an HF configuration.

transformers 5.25 decides it per model type (its ``modeling_<type>.py``), and the rule differs:

* Llama, Gemma 1, OLMo 1/2: never; their models build only the causal mask, and a ``sliding_window``
  key in config.json is an attribute nothing reads (red team 195: it was read as a window);
* Mistral, Mixtral: every layer when ``sliding_window`` is not None (``MistralModel.forward`` builds
  ``create_sliding_window_causal_mask`` then), whatever ``use_sliding_window``, ``max_window_layers`` or
  ``layer_types`` say (``MistralConfig`` only logs that it ignores ``layer_types``);
* Qwen2, Qwen3: ``sliding_window`` is kept only with ``use_sliding_window`` (``__post_init__``); the layers
  listed ``"sliding_attention"`` in ``layer_types`` use it, and without ``layer_types`` the config class
  lists the layers ``i >= max_window_layers`` as sliding when the window is set;
* Qwen2-MoE, Gemma 2, Gemma 3: the ``"sliding_attention"`` layers of ``layer_types`` (Gemma's adapter
  fills them in as the config classes do; Qwen2-MoE without them: refused, see below);
* Qwen3-MoE: every layer when ``use_sliding_window`` (its config class has no ``layer_types``).

A window is the mask "query ``i`` sees key ``j`` iff ``i - window < j <= i``" (Note [window mask]
in ``transcover.model._functional``).
"""

from __future__ import annotations

from ..._errors import InputError, UnsupportedArchitectureError

__all__ = ["sliding_windows"]

_NEVER = ("llama", "gemma", "olmo", "olmo2")
_EVERY = ("mistral", "mixtral")
_BY_LAYER_TYPES = ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3", "gemma3_text")


def sliding_windows(config: dict, n_layers: int, *, family: str, arch: str, name: str) -> list[int | None]:
    """The window of each layer (``None``: full causal attention), as transformers 5.25's ``family``
    (the model type) computes it.

    Raises:
        InputError: a ``layer_types`` list of the wrong length, sliding layers without a window, a
            non-positive window, a model type whose rule is unknown with a window in its configuration, or
            a Qwen-MoE configuration whose windowed layers depend on the transformers version.
        UnsupportedArchitectureError: a layer type other than full or sliding attention.
    """
    types = config.get("layer_types")
    use = config.get("use_sliding_window")
    if family in _NEVER:
        return [None] * n_layers
    if family in _EVERY:
        return [_window(config, arch, name)] * n_layers
    if family == "qwen3_moe":
        if use is not True or config.get("sliding_window") is None:
            return [None] * n_layers
        window = _window(config, arch, name)
        if types and all(t == "sliding_attention" for t in types):
            return [window] * n_layers
        # transformers 5.25 windows every layer; 4.x read Qwen2's i >= max_window_layers (or layer_types)
        raise InputError(f"{arch} configuration of {name} (qwen3_moe) turns use_sliding_window on, and transformers "
                         "versions window different layers of it (5.25: every layer, whatever layer_types or "
                         "max_window_layers say); but got layer_types="
                         f"{types!r}, max_window_layers={config.get('max_window_layers')!r}")
    if family not in _BY_LAYER_TYPES:
        if config.get("sliding_window") is not None or (types and any(t != "full_attention" for t in types)):
            raise InputError(f"{arch} configuration of {name} sets a sliding window for model_type {family!r}, "
                             "whose windowed layers are not known here (transformers decides them per model "
                             f"type); but got sliding_window={config.get('sliding_window')!r}")
        return [None] * n_layers
    window = config.get("sliding_window")
    if family.startswith("qwen") and use is not True:
        window = None  # Qwen2Config / Qwen3Config / Qwen2MoeConfig drop the window unless use_sliding_window
    if not types:
        if window is None:
            return [None] * n_layers
        if family == "qwen2_moe":
            # transformers 5.25 windows Qwen2-MoE's layers with (i + 1) % 2 and i < max_window_layers, where 4.x
            # read Qwen2's i >= max_window_layers: the function depends on the version
            raise InputError(f"{arch} configuration of {name} (qwen2_moe) turns use_sliding_window on without "
                             "layer_types, and transformers versions window different layers of it; save the "
                             "configuration with its layer_types (as transformers 5 writes it)")
        first = config.get("max_window_layers")
        if family.startswith("qwen") and (isinstance(first, bool) or not isinstance(first, int)):
            raise InputError(f"{arch} configuration of {name}: max_window_layers must be an integer (the first "
                             f"windowed layer), but got max_window_layers={first!r}")
        window = _window(config, arch, name)
        return [window if i >= (first or 0) else None for i in range(n_layers)]
    if len(types) != n_layers:
        raise InputError(f"{arch} configuration of {name} lists {len(types)} layer_types for {n_layers} layers")
    out: list[int | None] = []
    for i, t in enumerate(types):
        if t not in ("full_attention", "sliding_attention"):
            raise UnsupportedArchitectureError(
                f"{arch}: layer {i} has attention type {t!r}; only full and sliding-window attention are supported")
        if t == "sliding_attention" and window is None:
            raise InputError(f"{arch} configuration of {name} has 'sliding_attention' layers (its layer_types, "
                             "as given or as transformers fills them in) but no sliding_window"
                             + (" (use_sliding_window is off)" if family.startswith("qwen") else ""))
        out.append(_window(config, arch, name) if t == "sliding_attention" else None)
    return out


def _window(config: dict, arch: str, name: str) -> int | None:
    """``sliding_window``: None, or a positive integer (InputError otherwise)."""
    window = config.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InputError(f"{arch} configuration of {name} has sliding_window={window!r}; expected a positive integer")
    return window
