"""Where to adapt: the per-layer empirical Fisher score of the paper's Eq. "fisher" (Algorithm 1, phase 1).

May import: errors, targets, validation.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .errors import FoRAInputError
from .targets import base_name, find_decoder_layers, is_linear_like, matches_target
from .validation import check_choice, check_int


__all__ = [
    "FISHER_PARAMS",
    "LINEAR_GRADS",
    "FisherScores",
    "GatherParameters",
    "fisher_scores",
    "squared_norm_of_outer_sum",
]


FISHER_PARAMS = ("layer", "targets")
# gather(params) -> a context manager holding sharded parameters whole (an engine's, passed to fisher_scores).
GatherParameters = Callable[[list[torch.Tensor]], contextlib.AbstractContextManager]
LINEAR_GRADS = ("auto", "activations")


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


def _is_adapter_parameter(name: str) -> bool:
    # PEFT's own tensors: lora_A/lora_B/lora_magnitude_vector..., and the trainable copies of modules_to_save.
    return any(part.startswith("lora_") or part == "modules_to_save" for part in name.split("."))


def _weight_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own (not its children's) parameters, and its buffers that hold weights: packed integer matrices
    (GPTQ's qweight, AWQ's qzeros) or a float ``weight`` kept as a buffer. Masks and rotary tables are left out."""
    tensors = dict(module.named_parameters(recurse=False))
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is None or buffer.dim() < 2 or buffer.dtype == torch.bool:
            continue
        if "weight" in name or not buffer.is_floating_point():
            tensors[name] = buffer
    return tensors


def _has_autograd_weight(module: nn.Module) -> bool:
    """Whether the module's weight is a plain float Parameter, one autograd can give a gradient."""
    weight = getattr(module, "weight", None)
    # A quantized weight is packed (uint8/int), a buffer (GPTQ, AWQ, HQQ), a tensor subclass (torchao, fp8,
    # bitsandbytes' Params4bit), or a 4-bit weight in a float storage (bnb_4bit_quant_storage=bfloat16 under
    # FSDP/DeepSpeed: its quant_state, not its dtype, says it is quantized). None of them gets a gradient.
    return type(weight) is nn.Parameter and weight.is_floating_point() and getattr(weight, "quant_state", None) is None


def _check_trainable_layout(linear: nn.Module) -> None:
    # bitsandbytes (0.50, CPU) repacks a 4-bit weight for inference in place at its first no-grad eval forward and
    # never back; its matmul then passes no gradient to the layer's input, so the scores would be wrong.
    state = getattr(getattr(linear, "weight", None), "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        raise FoRAInputError(
            f"A {type(linear).__name__} weight has packing_format_for_cpu=True: an eval-mode forward without "
            "gradients (evaluate(), generate()) repacked it for CPU inference, and gradients no longer flow through "
            "it. Score the 4-bit model before any such forward, or load it again."
        )


def _in_scope(name: str, targets: Sequence[str]) -> bool:
    return matches_target(base_name(name), targets)


def squared_norm_of_outer_sum(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """‖Σ_t g_t x_tᵀ‖²_F for g (T, out) and x (T, in), without the (out, in) matrix when T is small."""
    tokens, d_out, d_in = g.shape[0], g.shape[1], x.shape[1]
    if tokens * (d_in + d_out) < d_in * d_out:
        return ((g @ g.T) * (x @ x.T)).sum()  # (T, T) each
    return (g.T @ x).square().sum()  # (out, in)


def _tensors(output: Any) -> list[torch.Tensor] | None:
    """The tensors of a module output (a tensor, or a tuple/list holding tensors); None for other containers."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return None


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class _ScoredByInput(torch.autograd.Function):
    """The identity on a linear's output y, whose backward also scores the linear from g = ∂L/∂y and its input x.

    x is saved for backward (``save_for_backward``), so checkpointing treats it as any saved activation: it is
    dropped after the forward and recomputed for the backward. The backward runs once per backward pass, also under
    checkpointing: a non-reentrant recompute's graph is never run backward, and a reentrant checkpoint's first
    forward runs without gradients (the forward hook passes then).
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, x: torch.Tensor, add_score: Callable) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.add_score = add_score
        return output  # returned as is: autograd makes it a view with this node as its grad_fn, no copy

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (x,) = ctx.saved_tensors
        ctx.add_score(g.detach(), x)
        return g, None, None


