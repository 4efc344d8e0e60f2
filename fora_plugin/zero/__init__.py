"""FoRA under DeepSpeed: ZeRO-1/2 with the Stiefel ``lora_B`` replicated beside the partition, ZeRO-3 with each
``lora_B`` gathered whole for its step (:class:`Zero3FoRAOptimizer`, :func:`zero3_scoring_engine`).

ZeRO-1/2 flattens each group of the client optimizer into one fp32 vector, gives every rank a slice of it, and calls
the client's ``step`` on the slices: a Cayley step, which needs a whole ``lora_B``, cannot run there. So
:class:`ZeroFoRAOptimizer` shows DeepSpeed only the Euclidean groups (``lora_A`` and any other trainable parameter),
which are partitioned and stepped by AdamW as usual, and keeps every Stiefel ``lora_B`` out of the partition:

- each rank holds all of them (small: a 4096 x 32 ``lora_B`` is 0.5 MB in fp32);
- at the gradient-accumulation boundary (the only time DeepSpeed calls the client's ``step``) their gradients are
  averaged over the data-parallel ranks in one all-reduce;
- gradient clipping uses one norm over ``lora_A``'s and ``lora_B``'s gradients, as ``max_grad_norm`` does without
  DeepSpeed, so :meth:`ZeroFoRAOptimizer.bind` turns the clipping of DeepSpeed's ZeRO optimizer (``lora_A`` by its
  own norm) off;
- every rank applies the same Cayley-Adam step from its fp32 master (DeepSpeed's bf16 mode makes the module's
  parameters bf16), with ``lr_stiefel`` scaled by the same LR-schedule factor as the AdamW groups;
- every ``sync_period`` steps rank 0 broadcasts ``lora_B``, its master and its moments, so that no float
  difference between ranks can build up (the all-reduce hands every rank the same values, so there is none
  expected).

The Cayley state is not in DeepSpeed's checkpoint (DeepSpeed's elastic checkpoints keep only the partitioned groups):
:meth:`ZeroFoRAOptimizer.stiefel_state_dict` / :meth:`~ZeroFoRAOptimizer.load_stiefel_state_dict` save and restore
it; FoRASFTTrainer writes it to ``STIEFEL_STATE_FILE`` in every checkpoint and reads it back on resume.

Under ZeRO-3 every parameter is partitioned, lora_B included: :class:`Zero3FoRAOptimizer` keeps lora_B in
DeepSpeed's groups (its reduce-scatter, its one clipping norm, its skip of a non-finite step) and gathers each whole
lora_B with its gradient for the Cayley step; :func:`zero3_scoring_engine` runs the Fisher scoring on a model that
``zero.Init`` partitioned.

:func:`check_deepspeed_config` names the DeepSpeed settings that would silently turn FoRA into something else.

The modules: ``client`` (:class:`ZeroClientOptimizer`, what both clients share), ``stage12`` and ``stage3`` (the
two clients), ``checks`` (the config checks), ``launch`` (process group, the trainer's stage), ``scoring`` (the
scoring engine) and ``deepspeed_internals``, the only reader of DeepSpeed's internals.

May import: zero.checks, zero.client, zero.deepspeed_internals, zero.launch, zero.scoring, zero.stage12, zero.stage3.
"""

from .checks import check_deepspeed_config, load_deepspeed_config
from .client import STIEFEL_STATE_FILE, ZeroClientOptimizer, find_zero_client
from .deepspeed_internals import gathered_parameters, gathered_trainable_parameters
from .launch import deepspeed_zero_stage, join_deepspeed_process_group
from .scoring import zero3_scoring_engine
from .stage3 import Zero3FoRAOptimizer, build_zero3_fora_optimizer
from .stage12 import ZeroFoRAOptimizer, build_zero_fora_optimizer


__all__ = [
    "STIEFEL_STATE_FILE",
    "Zero3FoRAOptimizer",
    "ZeroClientOptimizer",
    "ZeroFoRAOptimizer",
    "build_zero3_fora_optimizer",
    "build_zero_fora_optimizer",
    "check_deepspeed_config",
    "deepspeed_zero_stage",
    "find_zero_client",
    "gathered_parameters",
    "gathered_trainable_parameters",
    "join_deepspeed_process_group",
    "load_deepspeed_config",
    "zero3_scoring_engine",
]
