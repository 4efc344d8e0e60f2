"""Fisher scores of quantized linears other than bitsandbytes: weights held as buffers (GPTQ, AWQ, HQQ) or tensor
subclasses (torchao), which autograd gives no gradient. They are scored from their input and output gradient; a
weight-holding module that can be scored by neither route is refused by name."""

import pytest
import torch
from conftest import TARGETS, tiny_llama
from test_fisher import assert_close, brute_force_scores, make_batches
from torch import nn
from torch.nn import functional as F

from fora_plugin.fisher import fisher_scores


class BufferLinear(nn.Module):
    """A linear whose weight is a buffer, as GPTQ/AWQ/HQQ linears keep their packed weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().clone())
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class PackedTable(nn.Module):
    """Holds packed int8 weights but is not linear-like: nothing can score it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.zeros(4, 4, dtype=torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class NoBackwardLinear(BufferLinear):
    """A kernel without a backward: no gradient gets through it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.detach(), self.weight)


def with_layer_replaced(cls, layer=1):
    model = tiny_llama()
    for module in list(model.model.layers[layer].modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, cls(child))
    return model


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
@pytest.mark.parametrize("fisher_params", ["layer", "targets"])
def test_a_linear_holding_its_weight_as_a_buffer_scores_like_nn_linear(fisher_params, linear_grad):
    batches = make_batches()
    kwargs = dict(fisher_params=fisher_params, linear_grad=linear_grad, progress=False)
    if fisher_params == "targets":
        kwargs["target_modules"] = TARGETS
    buffered = fisher_scores(with_layer_replaced(BufferLinear), batches, 3, **kwargs).scores
    plain = fisher_scores(tiny_llama(), batches, 3, **kwargs).scores
    assert_close(buffered, plain, rtol=1e-4)


def test_weights_no_route_can_score_are_refused_by_type():
    model = tiny_llama()
    model.model.layers[2].mlp.packed = PackedTable()
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.packed \(PackedTable\) holds weights \['qweight'\]"):
        fisher_scores(model, make_batches(), 1, progress=False)


def test_a_linear_that_passes_no_gradient_is_refused_by_type():
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj': 'NoBackwardLinear'.*never received"):
        fisher_scores(with_layer_replaced(NoBackwardLinear), make_batches(), 1, progress=False)


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
def test_torchao_int8_weight_only_model_is_scored(tmp_path, linear_grad):
    # A real non-bitsandbytes backend on a CPU: torchao int8 weight-only through transformers' TorchAoConfig; its
    # weights are Int8Tensor subclasses. Reference: brute-force autograd on a float model holding the dequantised
    # weights.
    pytest.importorskip("torchao", reason="pip install torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny_llama().save_pretrained(tmp_path)
    config = TorchAoConfig(Int8WeightOnlyConfig())
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu")
    reference = tiny_llama()
    dequantized = 0
    with torch.no_grad():
        for name, module in quantized.model.layers.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) and type(weight) is not nn.Parameter:
                reference.model.layers.get_submodule(name).weight.copy_(weight.dequantize())
                dequantized += 1
    assert dequantized == 4 * 7  # every linear of every decoder layer is quantized
    batches = make_batches()
    scores = fisher_scores(quantized, batches, 3, linear_grad=linear_grad, progress=False).scores
    assert_close(scores, brute_force_scores(reference, batches), rtol=1e-4)


def _load_4bit(path) -> nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cpu")


class InputStorages:
    """Weak references to the storages of every input the given modules received in a forward with gradients on:
    ``alive()`` is how many of them something still holds (a saved activation, a closure)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.refs: dict[int, StorageWeakRef] = {}
        self.calls = 0

        def record(module, args):
            if torch.is_grad_enabled() and isinstance(args[0], torch.Tensor):
                self.calls += 1
                storage = args[0].untyped_storage()
                self.refs.setdefault(storage.data_ptr(), StorageWeakRef(storage))

        self.handles = [m.register_forward_pre_hook(record) for m in modules]

    def clear(self) -> None:
        self.refs.clear()
        self.calls = 0

    def alive(self) -> int:
        import gc

        gc.collect()
        return sum(not ref.expired() for ref in self.refs.values())


def score_counting_live_inputs(model: nn.Module, linears: list[nn.Module], linear_grad: str):
    """Fisher scores of ``model`` and, for each batch, how many distinct input storages of ``linears`` are alive
    between its forward and its backward."""
    storages = InputStorages(linears)
    counts = []

    def counting_loss(model, batch):
        storages.clear()
        loss = model(**batch).loss
        assert storages.calls == len(linears)  # every input was seen: the count below is of all of them
        counts.append(storages.alive())
        return loss

    batches = make_batches()
    scores = fisher_scores(model, batches, 3, loss_fn=counting_loss, linear_grad=linear_grad, progress=False).scores
    return scores, counts


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
def test_scoring_under_non_reentrant_checkpointing_keeps_no_4bit_input_alive(tmp_path, linear_grad):
    # x/g scoring needs each linear's input x at its backward. Held outside autograd (in a hook's closure), x stayed
    # alive from the forward to the backward even under checkpointing, which frees only what autograd saved: 16 of
    # the 28 Linear4bit inputs of this model (an 8B QFoRA run: ~7 GB). Saved through autograd, checkpointing drops x
    # after the forward and recomputes it in the backward, like any activation; the scores stay the same.
    bnb = pytest.importorskip("bitsandbytes")
    tiny_llama().save_pretrained(tmp_path)
    alive, scores = {}, {}
    for checkpointing in (False, True):
        model = _load_4bit(tmp_path)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(linears) == 4 * 7
        scores[checkpointing], alive[checkpointing] = score_counting_live_inputs(model, linears, linear_grad)
    assert all(count > 0 for count in alive[False])  # the probe sees what a backward needs (no checkpointing)
    assert alive[True] == [0, 0, 0], alive
    assert_close(scores[True], scores[False], rtol=1e-6)


def test_activations_mode_under_checkpointing_keeps_no_replay_input_alive():
    # linear_grad="activations" (ZeRO-3, FSDP2) scores a norm by replaying it on its input in the backward. Held in
    # a closure, that input outlived the forward under checkpointing: the post-attention norm's input (an
    # intermediate, not a checkpointed layer input) stayed alive in every layer. Saved through autograd, it is freed.
    model = tiny_llama().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    norms = [layer.post_attention_layernorm for layer in model.model.layers]
    scores, alive = score_counting_live_inputs(model, norms, "activations")
    assert alive == [0, 0, 0], alive
    assert_close(scores, brute_force_scores(tiny_llama(), make_batches()), rtol=1e-5)