class _ScoredByReplay(torch.autograd.Function):
    """The identity on a module's differentiable outputs, whose backward also scores the module's own parameters
    by a replay on its inputs with the outputs' gradients (``_LayerAccumulator.watch_module``).

    The inputs are saved for backward, so checkpointing drops and recomputes them like any activation, and the
    backward gets every output's gradient at once (None for an output that got none): one replay per call.
    """

    @staticmethod
    def forward(ctx: Any, add_score: Callable, num_outputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*tensors[num_outputs:])
        ctx.add_score, ctx.num_outputs = add_score, num_outputs
        ctx.set_materialize_grads(False)
        return tuple(tensors[:num_outputs])  # returned as is: views with this node as their grad_fn, no copy

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors  # read once: checkpointing unpacks each saved tensor once
        if any(g is not None for g in grads):
            ctx.add_score(inputs, tuple(None if g is None else g.detach() for g in grads))
        return (None, None, *grads, *([None] * len(inputs)))


class _LayerAccumulator:
    """Hooks that add squared gradient norms into per-layer totals (a device tensor) as gradients appear."""

    def __init__(self, num_layers: int, device: torch.device, gather: GatherParameters | None = None) -> None:
        self.totals = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.gather = gather
        self.handles: list[Any] = []
        self._replaying = False  # set while a module re-runs inside a gradient hook: no hook may count that run
        self._forwarded: dict[str, str] = {}  # label -> type name, of modules whose output needed a gradient
        self._reached: set[str] = set()  # labels of those whose output received one

    def add(self, index: int, value: torch.Tensor) -> None:
        # A model split over devices (device_map="auto") computes each layer's part on that layer's device.
        self.totals[index] += value.to(self.totals.device)

    def watch_parameter(self, index: int, param: nn.Parameter) -> None:
        def hook(p: torch.Tensor) -> None:
            self.add(index, p.grad.detach().float().square().sum())
            p.grad = None  # freed at once: never more than one weight gradient alive

        self.handles.append(param.register_post_accumulate_grad_hook(hook))

    def watch_linear(self, index: int, label: str, linear: nn.Module, with_bias: bool) -> None:
        """Score a linear-like module's weight (and bias) from its input x and output gradient g: ∇W = Σ_t g xᵀ.

        The output goes on through :class:`_ScoredByInput`, which saves x for backward: autograd, not a closure,
        holds x, so gradient checkpointing frees and recomputes it like any activation.
        """

        def add_score(g: torch.Tensor, x: torch.Tensor) -> None:
            self._reached.add(label)
            g2 = g.reshape(-1, g.shape[-1]).float()  # (T, out)
            x2 = x.reshape(-1, x.shape[-1]).float()  # (T, in)
            total = squared_norm_of_outer_sum(g2, x2)  # Conv1D's (in, out) weight has the same norm
            if with_bias:
                total = total + g2.sum(dim=0).square().sum()
            self.add(index, total)

        def forward_hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if self._replaying or not torch.is_grad_enabled():
                return None
            outputs = _tensors(output)
            x = args[0]
            if not outputs or not outputs[0].requires_grad:
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    self._forwarded[label] = type(module).__name__  # a gradient came in, none can go out: refused
                return None
            self._forwarded[label] = type(module).__name__
            scored = _ScoredByInput.apply(outputs[0], x.detach(), add_score)
            if isinstance(output, torch.Tensor):
                return scored
            first = next(i for i, item in enumerate(output) if item is outputs[0])
            return type(output)((*output[:first], scored, *output[first + 1 :]))

        self.handles.append(linear.register_forward_hook(forward_hook))

    def watch_module(self, index: int, label: str, module: nn.Module, names: list[str]) -> None:
        """Score the module's own parameters ``names`` without forming their gradient on the model.

        The module re-runs, in the backward, on its saved inputs with detached copies of those parameters
        (``torch.func.functional_call``); ``torch.autograd.grad`` of that copy with the output gradients g is
        exactly ∇w = Σ_outputs J_wᵀ g for this call. Nothing is set on the model's parameters, so this also holds
        when they are sharded (FSDP2, ZeRO-3): the module's parameters are gathered for its backward. The inputs
        are saved through autograd (:class:`_ScoredByReplay`), so checkpointing frees and recomputes them.
        """

        def forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if self._replaying or not torch.is_grad_enabled():
                return None
            outputs = _tensors(output)
            if outputs is None:
                raise FoRAInputError(
                    f"{label} ({type(module).__name__}) returns a {type(output).__name__}: linear_grad="
                    "'activations' scores a module's own parameters from its tensor outputs only. Use "
                    "linear_grad='auto' for this model."
                )
            positions = [i for i, t in enumerate(outputs) if t.requires_grad]
            if not positions:
                if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                    self._forwarded[label] = type(module).__name__  # a gradient came in, none can go out: refused
                return None
            self._forwarded[label] = type(module).__name__
            leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
            tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            inputs = [leaves[i].detach() for i in tensor_at]
            # The closure keeps the non-tensor arguments only: the tensors go through autograd (see add_score).
            template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            device_type = outputs[positions[0]].device.type
            autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

            def add_score(inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]) -> None:
                self._reached.add(label)
                saved = list(template)
                for i, tensor in zip(tensor_at, inputs):
                    saved[i] = tensor
                saved_args, saved_kwargs = torch.utils._pytree.tree_unflatten(saved, spec)
                # A sharding engine (ZeRO-3) partitions the module's own parameters outside its forward: gather them
                # for the replay, and call forward, not the module's __call__, whose ZeRO-3 hooks expect ZeRO
                # parameters.
                # (_reparametrize_module is what torch.func.functional_call runs around __call__.)
                own = [getattr(module, n) for n in names]
                autocast_ctx = torch.autocast(device_type, dtype=autocast[1], enabled=autocast[0])
                with self.gather(own) if self.gather else contextlib.nullcontext(), torch.enable_grad(), autocast_ctx:
                    copies = {n: p.detach().requires_grad_(True) for n, p in zip(names, own)}
                    self._replaying = True
                    try:
                        with torch.nn.utils.stateless._reparametrize_module(module, copies):
                            replay = _tensors(module.forward(*saved_args, **saved_kwargs))
                    finally:
                        self._replaying = False
                    # A copy of each output gradient: a kernel's backward may write its output gradient in place
                    # (Liger's RMSNorm does), and the originals go on down the real backward.
                    reached = [(replay[i], g.clone()) for i, g in zip(positions, grads) if g is not None]
                    weight_grads = torch.autograd.grad(
                        [r for r, _ in reached], list(copies.values()), [g for _, g in reached], allow_unused=True
                    )
                self.add(index, sum(gr.float().square().sum() for gr in weight_grads if gr is not None))

            scored = _ScoredByReplay.apply(add_score, len(positions), *[outputs[i] for i in positions], *inputs)
            replaced = dict(zip((id(outputs[i]) for i in positions), scored))
            if isinstance(output, torch.Tensor):
                return replaced[id(output)]
            return type(output)(
                replaced.get(id(item), item) if isinstance(item, torch.Tensor) else item for item in output
            )

        self.handles.append(module.register_forward_hook(forward_hook, with_kwargs=True))

    def flush(self) -> None:
        """After a backward: nothing is left pending (each module's score is added in its backward)."""

    def check_reached(self) -> None:
        """Refuse scores that silently miss a module: it ran with gradients on, yet its output never got one."""
        missed = {label: kind for label, kind in self._forwarded.items() if label not in self._reached}
        if missed:
            raise FoRAInputError(
                f"Fisher scoring: {missed} ran in the forward but their outputs never received a gradient, so their "
                "weights would score 0. Their forward does not pass gradients (a custom kernel without backward, or "
                "a bitsandbytes weight repacked for inference): load the model so that gradients flow through these "
                "modules, or leave them out of the decoder layers' scope (fisher_params='targets')."
            )

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


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# Float attributes (of modules and of their configs) that are rates of something random in train mode: dropout,
# attention_dropout, layerdrop, drop_path / drop_prob, router_jitter_noise, input_jitter_noise.
_RANDOM_RATE_WORDS = ("drop", "jitter")


