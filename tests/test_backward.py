"""The backward stops at the lowest adapted decoder layer, with activation checkpointing too.

Each run trains one step through ``FoRASFTTrainer``'s real wiring (TRL's embeddings hook, ``Trainer.train``'s own
``activation_checkpointing_enable``, the callback), and is compared with the behaviour before: the same LoRA weights
and batch through ``training_step`` with TRL's ``enable_input_require_grads`` hook, the way plain LoRA runs.
"""

import logging
import sys
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, tiny_llama
from test_trainer import LAYERS, VOCAB, lora_config, sft_args, sums_dataset
from transformers import TrainerCallback

from fora_plugin import FoRAConfig, FoRASFTTrainer
from fora_plugin.backward import (
    BackwardStopCallback,
    is_reentrant,
    lowest_adapted_layer,
    stop_backward_at_lowest_adapted_layer,
    trainable_below,
)
from fora_plugin.targets import find_decoder_layers


HERE = Path(__file__).parent
ADAPTED = [2, 3]  # of LAYERS = 4: layers 0 and 1 and the embeddings lie below


class GradCapture(TrainerCallback):
    """The trainable parameters' gradients of the first optimizer step, before the optimizer sees them."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


class BelowCounter:
    """Counts, for the modules below the lowest adapted layer, backward calls (a full backward hook on each), forward
    calls of a layer's MLP (2 per step when the layer is recomputed) and outputs that require grad."""

    def __init__(self, model: torch.nn.Module, lowest: int) -> None:
        _, layers = find_decoder_layers(model)
        base = model.get_base_model()
        self.modules = {"embed_tokens": base.get_input_embeddings()}
        for i in range(lowest):
            self.modules[f"layers.{i}"] = layers[i]
            for name, module in layers[i].named_modules():
                if name:
                    self.modules[f"layers.{i}.{name}"] = module
        self.backward: dict[str, int] = {}
        self.requires_grad_outputs: dict[str, int] = {}
        self.mlp_forwards = 0
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(module.register_full_backward_hook(self._backward_hook(name)))
            self.handles.append(module.register_forward_hook(self._forward_hook(name)))
        self.handles.append(layers[0].mlp.register_forward_pre_hook(self._count_mlp))

    def _backward_hook(self, name):
        def hook(module, grad_input, grad_output):
            self.backward[name] = self.backward.get(name, 0) + 1

        return hook

    def _forward_hook(self, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                self.requires_grad_outputs[name] = self.requires_grad_outputs.get(name, 0) + 1

        return hook

    def _count_mlp(self, module, args):
        self.mlp_forwards += 1

    def reset(self) -> None:
        self.backward, self.requires_grad_outputs, self.mlp_forwards = {}, {}, 0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def make(tmp_path, reentrant: bool | None, fora: FoRAConfig | None = None, **kwargs) -> FoRASFTTrainer:
    checkpointing = reentrant is not None
    return FoRASFTTrainer(
        tiny_llama(LAYERS, vocab_size=VOCAB),
        sft_args(
            tmp_path,
            max_steps=1,
            train_sampling_strategy="sequential",
            max_grad_norm=0.0,  # the gradients as the backward left them, not clipped
            gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant} if checkpointing else None,
        ),
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=kwargs.pop("peft_config", None) or lora_config(),
        # A Gaussian lora_A: with A = 0 every lora_B gradient would be zero, and comparing zeros proves nothing.
        fora_config=fora or FoRAConfig(layers=ADAPTED, init_a="gaussian"),
    )


def train_one_step(trainer: FoRASFTTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], BelowCounter]:
    """(the trainable weights before the step, their gradients in the step, the counter of the step)."""
    lowest = lowest_adapted_layer(trainer.model)
    counter = BelowCounter(trainer.model, lowest)
    capture = GradCapture()
    trainer.add_callback(capture)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    return weights, capture.grads, counter


