"""What FoRA's DeepSpeed ZeRO client optimizers share: :class:`ZeroClientOptimizer`, the base of the ZeRO-1/2 client
(:mod:`.stage12`) and the ZeRO-3 one (:mod:`.stage3`), and :func:`find_zero_client`.

The base holds the scaffolding: AdamW on the groups DeepSpeed steps and Cayley-Adam (``stiefel``) on the Stiefel
``lora_B``, the check of ``max_grad_norm``, ``bind`` and ``step`` as templates the stages fill in, the step count, and
the Cayley state that DeepSpeed's checkpoint does not hold (saved as ``checkpoints.STIEFEL_STATE_FILE``).

May import: errors, optim, validation, zero.deepspeed_internals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim import AdamW

from ..errors import FoRAInputTypeError
from ..optim import CayleyAdam, default_cuda_graph, wrapped_optimizers
from ..validation import check_float
from .deepspeed_internals import missing_optimizer_attributes


__all__ = ["ZeroClientOptimizer", "eager_unless_asked", "find_zero_client"]


def eager_unless_asked(stiefel_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Cayley-Adam's keyword arguments under DeepSpeed, a data-parallel engine: an unset ``cuda_graph`` steps eagerly
    (:func:`~fora_plugin.optim.default_cuda_graph`); True still captures."""
    return {
        **stiefel_defaults,
        "cuda_graph": default_cuda_graph(stiefel_defaults.get("cuda_graph"), data_parallel=True),
    }


