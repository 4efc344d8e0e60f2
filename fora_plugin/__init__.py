"""FoRA: Fisher-orthogonal Rank Adaptation as a plugin for PEFT, TRL and Axolotl."""

from . import _quiet, stiefel  # noqa: F401  (_quiet first: bitsandbytes logs while PEFT imports it)
from .adapter import make_stiefel, stiefel_num_experts, stiefel_parameters
from .config import FoRAConfig
from .fisher import FisherScores, fisher_scores
from .optim import CayleyAdam, FoRAOptimizer, build_fora_optimizer
from .selection import select_layers
from .trainer import FoRASFTTrainer


__version__ = "0.1.0"

__all__ = [
    "CayleyAdam",
    "FisherScores",
    "FoRAConfig",
    "FoRAOptimizer",
    "FoRASFTTrainer",
    "__version__",
    "build_fora_optimizer",
    "fisher_scores",
    "make_stiefel",
    "select_layers",
    "stiefel",
    "stiefel_num_experts",
    "stiefel_parameters",
]
