"""Liger's kernels: refused where they cannot run, and FoRA's scoring, selection, backward stop and training with
Liger's RMSNorm, SwiGLU and RoPE swapped in (``liger_standin``: Liger's swaps and in-place backwards, in torch)."""

import importlib.util

import pytest
import torch
from conftest import TARGETS, char_tokenizer, tiny_llama
from liger_standin import liger_standins
from peft import LoraConfig, get_peft_model
from test_trainer import LAYERS, VOCAB, lora_config, sft_args, sums_dataset

from fora_plugin import FoRAConfig, FoRASFTTrainer
from fora_plugin.compatibility import check_liger
from fora_plugin.errors import FoRAInputError
from fora_plugin.fisher import fisher_scores


def test_liger_is_refused_where_it_cannot_run_and_passed_where_it_can(monkeypatch):
    check_liger(False, "use_liger_kernel")
    check_liger(None, "liger_rms_norm")
    find_spec = importlib.util.find_spec
    installed = {"liger_kernel": None}  # Axolotl's environment has the package, the main one has not
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: installed.get(name, find_spec(name)))
    with pytest.raises(FoRAInputError, match=r"use_liger_kernel=True cannot run here: the liger-kernel package is"):
        check_liger(True, "use_liger_kernel")
    installed["liger_kernel"] = object()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FoRAInputError, match=r"liger_rope=True cannot run here: this run has no CUDA GPU .*Set liger"):
        check_liger(True, "liger_rope")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_liger(True, "use_liger_kernel")
    with pytest.raises(FoRAInputError, match=r"no CUDA GPU"):
        check_liger(True, "use_liger_kernel", cpu=True)


def lora_llama():
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian")
    model = get_peft_model(tiny_llama(LAYERS, vocab_size=VOCAB), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
    return model.train()


BATCHES = [
    {"input_ids": ids, "labels": ids}
    for ids in torch.randint(3, VOCAB, (3, 2, 12), generator=torch.Generator().manual_seed(2)).unbind(0)
]


def test_the_standins_compute_what_the_model_computes():
    model = lora_llama()
    grads = []
    for swapped in (False, True):
        model.zero_grad()
        with liger_standins(model) if swapped else torch.enable_grad():
            model(**BATCHES[0]).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * LAYERS * len(TARGETS)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with liger_standins(model):
        assert type(model.get_base_model().model.norm).__name__ == "LlamaRMSNorm"
        assert model.get_base_model().model.norm._get_name() == "LigerRMSNorm"


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["no-checkpointing", "non-reentrant", "reentrant"])
def test_scores_with_liger_are_the_scores_without(linear_grad, checkpointing):
    # "activations" scores each RMSNorm by re-running it on its saved input with the output gradient: Liger's
    # backward writes its input gradient over that output gradient, which must not reach the real backward.
    scores = []
    for swapped in (False, True):
        model = lora_llama()
        if checkpointing is not None:
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing})
        with liger_standins(model) if swapped else torch.enable_grad():
            result = fisher_scores(model, BATCHES, 3, linear_grad=linear_grad, progress=False)
        scores.append(result.scores)
    assert all(s > 0 for s in scores[0])
    torch.testing.assert_close(torch.tensor(scores[1]), torch.tensor(scores[0]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["no-checkpointing", "non-reentrant", "reentrant"])
def test_fora_selects_stops_the_backward_and_trains_the_same_with_liger(tmp_path, reentrant):
    runs = []
    for swapped in (False, True):
        model = tiny_llama(LAYERS, vocab_size=VOCAB)
        checkpointing = {} if reentrant is None else {"gradient_checkpointing": True}
        if reentrant is not None:
            checkpointing["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant}
        with liger_standins(model) if swapped else torch.enable_grad():
            trainer = FoRASFTTrainer(
                model,
                sft_args(tmp_path / str(swapped), max_steps=4, **checkpointing),
                train_dataset=sums_dataset(),
                processing_class=char_tokenizer(),
                peft_config=lora_config(),
                fora_config=FoRAConfig(fisher_batches=3, lr_stiefel=5e-2),
            )
            assert trainer.fora_backward_stop is not None
            trainer.train()
        runs.append(trainer)
    assert runs[1].fora_selection.chosen == runs[0].fora_selection.chosen
    torch.testing.assert_close(
        torch.tensor(runs[1].fora_selection.scores.scores), torch.tensor(runs[0].fora_selection.scores.scores)
    )
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in runs]
    assert len(losses[0]) == 4
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)
