"""Certified spectral norms and the other matrix norms the bounds need (seed section 2.1)."""

from ._spectral import product_norm_estimate as product_norm_estimate
from ._spectral import product_norm_interval as product_norm_interval
from ._spectral import scale_interval as scale_interval
from ._spectral import spectral_norm_estimate as spectral_norm_estimate
from ._spectral import spectral_norm_interval as spectral_norm_interval

__all__ = [
    "spectral_norm_interval", "product_norm_interval", "spectral_norm_estimate",
    "product_norm_estimate", "scale_interval",
]

from ._analyze import SCHEMA_VERSION as SCHEMA_VERSION
from ._analyze import AnalysisResult as AnalysisResult
from ._analyze import EmbeddingNorms as EmbeddingNorms
from ._analyze import HeadNorms as HeadNorms
from ._analyze import LayerNorms as LayerNorms
from ._analyze import MatrixNorms as MatrixNorms
from ._analyze import NormParams as NormParams
from ._analyze import analyze_spec as analyze_spec
from ._model import Distance as Distance
from ._model import HeadMeasure as HeadMeasure
from ._model import LayerMeasure as LayerMeasure
from ._model import ModelNorms as ModelNorms
from ._model import NormMeasure as NormMeasure
from ._model import matrix_interval as matrix_interval
from ._model import measure_layer as measure_layer
from ._model import measure_model as measure_model
from ._model import product_interval as product_interval
from ._entrywise import frobenius_interval as frobenius_interval
from ._entrywise import l21_interval as l21_interval
from ._entrywise import product_frobenius_interval as product_frobenius_interval
from ._entrywise import product_l21_interval as product_l21_interval
from ._entrywise import vector_norm_interval as vector_norm_interval

__all__ += [
    "SCHEMA_VERSION", "AnalysisResult", "EmbeddingNorms", "HeadNorms", "LayerNorms", "MatrixNorms",
    "NormParams", "analyze_spec", "frobenius_interval", "l21_interval", "product_frobenius_interval",
    "product_l21_interval", "vector_norm_interval",
    "Distance", "HeadMeasure", "LayerMeasure", "ModelNorms", "NormMeasure", "measure_model",
    "measure_layer", "matrix_interval", "product_interval",
]

from ._per_matrix import PER_MATRIX_SCHEMA as PER_MATRIX_SCHEMA
from ._per_matrix import PerMatrixResult as PerMatrixResult
from ._per_matrix import per_matrix_norms as per_matrix_norms

__all__ += ["PER_MATRIX_SCHEMA", "PerMatrixResult", "per_matrix_norms"]
