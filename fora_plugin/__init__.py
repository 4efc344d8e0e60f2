"""FoRA: Fisher-orthogonal Rank Adaptation as a plugin for PEFT, TRL and Axolotl."""

from . import stiefel
from .adapter import make_stiefel, stiefel_parameters
from .optim import CayleyAdam, FoRAOptimizer, build_fora_optimizer


__version__ = "0.1.0"

__all__ = [
    "CayleyAdam",
    "FoRAOptimizer",
    "__version__",
    "build_fora_optimizer",
    "make_stiefel",
    "stiefel",
    "stiefel_parameters",
]