@contextlib.contextmanager
def _training_without_dropout(model: nn.Module):
    """Train mode with everything random in it off: the score is an expectation, not a sample.

    The model stays in train mode, since modules act on it beyond dropout: transformers checkpoints a decoder layer
    only when its ``self.training`` is set, and bitsandbytes repacks a 4-bit weight for inference (for good) when it
    runs in eval mode without gradients, as a reentrant checkpoint's first forward does. Dropout modules go to eval
    mode, and the random rates that modules (HF attention's ``attention_dropout``, a layer's ``dropout``, an MoE
    router's jitter noise) or their configs hold are 0 while scoring. ``_restored`` gives the modes back.
    """
    rates = []
    holders = {}
    for module in model.modules():
        if isinstance(module, _DROPOUT_MODULES):
            module.training = False
            if module.p > 0:  # GPT-2's attention passes its attn_dropout.p to the attention kernel itself
                rates.append((module, "p", module.p))
                module.p = 0.0
        holders[id(module)] = module
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, nn.Module):
            holders[id(config)] = config
    for holder in holders.values():
        for attr, value in list(vars(holder).items()):
            is_rate = isinstance(value, float) and any(word in attr for word in _RANDOM_RATE_WORDS)
            if is_rate and value > 0:
                rates.append((holder, attr, value))
                setattr(holder, attr, 0.0)
    try:
        yield
    finally:
        for holder, attr, value in rates:
            setattr(holder, attr, value)


