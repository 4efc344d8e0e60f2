"""The one FoRA optimizer inside an unmodified transformers.Trainer on a tiny Llama."""

import json

import pytest
import torch
from conftest import TARGETS, tiny_llama
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from fora_plugin import build_fora_optimizer, make_stiefel, stiefel_parameters
from fora_plugin.stiefel import orthogonality_error


LR, LR_STIEFEL = 3e-2, 1e-1
ADAPTED_LAYERS = [1, 3]


class OptimizerTrainer(Trainer):
    """Trainer whose optimizer is the single FoRA optimizer (what FoRASFTTrainer does)."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = build_fora_optimizer(
                self.model,
                lr=self.args.learning_rate,
                lr_stiefel=LR_STIEFEL,
                weight_decay=self.args.weight_decay,
                decay_parameter_names=self.get_decay_parameter_names(self.model),
            )
        return self.optimizer


class LearningRates(TrainerCallback):
    def __init__(self):
        self.per_step = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.per_step.append([g["lr"] for g in optimizer.param_groups])


def dataset(n=8, length=12):
    gen = torch.Generator().manual_seed(1)
    # A learnable pattern (each sequence counts up from a random start) so the loss can fall.
    starts = torch.randint(0, 80, (n, 1), generator=gen)
    ids = (starts + torch.arange(length)) % 96
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def fora_model(init_a="zeros"):
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=ADAPTED_LAYERS, lora_dropout=0.0
    )
    model = get_peft_model(tiny_llama(), config)
    make_stiefel(model, init_a=init_a, generator=torch.Generator().manual_seed(0))
    return model


def train(tmp_path, model, *, batch_size=2, accumulation=1, steps=60, warmup=4, callbacks=()):
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=LR,
        warmup_steps=warmup,
        lr_scheduler_type="linear",
        weight_decay=0.01,
        logging_steps=1,
        logging_strategy="steps",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = OptimizerTrainer(model=model, args=args, train_dataset=dataset(), callbacks=list(callbacks))
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fora")
    lrs = LearningRates()
    model = fora_model()
    trainer = train(tmp_path, model, callbacks=[lrs])
    return tmp_path, model, trainer, lrs


def test_only_adapted_lora_b_are_in_the_stiefel_group_and_stay_orthonormal(trained):
    _, model, trainer, _ = trained
    (stiefel_group,) = [g for g in trainer.optimizer.param_groups if g.get("stiefel")]
    names = {id(p): n for n, p in model.named_parameters()}
    in_group = sorted(names[id(p)] for p in stiefel_group["params"])
    assert in_group == sorted(n for n, _ in stiefel_parameters(model))
    assert len(in_group) == len(ADAPTED_LAYERS) * len(TARGETS)
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in in_group} == set(ADAPTED_LAYERS)
    for p in stiefel_group["params"]:
        assert orthogonality_error(p.detach()) < 1e-5
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert sum(losses[-5:]) < 0.95 * sum(losses[:5])  # 4.54 -> 4.19 on this run
    # B actually moved: the Stiefel group trained, it did not sit at its initialisation.
    fresh = dict(stiefel_parameters(fora_model()))
    moved = [torch.linalg.norm(p.detach() - fresh[n]).item() for n, p in stiefel_parameters(model)]
    assert min(moved) > 1e-3


def test_warmup_and_decay_scale_both_groups_in_their_ratio(trained):
    *_, lrs = trained
    adamw_lrs = [step[0] for step in lrs.per_step]
    stiefel_lrs = [step[-1] for step in lrs.per_step]
    assert adamw_lrs[:4] == sorted(adamw_lrs[:4]) and adamw_lrs[0] < LR  # warming up
    assert max(adamw_lrs) == pytest.approx(LR)
    assert max(stiefel_lrs) == pytest.approx(LR_STIEFEL)
    for a, s in zip(adamw_lrs, stiefel_lrs):
        assert s == pytest.approx(a * LR_STIEFEL / LR, abs=1e-12)


def test_gradient_accumulation_gives_the_same_stiefel_step(tmp_path):
    # A gaussian A makes lora_B's gradient non-zero from the first step.
    results = []
    for batch_size, accumulation in ((1, 2), (2, 1)):
        model = fora_model(init_a="gaussian")
        train(
            tmp_path / f"{batch_size}x{accumulation}",
            model,
            batch_size=batch_size,
            accumulation=accumulation,
            steps=3,
            warmup=0,
        )
        results.append(dict(stiefel_parameters(model)))
    start = dict(stiefel_parameters(fora_model(init_a="gaussian")))
    for name, weight in results[0].items():
        assert torch.linalg.norm(weight - start[name]) > 1e-4  # B moved
        assert torch.allclose(weight, results[1][name], atol=1e-5)


def test_saved_adapter_is_plain_lora_and_reloads_and_merges_to_the_same_logits(trained):
    tmp_path, model, _, _ = trained
    model.eval()
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    keys = load_file(adapter_dir / "adapter_model.safetensors").keys()
    assert keys and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in keys)

    reloaded = PeftModel.from_pretrained(tiny_llama(), adapter_dir).eval()
    with torch.no_grad():
        assert torch.max(torch.abs(reloaded(input_ids=tokens).logits - expected)) < 1e-5
        merged = reloaded.merge_and_unload()
        assert torch.max(torch.abs(merged(input_ids=tokens).logits - expected)) < 1e-5
