"""Describing a trained model in few bits: quantisation on a fixed grid, prefix-free codes with exact lengths.

The description length ``L`` is what the finite-class (Occam) bound of THEORY F18 pays
(``transcover.covering.kl_occam_bound``); ``_codes`` holds the coders (Elias gamma, enumerative),
``_quantise`` the per-matrix grid and the straight-through estimator, ``_describe`` the model's code.
"""

from ._codes import BitReader as BitReader
from ._codes import BitWriter as BitWriter
from ._codes import enumerative_length as enumerative_length
from ._codes import gamma_length as gamma_length
from ._delta import changed_entries as changed_entries
from ._delta import decode_delta as decode_delta
from ._delta import delta_bits as delta_bits
from ._delta import encode_delta as encode_delta
from ._describe import ModelDescription as ModelDescription
from ._fixed import decode_fixed as decode_fixed
from ._fixed import encode_fixed as encode_fixed
from ._describe import QuantisedTensor as QuantisedTensor
from ._describe import decode as decode
from ._describe import description_bits as description_bits
from ._describe import encode as encode
from ._describe import fixed_length_bits as fixed_length_bits
from ._describe import materialise as materialise
from ._describe import parameter_shapes as parameter_shapes
from ._quantise import SCALE_STEPS_PER_OCTAVE as SCALE_STEPS_PER_OCTAVE
from ._quantise import best_scale_index as best_scale_index
from ._quantise import dequantise as dequantise
from ._quantise import fake_quantise as fake_quantise
from ._quantise import quantise as quantise
from ._quantise import scale_of as scale_of

__all__ = [
    "BitReader", "BitWriter", "enumerative_length", "gamma_length",
    "changed_entries", "decode_delta", "delta_bits", "encode_delta",
    "ModelDescription", "QuantisedTensor", "decode", "decode_fixed", "encode_fixed", "description_bits", "encode", "fixed_length_bits",
    "materialise", "parameter_shapes",
    "SCALE_STEPS_PER_OCTAVE", "best_scale_index", "dequantise", "fake_quantise", "quantise", "scale_of",
]