def old_behaviour_grads(trainer: FoRASFTTrainer, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients of the same step as plain LoRA computes them: the same weights and first batch, the backward
    through every layer (TRL's enable_input_require_grads hook), under the same checkpointing."""
    model = trainer.model
    if trainer.fora_backward_stop is not None:
        trainer.fora_backward_stop.remove()
    model.enable_input_require_grads()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in weights:
                p.copy_(weights[n])
    model.zero_grad(set_to_none=True)
    # The first batch, and the label count that Trainer divides the summed loss by, as the training loop gets them.
    (batch,), num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, trainer.args.device)
    trainer.training_step(model, batch, num_items)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys() and any("lora_A" in n for n in actual)
    assert sum(1 for n in actual if "lora_B" in n) == len(ADAPTED) * 5
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name  # a gradient that is there to compare
        torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_grads_unchanged_and_nothing_below_the_lowest_adapted_layer_runs_backward(tmp_path, reentrant):
    trainer = make(tmp_path, reentrant)
    assert trainer.fora_backward_stop is not None and trainer.fora_backward_stop.index == ADAPTED[0]
    weights, grads, counter = train_one_step(trainer)
    # One training step: nothing below layer 2 ran a backward, required grad or was recomputed.
    assert counter.backward == {} and counter.requires_grad_outputs == {}
    assert counter.mlp_forwards == 1
    counter.reset()
    expected = old_behaviour_grads(trainer, weights)
    # The counter sees the old behaviour: every module below runs its backward, and layer 0 is recomputed.
    assert set(counter.backward) == set(counter.modules)
    assert counter.mlp_forwards == 2
    assert_grads_equal(grads, expected)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_layers_below_run_without_checkpoints_and_get_them_back_when_the_stop_is_removed(tmp_path, reentrant):
    # No backward reaches them, so a checkpoint would keep and recompute nothing (and, reentrant, would put a
    # no-grad checkpoint into a compiled graph).
    trainer = make(tmp_path, reentrant)
    train_one_step(trainer)
    _, layers = find_decoder_layers(trainer.model)
    stop = trainer.fora_backward_stop
    # (Layer 2 itself runs without its checkpoint where transformers < 5.23 runs its hooks inside it, reentrant.)
    assert [layer.gradient_checkpointing for layer in layers] == [False, False, not stop._checkpoint_off, True]
    # Reentrant: the hidden state entering layer 2 requires grad through a zero that does; its gradient is dropped.
    assert (stop._anchor is not None) == reentrant and (stop._anchor is None or stop._anchor.grad is None)
    stop.remove()
    assert all(layer.gradient_checkpointing for layer in layers)


def test_without_checkpointing_nothing_below_runs_backward_either(tmp_path):
    trainer = make(tmp_path, None)
    _, grads, counter = train_one_step(trainer)
    assert counter.backward == {} and counter.requires_grad_outputs == {} and counter.mlp_forwards == 1
    assert sum(1 for n in grads if "lora_" in n) == 2 * len(ADAPTED) * 5


def test_trainable_embeddings_below_keep_the_old_behaviour_with_a_warning_naming_them(tmp_path):
    with pytest.warns(UserWarning, match=r"below decoder layer 2, the lowest adapted one: .*embed_tokens"):
        trainer = make(tmp_path, False, peft_config=lora_config(modules_to_save=["embed_tokens"]))
    assert trainer.fora_backward_stop is None
    assert not any(isinstance(cb, BackwardStopCallback) for cb in trainer.callback_handler.callbacks)
    _, grads, counter = train_one_step(trainer)
    assert counter.mlp_forwards == 2 and counter.backward  # the backward runs through layers 0 and 1
    embedding = [g for n, g in grads.items() if "embed_tokens" in n]
    assert embedding and embedding[0].abs().max() > 0


def test_the_lm_head_above_does_not_count_as_below(tmp_path):
    trainer = make(tmp_path, False, peft_config=lora_config(modules_to_save=["lm_head"]))
    assert trainer.fora_backward_stop is not None
    assert trainer_below_names(trainer) == []


def trainer_below_names(trainer) -> list[str]:
    return trainable_below(trainer.model, lowest_adapted_layer(trainer.model))


def test_fisher_scoring_is_unchanged_it_reaches_every_layer(tmp_path):
    # Scoring chooses from all layers: each must get a score from its gradients, with checkpointing as in training.
    fora = FoRAConfig(fisher_batches=2, init_a="gaussian", layer_budget=1)
    trainer = make(tmp_path, True, fora)
    scores = trainer.fora_selection.scores.scores
    assert len(scores) == LAYERS and all(s > 0 for s in scores)
    assert trainer.fora_backward_stop.index == trainer.fora_selection.chosen[0]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_an_embeddings_hook_whose_handle_was_lost_is_cut_at_the_lowest_adapted_layer(tmp_path, caplog, reentrant):
    # As Axolotl's loader leaves one: gradient_checkpointing_enable adds the hook, a second enable_input_require_grads
    # overwrites its handle, and disable_input_require_grads cannot reach it.
    trainer = make(tmp_path, reentrant)
    lost = trainer.model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True))
    with caplog.at_level(logging.INFO, logger="fora_plugin.backward"):
        weights, grads, counter = train_one_step(trainer)
    assert "decoder layer 2 already requires grad" in caplog.text
    assert counter.backward == {} and counter.mlp_forwards == 1  # no backward and no recompute below all the same
    lost.remove()
    counter.reset()
    assert_grads_equal(grads, old_behaviour_grads(trainer, weights))
    assert counter.backward and counter.mlp_forwards == 2


