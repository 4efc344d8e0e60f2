"""Where to adapt: the per-layer empirical Fisher score of the paper's Eq. "fisher" (Algorithm 1, phase 1).

F_ℓ = (1/N) Σ_n Σ_{θ in layer ℓ} ‖∇_θ L(x_n, y_n)‖², over the base (not adapter) parameters of decoder layer ℓ and N
mini-batches of the task data under the task loss.

Memory stays that of a training step: each base-weight gradient is squared and summed into its layer's total the
moment autograd produces it, then freed (a post-accumulate-grad hook), so at most one weight gradient exists at a
time. The totals stay on the device: one host sync per scoring run. A linear whose weight cannot hold a gradient
(bitsandbytes 4-bit/8-bit) is scored from its input x and output gradient g instead: ∇W = Σ_tokens g xᵀ, whose
squared norm is also Σ (g gᵀ) ⊙ (x xᵀ), the cheaper form when there are fewer tokens than features.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm


FISHER_PARAMS = ("layer", "targets")
LINEAR_GRADS = ("auto", "activations")
# Attribute paths tried, in order, when a model has no get_decoder().layers.
_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.decoder.layers",
    "transformer.h",
    "gpt_neox.layers",
    "layers",
)


@dataclass
class FisherScores:
    """Per-layer Fisher scores and how they were obtained."""

    scores: list[float]
    num_batches: int
    fisher_params: str
    seconds: float
    peak_memory_bytes: int | None = None
    layer_prefix: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layer list of a causal LM (never a vision tower or an encoder) and its qualified name.

    Uses ``get_decoder().layers`` (Llama, Qwen, Gemma 3, and the language model of multimodal models), then a few
    common attribute paths. A ``PeftModel`` is looked through to its base model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = {id(m): n for n, m in model.named_modules()}
    candidates = []
    get_decoder = getattr(base, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):
            candidates.append(getattr(get_decoder(), "layers", None))
    for path in _LAYER_PATHS:
        module = base
        for part in path.split("."):
            module = getattr(module, part, None)
        candidates.append(module)
    for layers in candidates:
        if isinstance(layers, nn.ModuleList) and len(layers) > 0 and id(layers) in names:
            return names[id(layers)], layers
    raise ValueError(
        f"Cannot find the decoder layers of {type(base).__name__}: looked for get_decoder().layers and the "
        f"attributes {list(_LAYER_PATHS)}. FoRA scores and adapts the decoder layers of causal language models."
    )


def _is_adapter_parameter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def _is_quantized_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or weight is None:
        return False
    # A bitsandbytes 4-bit weight can be packed into a float storage (bnb_4bit_quant_storage=bfloat16, as QLoRA
    # under FSDP/DeepSpeed uses): its quant_state, not its dtype, says it is quantized. It never gets a gradient.
    return not weight.is_floating_point() or getattr(weight, "quant_state", None) is not None


def _check_trainable_layout(linear: nn.Module) -> None:
    # bitsandbytes (0.50, CPU) repacks a 4-bit weight for inference in place at its first no-grad eval forward and
    # never back; its matmul then passes no gradient to the layer's input, so the scores would be wrong.
    state = getattr(getattr(linear, "weight", None), "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        raise ValueError(
            f"A {type(linear).__name__} weight has packing_format_for_cpu=True: an eval-mode forward without "
            "gradients (evaluate(), generate()) repacked it for CPU inference, and gradients no longer flow through "
            "it. Score the 4-bit model before any such forward, or load it again."
        )


def _target_modules(layer: nn.Module, targets: Sequence[str]) -> dict[str, nn.Module]:
    """Target linears of one layer by their name suffix; under PEFT, the wrapped base layer."""
    found = {}
    for name, module in layer.named_modules():
        if any(name == t or name.endswith("." + t) for t in targets):
            found[name] = getattr(module, "base_layer", module)
    return found


def squared_norm_of_outer_sum(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """‖Σ_t g_t x_tᵀ‖²_F for g (T, out) and x (T, in), without the (out, in) matrix when T is small."""
    tokens, d_out, d_in = g.shape[0], g.shape[1], x.shape[1]
    if tokens * (d_in + d_out) < d_in * d_out:
        return ((g @ g.T) * (x @ x.T)).sum()  # (T, T) each
    return (g.T @ x).square().sum()  # (out, in)


class _LayerAccumulator:
    """Hooks that add squared gradient norms into per-layer totals (a device tensor) as gradients appear."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.totals = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.handles: list[Any] = []

    def watch_parameter(self, index: int, param: nn.Parameter) -> None:
        def hook(p: torch.Tensor) -> None:
            self.totals[index] += p.grad.detach().float().square().sum()
            p.grad = None  # freed at once: never more than one weight gradient alive

        self.handles.append(param.register_post_accumulate_grad_hook(hook))

    def watch_linear(self, index: int, linear: nn.Module, with_bias: bool) -> None:
        # The output's gradient hook fires once per backward even under gradient checkpointing: a reentrant
        # recompute's first forward runs without grad (no hook), a non-reentrant recompute's output is not on the
        # backward path (its hook never fires).
        def forward_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
                return
            x = args[0].detach()

            def grad_hook(g: torch.Tensor) -> None:
                g2 = g.detach().reshape(-1, g.shape[-1]).float()  # (T, out)
                x2 = x.reshape(-1, x.shape[-1]).float()  # (T, in)
                total = squared_norm_of_outer_sum(g2, x2)
                if with_bias:
                    total = total + g2.sum(dim=0).square().sum()
                self.totals[index] += total

            output.register_hook(grad_hook)

        self.handles.append(linear.register_forward_hook(forward_hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _default_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return model(**inputs).loss


@contextlib.contextmanager
def _restored(model: nn.Module):
    """Give back every requires_grad flag and train/eval mode as they were, and leave no gradient behind."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
            if not flag:
                p.grad = None
        for m, mode in modes:
            m.training = mode


def fisher_scores(
    model: nn.Module,
    batches: Iterable[Any],
    num_batches: int = 128,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    fisher_params: str = "layer",
    target_modules: Sequence[str] | None = None,
    linear_grad: str = "auto",
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    progress: bool = True,
) -> FisherScores:
    """Score every decoder layer of ``model`` with the empirical Fisher over ``num_batches`` mini-batches.

    Args:
        model: a causal LM (a ``PeftModel`` is scored on its base parameters; adapter parameters never count).
        batches: mini-batches of the task data, e.g. a trainer's train dataloader. Under ``torch.distributed`` each
            rank passes its own share; the sums are all-reduced, so every rank gets the same scores.
        num_batches: N. With fewer batches available, a warning is given and all of them are used.
        loss_fn: ``loss_fn(model, batch) -> loss``; by default ``model(**batch).loss`` with tensors moved to the
            model's device. A trainer passes its own ``compute_loss`` (completion masks, packing, padding-free).
        fisher_params: ``"layer"``: every base parameter of the layer (the paper's definition); ``"targets"``:
            only the weights and biases of ``target_modules``.
        target_modules: LoRA target names (suffixes such as ``"q_proj"``), needed for ``"targets"``.
        linear_grad: ``"auto"``: autograd for float weights, inputs x and output gradients g for quantized linears;
            ``"activations"``: x and g for every linear in scope (no weight gradient is ever formed).
        autocast: a factory of the context manager each forward runs under, e.g. a trainer's
            ``compute_loss_context_manager`` (autocast as in training).
        progress: show a progress bar.

    The model runs in train mode (so gradient checkpointing, if enabled, applies as in training); its
    requires_grad flags, modes and gradients are restored afterwards.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"fisher_batches={num_batches!r} is invalid: use an int >= 1 (the paper uses 128).")
    if fisher_params not in FISHER_PARAMS:
        raise ValueError(f"fisher_params={fisher_params!r} is invalid: use one of {FISHER_PARAMS}.")
    if linear_grad not in LINEAR_GRADS:
        raise ValueError(f"linear_grad={linear_grad!r} is invalid: use one of {LINEAR_GRADS}.")
    if fisher_params == "targets" and not target_modules:
        raise ValueError("fisher_params='targets' needs target_modules (e.g. ['q_proj', 'v_proj']).")
    prefix, layers = find_decoder_layers(model)
    device = next(model.parameters()).device
    accumulator = _LayerAccumulator(len(layers), device)
    loss_fn = loss_fn or _default_loss
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    with _restored(model), contextlib.ExitStack() as stack:
        stack.callback(accumulator.remove)
        model.requires_grad_(False)
        _watch_layers(accumulator, layers, fisher_params, target_modules, linear_grad)
        # Gradients must reach layer 0 even when checkpointing: make the embeddings' output require grad.
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None:
            stack.enter_context(_output_requires_grad(embeddings))
        disable_adapters = getattr(model, "disable_adapter", None)
        if callable(disable_adapters):
            stack.enter_context(disable_adapters())  # score the base model, not base + adapter
        model.train()
        count = 0
        bar = tqdm(total=num_batches, desc="Fisher scoring", unit="batch", disable=not progress)
        stack.callback(bar.close)
        for batch in batches:
            if count == num_batches:
                break
            with autocast() if autocast is not None else contextlib.nullcontext():
                loss = loss_fn(model, batch)
            loss.backward()
            count += 1
            bar.update(1)

    if count == 0:
        raise ValueError("Fisher scoring got no batch: the dataset (or this rank's share of it) is empty.")
    if count < num_batches:
        warnings.warn(
            f"fisher_batches={num_batches} but only {count} batches are available; scoring on {count}. "
            "Lower fisher_batches or use more data to silence this.",
            stacklevel=2,
        )
    stats = torch.cat((accumulator.totals, torch.tensor([float(count)], device=device)))  # (L + 1,)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats)
    *totals, total_batches = stats.tolist()  # the one host sync
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return FisherScores(
        scores=[t / total_batches for t in totals],
        num_batches=int(total_batches),
        fisher_params=fisher_params,
        seconds=time.perf_counter() - started,
        peak_memory_bytes=peak,
        layer_prefix=prefix,
    )


def _watch_layers(
    accumulator: _LayerAccumulator,
    layers: nn.ModuleList,
    fisher_params: str,
    target_modules: Sequence[str] | None,
    linear_grad: str,
) -> None:
    for index, layer in enumerate(layers):
        if fisher_params == "targets":
            linears = _target_modules(layer, target_modules or ())
            scoped = {id(p) for m in linears.values() for p in m.parameters(recurse=False)}
        else:
            linears = {
                n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear) and not _is_adapter_parameter(n)
            }
            scoped = None
        by_activations = set()
        for linear in linears.values():
            if _is_quantized_linear(linear) or (linear_grad == "activations" and isinstance(linear, nn.Linear)):
                _check_trainable_layout(linear)
                bias = getattr(linear, "bias", None)
                accumulator.watch_linear(index, linear, with_bias=bias is not None)
                by_activations.update(id(p) for p in linear.parameters(recurse=False))
        for name, param in layer.named_parameters():
            if _is_adapter_parameter(name) or id(param) in by_activations or not param.is_floating_point():
                continue
            if scoped is not None and id(param) not in scoped:
                continue
            param.requires_grad_(True)
            param.grad = None
            accumulator.watch_parameter(index, param)


@contextlib.contextmanager
def _output_requires_grad(module: nn.Module):
    handle = module.register_forward_hook(lambda m, args, output: output.requires_grad_(True))
    try:
        yield
    finally:
        handle.remove()
