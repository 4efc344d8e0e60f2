"""Fisher scoring on a model that DeepSpeed's ``zero.Init`` partitioned: :func:`zero3_scoring_engine`.

May import: errors, zero.deepspeed_internals.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import FoRAInputError
from .deepspeed_internals import engine_without_optimizer


__all__ = ["zero3_scoring_engine"]


@contextlib.contextmanager
def zero3_scoring_engine(model: torch.nn.Module, deepspeed_config: Mapping[str, Any]) -> Iterator[Any]:
    """ZeRO-3's parameter gathering around ``model`` without an optimizer, for Fisher scoring before training.

    A model that ``zero.Init`` partitioned (HF's ``from_pretrained`` under a ZeRO-3 config) holds empty weights
    outside a ZeRO-3 engine, so a forward fails. This builds an optimizer-less engine on it, as TRL does for its
    ZeRO-3 reference models: its hooks gather each module's weights for forward and backward and release them after.
    Score with ``fisher_scores(..., linear_grad="activations")``: linears are scored from their inputs and output
    gradients, so no weight gradient (which the engine would neither reduce nor free) is formed. On exit the hooks
    come off (``engine.destroy()``); the parameters stay partitioned, and ``deepspeed.initialize`` can build the
    training engine on the model.

    Yields the engine (calling ``model`` itself runs through the hooks).
    """
    # HF fills some "auto" values only when it builds the training engine: leave those to DeepSpeed's defaults.
    config = {k: v for k, v in copy.deepcopy(dict(deepspeed_config)).items() if v != "auto"}
    zero = {k: v for k, v in config.get("zero_optimization", {}).items() if v != "auto"}
    config["zero_optimization"] = zero
    if zero.get("stage") != 3:
        raise FoRAInputError(
            f"zero3_scoring_engine needs a ZeRO-3 config, got zero_optimization.stage={zero.get('stage')!r}: "
            "score a ZeRO-1/2 model directly (its weights are whole)."
        )
    # Training-only settings: without an optimizer DeepSpeed would build its own from them, and the batch sizes
    # (HF's "auto" values, or a global batch for another world size) do not apply to scoring.
    for key in ("optimizer", "scheduler", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping"):
        config.pop(key, None)
    zero.pop("offload_optimizer", None)
    config["train_micro_batch_size_per_gpu"] = 1
    with engine_without_optimizer(model, config) as engine:
        yield engine