def fisher_scores(
    model: nn.Module,
    batches: Iterable[Any],
    num_batches: int = 128,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    fisher_params: str = "layer",
    target_modules: Sequence[str] | None = None,
    target_parameters: Sequence[str] | None = None,
    linear_grad: str = "auto",
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    gather: GatherParameters | None = None,
    quantized: Collection[nn.Module] = (),
    progress: bool = True,
) -> FisherScores:
    """Score every decoder layer of ``model`` with the empirical Fisher over ``num_batches`` mini-batches.

    F_ℓ = (1/N) Σ_n Σ_{θ in layer ℓ} ‖∇_θ L(x_n, y_n)‖², over the base (not adapter) parameters of decoder layer ℓ and
    N mini-batches of the task data under the task loss.

    Memory stays that of a training step: each base-weight gradient is squared and summed into its layer's total the
    moment autograd produces it, then freed (a post-accumulate-grad hook), so at most one weight gradient exists at a
    time. The totals stay on one device: one host sync per scoring run. A linear-like module whose weight cannot
    hold a gradient (bitsandbytes, GPTQ/AWQ/HQQ buffers, torchao tensor subclasses) is scored from its input x and
    output gradient g instead: ∇W = Σ_tokens g xᵀ, whose squared norm is also Σ (g gᵀ) ⊙ (x xᵀ), the cheaper form
    when there are fewer tokens than features. With ``linear_grad="activations"`` no parameter gradient is formed at
    all (sharded models): linears by x and g, every other parameter by a local re-run of its module
    (``watch_module``).

    Args:
        model: a causal LM (a ``PeftModel`` is scored on its base parameters; adapter parameters never count).
        batches: mini-batches of the task data, e.g. a trainer's train dataloader. Under ``torch.distributed`` each
            rank passes its own share; the sums are all-reduced, so every rank gets the same scores.
        num_batches: N. With fewer batches available, a warning is given and all of them are used.
        loss_fn: ``loss_fn(model, batch) -> loss``; by default ``model(**batch).loss`` with tensors moved to the
            model's device. A trainer passes its own ``compute_loss`` (completion masks, packing, padding-free).
        fisher_params: ``"layer"``: every base parameter of the layer (the paper's definition); ``"targets"``:
            only the weights and biases of ``target_modules`` and the parameters ``target_parameters``.
        target_modules: LoRA target names (suffixes such as ``"q_proj"``), for ``"targets"``.
        target_parameters: LoRA target parameter names (``LoraConfig.target_parameters``, suffixes such as
            ``"mlp.experts.gate_up_proj"``: fused MoE experts), for ``"targets"``.
        linear_grad: ``"auto"``: autograd for float weights, inputs x and output gradients g for linears whose
            weight cannot hold a gradient (quantized); ``"activations"``: no parameter gradient is ever formed (the
            mode for sharded models): x and g for every linear-like module, and every other parameter (norms,
            routers, fused experts) by re-running its module on a detached copy (``_LayerAccumulator.watch_module``).
        autocast: a factory of the context manager each forward runs under, e.g. a trainer's
            ``compute_loss_context_manager`` (autocast as in training).
        gather: for a sharding engine that partitions parameters outside their module's forward (DeepSpeed ZeRO-3:
            :func:`fora_plugin.zero.gathered_parameters`), ``gather(params)`` is a context manager that holds them
            whole while a module re-runs under ``linear_grad="activations"``. The engine is passed in, not imported:
            scoring knows no engine.
        quantized: linear-like modules to score as a quantized linear is (from x and g, no weight gradient), whatever
            their weight: stand-ins for quantized linears, such as the float linears of ``fora plan``'s 4-bit models.
        progress: show a progress bar.

    The model runs in train mode (so gradient checkpointing, if enabled, applies as in training) with every dropout
    off; requires_grad flags, modes and gradients are restored afterwards. Scores are summed on the device
    of the model's first parameter, also when the layers are spread over devices.

    Scoring runs in train mode with dropout off: with dropout the score would be a random sample, not the Fisher.
    """
    check_int("fisher_batches", num_batches, 1, "the paper uses 128")
    check_choice("fisher_params", fisher_params, FISHER_PARAMS)
    check_choice("linear_grad", linear_grad, LINEAR_GRADS)
    if fisher_params == "targets" and not target_modules and not target_parameters:
        raise FoRAInputError(
            "fisher_params='targets' needs target_modules (e.g. ['q_proj', 'v_proj']) or target_parameters."
        )
    prefix, layers = find_decoder_layers(model)
    device = next(model.parameters()).device
    accumulator = _LayerAccumulator(len(layers), device, gather)
    loss_fn = loss_fn or _default_loss
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    with _restored(model), contextlib.ExitStack() as stack:
        stack.callback(accumulator.remove)
        model.requires_grad_(False)
        scope = _Scope(fisher_params, target_modules or (), target_parameters or ())
        stand_ins = set(quantized)
        for index, layer in enumerate(layers):
            _watch_layer(accumulator, index, f"{prefix}.{index}", layer, scope, linear_grad, stand_ins)
        # Gradients must reach layer 0 even when checkpointing: make the embeddings' output require grad.
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None:
            stack.enter_context(_output_requires_grad(embeddings))
        disable_adapters = getattr(model, "disable_adapter", None)
        if callable(disable_adapters):
            stack.enter_context(disable_adapters())  # score the base model, not base + adapter
        model.train()
        stack.enter_context(_training_without_dropout(model))
        count = 0
        bar = tqdm(total=num_batches, desc="Fisher scoring", unit="batch", disable=not progress)
        stack.callback(bar.close)
        for batch in batches:
            if count == num_batches:
                break
            with autocast() if autocast is not None else contextlib.nullcontext():
                loss = loss_fn(model, batch)
            loss.backward()
            accumulator.flush()
            count += 1
            bar.update(1)
        accumulator.check_reached()

    if count == 0:
        raise FoRAInputError("Fisher scoring got no batch: the dataset (or this rank's share of it) is empty.")
    if count < num_batches:
        warnings.warn(
            f"fisher_batches={num_batches} but only {count} batches are available; scoring on {count}. "
            "Lower fisher_batches or use more data to silence this.",
            stacklevel=2,
        )
    # The count joins the totals on the device without a host-to-device copy (a blocking copy waits for the stream).
    stats = torch.cat((accumulator.totals, accumulator.totals.new_full((1,), count)))  # (L + 1,)
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