class ZeroClientOptimizer(AdamW):
    """A client optimizer for DeepSpeed ZeRO: AdamW on the groups DeepSpeed steps, Cayley-Adam (``self.stiefel``, a
    :class:`~fora_plugin.optim.CayleyAdam` the subclass sets) on the Stiefel ``lora_B``.

    DeepSpeed calls :meth:`step` with the groups it is stepping; each call is the Stiefel part (:meth:`step_stiefel`),
    then AdamW on what DeepSpeed handed over (:meth:`step_euclidean`). After ``deepspeed.initialize``, and after each
    DeepSpeed checkpoint load, :meth:`bind` takes DeepSpeed's ZeRO optimizer (``engine.optimizer``).

    ZeRO-1/2 flattens each group of the client optimizer into one fp32 vector, gives every rank a slice of it, and
    calls the client's ``step`` on the slices: a Cayley step, which needs a whole ``lora_B``, cannot run there. So
    :class:`ZeroFoRAOptimizer` shows DeepSpeed only the Euclidean groups (``lora_A`` and any other trainable
    parameter), which are partitioned and stepped by AdamW as usual, and keeps every Stiefel ``lora_B`` out of the
    partition:

    - each rank holds all of them (small: a 4096 x 32 ``lora_B`` is 0.5 MB in fp32);
    - at the gradient-accumulation boundary (the only time DeepSpeed calls the client's ``step``) their gradients are
      averaged over the data-parallel ranks in one all-reduce;
    - gradient clipping uses one norm over ``lora_A``'s and ``lora_B``'s gradients, as ``max_grad_norm`` does without
      DeepSpeed, so :meth:`ZeroFoRAOptimizer.bind` turns the clipping of DeepSpeed's ZeRO optimizer (``lora_A`` by its
      own norm) off;
    - every rank applies the same Cayley-Adam step from its fp32 master (DeepSpeed's bf16 mode makes the module's
      parameters bf16), with ``lr_stiefel`` scaled by the same LR-schedule factor as the AdamW groups;
    - every ``sync_period`` steps rank 0 broadcasts ``lora_B``, its master and its moments, so that no float difference
      between ranks can build up (the all-reduce hands every rank the same values, so there is none expected).

    The Cayley state is not in DeepSpeed's checkpoint (DeepSpeed's elastic checkpoints keep only the partitioned
    groups): :meth:`ZeroFoRAOptimizer.stiefel_state_dict` / :meth:`~ZeroFoRAOptimizer.load_stiefel_state_dict` save and
    restore it; the :class:`ZeroStiefelCallback` writes it to ``STIEFEL_STATE_FILE`` in every checkpoint and reads it
    back on resume.

    Under ZeRO-3 every parameter is partitioned, lora_B included: :class:`Zero3FoRAOptimizer` keeps lora_B in
    DeepSpeed's groups (its reduce-scatter, its one clipping norm, its skip of a non-finite step) and gathers each
    whole lora_B with its gradient for the Cayley step; :func:`zero3_scoring_engine` runs the Fisher scoring on a model
    that ``zero.Init`` partitioned.

    :func:`check_deepspeed_config` names the DeepSpeed settings that would silently turn FoRA into something else.

    The modules of ``fora_plugin.zero``: ``client`` (:class:`ZeroClientOptimizer`, what both clients share),
    ``stage12`` and ``stage3`` (the two clients), ``checks`` (the config checks), ``launch`` (process group, the
    trainer's stage), ``scoring`` (the scoring engine) and ``deepspeed_internals``, the only reader of DeepSpeed's
    internals.

    Args:
        params: the param groups to hand DeepSpeed.
        max_grad_norm: the one gradient norm to clip ``lora_A`` and ``lora_B`` to; 0 = no clipping.
        **adamw_kwargs: ``torch.optim.AdamW`` keyword arguments (lr, betas, eps, weight_decay, ...).
    """

    #: The DeepSpeed ZeRO stage the client is for (the attributes :meth:`bind` needs) and its name in messages.
    zero_stage: int = 0
    engine: str = ""
    stiefel: CayleyAdam

    def __init__(self, params: Iterable[dict[str, Any]], *, max_grad_norm: float = 0.0, **adamw_kwargs: Any) -> None:
        # NaN, inf and YAML's `true` are refused too: a NaN norm would clip every gradient to NaN.
        check_float("max_grad_norm", max_grad_norm, lambda x: x >= 0, "a float >= 0 (0 = no clipping)")
        super().__init__(params, **adamw_kwargs)
        self.max_grad_norm = float(max_grad_norm)
        self.steps = 0  # optimizer steps taken: one per DeepSpeed step, however many calls of step() it makes

    @property
    def stiefel_parameters(self) -> list[torch.Tensor]:
        """What Cayley-Adam steps: the module's ``lora_B`` under ZeRO-1/2, their full fp32 copies under ZeRO-3."""
        return [p for group in self.stiefel.param_groups for p in group["params"]]

    @property
    def last_grad_norm(self) -> float | None:
        """The norm of the last step's gradients, lora_A's and lora_B's together (one host read: for logs)."""
        norm = self.last_grad_norm_unread()
        return None if norm is None else float(norm)

    def last_grad_norm_unread(self) -> torch.Tensor | float | None:
        """The same norm as it is kept, a device tensor not yet read (a log reads it with its other values), or
        DeepSpeed's float; None before the first step or without clipping."""
        raise NotImplementedError

    def bind(self, engine_optimizer: Any) -> None:
        """Hand over the DeepSpeed ZeRO optimizer that wraps this one (``engine.optimizer``); the stage's own part is
        :meth:`_bind`."""
        missing = missing_optimizer_attributes(engine_optimizer, self.zero_stage)
        if missing:
            raise FoRAInputTypeError(
                f"{type(engine_optimizer).__name__} has no {' / '.join(missing)}: bind() takes the DeepSpeed "
                f"{self.engine} optimizer (engine.optimizer) that wraps this {type(self).__name__}."
            )
        self._bind(engine_optimizer)

    def _bind(self, engine_optimizer: Any) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        self.step_stiefel()
        return self.step_euclidean(closure)

    def step_stiefel(self) -> None:
        """The Stiefel part of a call of :meth:`step` (its communication and the Cayley-Adam step); public so that a
        benchmark can time it."""
        raise NotImplementedError

    def step_euclidean(self, closure=None):
        """AdamW on the Euclidean parameters DeepSpeed handed this call of :meth:`step`."""
        return super().step(closure)

    def stiefel_state_dict(self) -> dict[str, Any]:
        """The Cayley-Adam state (moments, fp32 masters, step counts), the same on every rank: DeepSpeed's checkpoint
        does not hold it (the checkpoint callback saves it as ``STIEFEL_STATE_FILE``)."""
        return {"stiefel": self.stiefel.state_dict(), "steps": self.steps}

    def load_stiefel_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.stiefel.load_state_dict(state_dict["stiefel"])
        self.steps = int(state_dict["steps"])


def find_zero_client(optimizer: Any) -> ZeroClientOptimizer | None:
    """FoRA's DeepSpeed client optimizer inside a trainer's optimizer (accelerate's wrapper, then DeepSpeed's)."""
    return next((inner for inner in wrapped_optimizers(optimizer) if isinstance(inner, ZeroClientOptimizer)), None)
