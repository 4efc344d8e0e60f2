"""FoRA's optimizers, in the form of ``torch.optim``: Cayley-Adam on the Stiefel manifold for ``lora_B``
(:mod:`.cayley_adam`: the functional step ``cayley_adam`` and the class :class:`CayleyAdam`) and the one optimizer a
trainer sees, AdamW groups (with fp32 masters for bf16 adapters: :class:`MasterAdamW`) and Cayley-Adam groups over one
``param_groups`` (:mod:`.fora_optimizer`).

The functional step is imported from its module, ``from fora_plugin.optim.cayley_adam import cayley_adam``, as torch's
``from torch.optim.adam import adam``: re-exported here, its name would hide the module.

May import: adapter, errors, stiefel.
"""

from .cayley_adam import (
    COUNTERS,
    GRAPH_WARMUP_STEPS,
    IMPLEMENTATIONS,
    REPROJECT_THRESHOLD,
    CayleyAdam,
    check_cayley_adam_settings,
    counter_sums,
    counter_totals,
    default_cuda_graph,
    init_cayley_adam_state,
    resolve_cuda_graph,
    resolve_implementation,
    stiefel_step_with_gradients,
)
from .dtensor import is_dtensor
from .fora_optimizer import (
    MASTER_STATE_KEYS,
    UNSUPPORTED_LR_SCHEDULERS,
    FoRAOptimizer,
    MasterAdamW,
    build_fora_optimizer,
    check_lr_scheduler_type,
    create_fora_optimizer,
    find_stiefel_optimizer,
    fora_optimizer_parts,
    restore_master_state,
    wrapped_optimizers,
)


__all__ = [
    "COUNTERS",
    "GRAPH_WARMUP_STEPS",
    "IMPLEMENTATIONS",
    "MASTER_STATE_KEYS",
    "REPROJECT_THRESHOLD",
    "UNSUPPORTED_LR_SCHEDULERS",
    "CayleyAdam",
    "FoRAOptimizer",
    "MasterAdamW",
    "build_fora_optimizer",
    "check_lr_scheduler_type",
    "create_fora_optimizer",
    "find_stiefel_optimizer",
    "fora_optimizer_parts",
    "check_cayley_adam_settings",
    "counter_sums",
    "counter_totals",
    "default_cuda_graph",
    "init_cayley_adam_state",
    "is_dtensor",
    "resolve_cuda_graph",
    "resolve_implementation",
    "restore_master_state",
    "stiefel_step_with_gradients",
    "wrapped_optimizers",
]
