"""transcover's own :class:`~transcover.model.ReferenceTransformer`, read from a safetensors file.

``save_reference`` writes the module's ``state_dict`` with ``transcover_arch="reference"`` and the
:class:`~transcover.model.ReferenceConfig` as JSON in ``transcover_config``.  The weights are
already in the decomposition's layout, so the adapter rebuilds the module from its configuration,
fills it with the validated tensors and hands it to :func:`~transcover.model.reference_spec`, the one
definition of the reference model's spec.
"""

from __future__ import annotations

import json

import torch

from ..._errors import InputError
from .._reference import ReferenceConfig, ReferenceTransformer, reference_spec
from .._sources import TensorSource
from .._spec import TransformerSpec
from ._common import no_layers

__all__ = ["build_reference"]


def build_reference(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    if config.get("n_layers") == 0:
        raise no_layers(name)
    try:
        cfg = ReferenceConfig.from_json(json.dumps(config))
    except (TypeError, ValueError) as err:
        raise InputError(f"reference configuration of {name} is invalid: {err}") from err
    # Build in the stored precision: loading float64 weights into float32 parameters would round them.
    dtype = torch.float64 if src.storage_dtype() == "float64" else torch.float32
    with torch.device("meta"):
        model = ReferenceTransformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tensors = {k: src.get(k, shape).to(dtype) for k, shape in expected.items()}
    model = model.to_empty(device="cpu").to(dtype)
    model.load_state_dict(tensors, strict=True)
    model.eval()
    return reference_spec(model, name=name)
