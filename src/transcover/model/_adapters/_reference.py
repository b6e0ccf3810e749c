"""transcover's own :class:`~transcover.model.ReferenceTransformer`, read from a safetensors file.

``save_reference`` writes the module's ``state_dict`` with ``transcover_arch="reference"`` and the
:class:`~transcover.model.ReferenceConfig` as JSON in ``transcover_config``.  The weights are
already in the decomposition's layout, so the adapter reads each parameter (validated, with the
shape the configuration implies) and hands them to
:func:`~transcover.model._reference_spec.build_reference_spec`, the one definition of the reference
model's spec (shared with ``reference_spec(module)``); no module is built and torch is not imported.
"""

from __future__ import annotations

import json

from ..._errors import InputError
from .._arrays import astype_like_storage
from .._reference_spec import ReferenceConfig, build_reference_spec, reference_shapes
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
    # Keep the stored precision: float64 weights stay float64, everything else becomes float32
    # (as the module, built in that dtype, would hold them).
    dtype = "float64" if src.storage_dtype() == "float64" else "float32"
    shapes = reference_shapes(cfg)
    tensors = {k: astype_like_storage(src.get(k, shape), dtype) for k, shape in shapes.items()}
    extra = sorted(set(src.keys()) - set(shapes))
    if extra:
        raise InputError(f"reference checkpoint {name} holds tensors its configuration does not define: "
                         f"{', '.join(extra[:5])}")
    return build_reference_spec(cfg, tensors.__getitem__, name)
