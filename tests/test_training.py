"""fora_plugin.training on TRL's trainer (FoRASFTTrainer): scoring runs as a training step does, with its
checkpointing and autocast, and under fp16 with a loss scale that gives the fp32 scores."""

import copy

import pytest
import torch
from conftest import char_tokenizer, tiny_llama
from test_trainer import LAYERS, VOCAB, lora_config, make_trainer, sft_args, sums_dataset

from fora_plugin import FoRAConfig, FoRASFTTrainer
from fora_plugin.fisher import fisher_scores


class LayerProbe:
    """Records every forward of a module inside a decoder layer: autocast on, its dtype, and how many times it ran.

    Under activation checkpointing the inside of a layer runs twice per batch (the forward, then its recompute in the
    backward); hooks on the layer itself stay outside the checkpoint.
    """

    def __init__(self, module: torch.nn.Module, device_type: str = "cpu") -> None:
        self.calls: list[tuple[bool, torch.dtype | None]] = []
        self.device_type = device_type
        module.register_forward_pre_hook(self.record)

    def record(self, module, args) -> None:
        autocast = torch.is_autocast_enabled(self.device_type)
        self.calls.append((autocast, torch.get_autocast_dtype(self.device_type) if autocast else None))

    def take(self) -> list[tuple[bool, torch.dtype | None]]:
        calls, self.calls = self.calls, []
        return calls


def probe_scoring_and_training(tmp_path, device_type: str = "cpu", **sft_kwargs):
    """(trainer, layer-0 MLP states while scoring 3 batches, the same while training 2 steps)."""
    model = tiny_llama(LAYERS, vocab_size=VOCAB)  # stored in fp32: bf16/fp16 comes from the autocast only
    probe = LayerProbe(model.model.layers[0].mlp, device_type=device_type)
    trainer = FoRASFTTrainer(
        model,
        sft_args(tmp_path, max_steps=2, **sft_kwargs),
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=FoRAConfig(fisher_batches=3),
    )
    scoring = probe.take()
    trainer.train()
    return trainer, scoring, probe.take()


@pytest.mark.parametrize(("checkpointing", "bf16"), [(True, True), (False, False)])
def test_scoring_runs_with_the_checkpointing_and_autocast_of_a_training_step(tmp_path, checkpointing, bf16):
    trainer, scoring, training = probe_scoring_and_training(tmp_path, gradient_checkpointing=checkpointing, bf16=bf16)
    runs_per_batch = 2 if checkpointing else 1
    # Scoring needs every layer's gradient; training recomputes layer 0 only if LoRA is on it (the backward stops at
    # the lowest adapted layer, tests/test_backward.py).
    training_runs = runs_per_batch if trainer.fora_selection.chosen[0] == 0 else 1
    assert len(scoring) == 3 * runs_per_batch and len(training) == 2 * training_runs
    expected = (True, torch.bfloat16) if bf16 else (False, None)
    assert set(scoring) == set(training) == {expected}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_on_cuda_scoring_runs_with_the_checkpointing_and_autocast_of_a_training_step(tmp_path, precision, dtype):
    trainer, scoring, training = probe_scoring_and_training(
        tmp_path, "cuda", use_cpu=False, gradient_checkpointing=True, **{precision: True}
    )
    assert len(scoring) == 3 * 2 and len(training) == 2 * 2  # forward + recompute per batch
    assert set(scoring) == set(training) == {(True, dtype)}
    scores = trainer.fora_selection.scores
    assert all(s > 0 for s in scores.scores)
    assert scores.extra.get("loss_scale") == (2.0**16 if precision == "fp16" else None)


def test_fp16_scores_are_loss_scaled_to_the_fp32_scores(tmp_path):
    # A small lm_head makes every gradient tiny (~1e-9 squared per layer): fp16 flushes many of them to zero.
    fp32 = tiny_llama(LAYERS, vocab_size=VOCAB)
    with torch.no_grad():
        fp32.lm_head.weight.mul_(1e-4)
    trainer = FoRASFTTrainer(
        copy.deepcopy(fp32).half(),
        sft_args(tmp_path, train_sampling_strategy="sequential"),
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=FoRAConfig(fisher_batches=2),
    )
    batches = list(trainer.get_train_dataloader())[:2]
    # The reference: the same fp16-rounded weights, scored in fp32.
    reference = fisher_scores(copy.deepcopy(fp32).half().float(), batches, 2, progress=False).scores
    assert trainer.fora_selection.scores.scores == pytest.approx(reference, rel=2e-2)
    assert trainer.fora_selection.scores.extra["loss_scale"] == 2.0**16


@pytest.mark.parametrize("launched", [False, True])
def test_an_unset_cuda_graph_is_eager_in_a_launchers_process_group(tmp_path, monkeypatch, launched):
    """A single process captures Cayley-Adam's step where it can (here on the CPU's stand-in graph backend); under a
    launcher (DDP, FSDP2) an unset cuda_graph stays eager, not yet measured there, and true still captures."""
    from fora_plugin import make_stiefel, training
    from fora_plugin.optim import cayley_adam, resolve_cuda_graph

    monkeypatch.setitem(cayley_adam.GRAPH_BACKENDS, "cpu", lambda run, device: run)
    monkeypatch.setattr(training, "launched", lambda args: launched)
    trainer = make_trainer(tmp_path)
    make_stiefel(trainer.model, generator=torch.Generator().manual_seed(0))
    captured = {}
    for asked in (None, True, False):
        optimizer = training.fora_optimizer(trainer, trainer.model, FoRAConfig(cuda_graph=asked))
        captured[asked] = {resolve_cuda_graph(g["cuda_graph"], g["params"]) for g in optimizer.stiefel_groups}
    assert captured == {None: {not launched}, True: {True}, False: {False}}
