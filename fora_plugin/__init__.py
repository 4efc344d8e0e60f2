"""FoRA: Fisher-orthogonal Rank Adaptation as a plugin for PEFT, TRL and Axolotl.

The public API: the config, the Stiefel adapter, Fisher scoring, layer selection, the optimizers and the TRL trainer.
The layers of the package, each importing only those before it: errors, logfilters, stiefel, validation, files,
models, targets, checkpoints, fisher, selection, adapter, optim, config, backward, diagnostics, plots, monitor, zero,
fsdp, compatibility, wiring, training, trainer, data, axolotl, recipe, evaluation, report, mt_bench, plan, ablate,
cli.

May import: every module of fora_plugin.
"""

from . import logfilters, stiefel  # noqa: F401  (logfilters first: bitsandbytes logs while PEFT imports it)
from .adapter import make_stiefel, stiefel_num_experts, stiefel_parameters
from .config import FoRAConfig
from .fisher import FisherScores, fisher_scores
from .optim import CayleyAdam, FoRAOptimizer, build_fora_optimizer, create_fora_optimizer
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
    "create_fora_optimizer",
    "fisher_scores",
    "make_stiefel",
    "select_layers",
    "stiefel",
    "stiefel_num_experts",
    "stiefel_parameters",
]