@dataclass
class _Scope:
    """Which base parameters of a decoder layer count in its score."""

    fisher_params: str
    target_modules: Sequence[str]
    target_parameters: Sequence[str]

    def names(self, module_name: str, tensor_names: Iterable[str]) -> list[str]:
        """The module's own tensors in scope, from its name in the layer."""
        if self.fisher_params == "layer":
            return list(tensor_names)
        if _in_scope(module_name, self.target_modules):
            return list(tensor_names)
        return [n for n in tensor_names if _in_scope(f"{module_name}.{n}", self.target_parameters)]


def _watch_layer(
    accumulator: _LayerAccumulator,
    index: int,
    layer_name: str,
    layer: nn.Module,
    scope: _Scope,
    linear_grad: str,
    quantized: Collection[nn.Module],
) -> None:
    """Hooks that score the layer's base parameters in scope, each module by the cheapest exact route it allows."""
    for name, module in layer.named_modules():
        if _is_adapter_parameter(name):
            continue
        tensors = _weight_tensors(module)
        names = scope.names(name, tensors)
        if not names:
            continue
        label = f"{layer_name}.{name}" if name else layer_name
        by_activations = linear_grad == "activations" or module in quantized or not _has_autograd_weight(module)
        if is_linear_like(module) and by_activations:
            # Weight and bias from x and g, whatever holds the weight (packed buffers, tensor subclasses, shards).
            _check_trainable_layout(module)
            accumulator.watch_linear(index, label, module, with_bias=getattr(module, "bias", None) is not None)
            continue
        unscorable = [
            n for n in names if not (isinstance(tensors[n], nn.Parameter) and tensors[n].is_floating_point())
        ]
        if unscorable:
            raise FoRAInputError(
                f"{label} ({type(module).__name__}) holds weights {unscorable} that Fisher scoring cannot reach: "
                "they are buffers or non-float tensors (a quantized format), and the module is not linear-like "
                "(no in_features/out_features), so neither autograd nor its input and output gradient give their "
                "gradient. Load this model unquantized for scoring, or pass scores computed elsewhere (scores_path)."
            )
        if linear_grad == "activations":
            if accumulator.gather is None and any(tensors[n].numel() == 0 for n in names):
                # A sharding engine (DeepSpeed ZeRO-3) keeps the weight elsewhere: the replay needs it whole.
                raise FoRAInputError(
                    f"{label} ({type(module).__name__}) holds parameters {names} with no elements here: a sharding "
                    "engine (DeepSpeed ZeRO-3) partitions them, and scoring re-runs this module on them. Pass "
                    "fisher_scores(..., gather=fora_plugin.zero.gathered_parameters) so that they are gathered whole "
                    "for it (FoRASFTTrainer and the Axolotl plugin do)."
                )
            accumulator.watch_module(index, label, module, names)
            continue
        for n in names:
            param = tensors[n]
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