def test_lora_mode_is_exactly_sft_trainer_no_stop(tmp_path):
    trainer = make(tmp_path, False, FoRAConfig(mode="lora"))
    assert trainer.fora_backward_stop is None


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (None, False),  # transformers passes use_reentrant=False when given no kwargs
        ({}, False),
        ({"every_n_layers": 2}, False),
        ({"use_reentrant": False}, False),
        ({"use_reentrant": True}, True),
        ({"preserve_rng_state": True}, True),  # torch.utils.checkpoint's own default
    ],
)
def test_is_reentrant_follows_transformers_and_torch_defaults(kwargs, expected):
    assert is_reentrant(kwargs) is expected


def test_stop_needs_a_trainable_layer():
    class View:
        model = tiny_llama(LAYERS, vocab_size=VOCAB).requires_grad_(False)

    assert stop_backward_at_lowest_adapted_layer(View()) is None


# ------------------------------------------------------------------------------------------------------- ZeRO-3
@pytest.fixture(scope="module")
def zero3_backward(tmp_path_factory):
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(HERE))
    from test_zero import torchrun

    out = tmp_path_factory.mktemp("backward_zero3")
    tiny_llama(LAYERS, vocab_size=VOCAB).save_pretrained(out / "model")  # loaded under zero.Init by every rank
    torchrun(HERE / "distributed" / "backward_zero3.py", str(out))
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["reentrant", "default"])
def test_zero3_lora_grads_unchanged_and_nothing_below_runs_backward(zero3_backward, variant):
    for ranks in zero3_backward:
        run = ranks[variant]
        assert run["reentrant"] is (variant == "reentrant")
        assert run["stop_index"] == ADAPTED[0]
        assert run["with"]["backward_below"] == {} and run["with"]["mlp_forwards"] == 1
        assert run["without"]["backward_below"] and run["without"]["mlp_forwards"] == 2
        assert_grads_equal(run["with"]["grads"], run["without"]["grads"])


# -------------------------------------------------------------------------------------------------------- FSDP2
@pytest.fixture(scope="module")
def fsdp2_backward(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    from test_zero import torchrun

    out = tmp_path_factory.mktemp("backward_fsdp2")
    torchrun(HERE / "distributed" / "backward_fsdp2.py", str(out))
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.slow
def test_fsdp2_lora_grads_unchanged_and_nothing_below_runs_backward(fsdp2_backward):
    for run in fsdp2_backward:
        assert run["with"]["sharded"] and run["without"]["sharded"]
        assert run["with"]["backward_below"] == {} and run["with"]["mlp_forwards"] == 1
        assert run["without"]["backward_below"] and run["without"]["mlp_forwards"] == 2
        assert_grads_equal(run["with"]["grads"], run["without"]["grads"])
