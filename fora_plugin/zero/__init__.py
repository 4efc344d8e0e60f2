"""FoRA under DeepSpeed: ZeRO-1/2 with the Stiefel ``lora_B`` replicated beside the partition, ZeRO-3 with each
``lora_B`` gathered whole for its step (:class:`Zero3FoRAOptimizer`, :func:`zero3_scoring_engine`), and the Trainer
glue (:func:`prepare_deepspeed`, :class:`ZeroStiefelCallback`). How they work: :class:`ZeroClientOptimizer`'s
docstring.

May import: zero.checks, zero.client, zero.deepspeed_internals, zero.launch, zero.prepare, zero.scoring, zero.stage12,
zero.stage3.
"""

from .checks import check_deepspeed_config, load_deepspeed_config
from .client import ZeroClientOptimizer, find_zero_client
from .deepspeed_internals import gathered_parameters, gathered_trainable_parameters, zero_config
from .launch import deepspeed_zero_stage, join_deepspeed_process_group
from .prepare import ZeroStiefelCallback, prepare_deepspeed
from .scoring import zero3_scoring_engine
from .stage3 import Zero3FoRAOptimizer, build_zero3_fora_optimizer
from .stage12 import ZeroFoRAOptimizer, build_zero_fora_optimizer


__all__ = [
    "Zero3FoRAOptimizer",
    "ZeroClientOptimizer",
    "ZeroFoRAOptimizer",
    "ZeroStiefelCallback",
    "build_zero3_fora_optimizer",
    "build_zero_fora_optimizer",
    "check_deepspeed_config",
    "deepspeed_zero_stage",
    "find_zero_client",
    "gathered_parameters",
    "gathered_trainable_parameters",
    "join_deepspeed_process_group",
    "load_deepspeed_config",
    "prepare_deepspeed",
    "zero3_scoring_engine",
    "zero_config",
]
