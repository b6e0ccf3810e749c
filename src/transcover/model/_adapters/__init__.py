"""Architecture adapters: each turns one architecture's tensors into the seed's decomposition.

One file per architecture (``_bert``, ``_gpt2``, ``_llama``, ``_vit``, ``_torch_encoder``,
``_reference``); each module docstring states the block's equations as the original code computes
them and how each tensor maps onto the spec.  ``_registry`` recognises architectures.
"""

from ._registry import ARCH_ALIASES as ARCH_ALIASES
from ._registry import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from ._registry import adapter_for as adapter_for
from ._registry import arch_from_config as arch_from_config

__all__ = ["ARCH_ALIASES", "SUPPORTED_ARCHITECTURES", "adapter_for", "arch_from_config"]
