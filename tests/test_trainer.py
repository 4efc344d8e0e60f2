"""FoRASFTTrainer on a tiny Llama with a character tokenizer and prompt/completion data."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TARGETS, char_tokenizer, readme_code, tiny_llama, tiny_llama_config
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
from trl import SFTConfig, SFTTrainer

import fora_plugin.training as training_module
from fora_plugin import FoRAConfig, FoRASFTTrainer, stiefel_parameters
from fora_plugin.fisher import fisher_scores
from fora_plugin.stiefel import orthogonality_error
from fora_plugin.wiring import format_selection_table


VOCAB = 99  # the character tokenizer's size
LAYERS = 4


def sums_dataset(n: int = 36) -> Dataset:
    rows = [{"prompt": f"Q: {a}+{b}=", "completion": f" {a + b}"} for a in range(6) for b in range(6)]
    return Dataset.from_list(rows[:n])


def lora_config(**kwargs) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(TARGETS), **kwargs)


def sft_args(tmp_path, **kwargs) -> SFTConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=8,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        gradient_checkpointing=False,
        seed=0,
    )
    defaults.update(kwargs)
    return SFTConfig(**defaults)


def make_trainer(tmp_path, fora_config=None, peft_config=None, dataset=None, **kwargs):
    return FoRASFTTrainer(
        tiny_llama(LAYERS, vocab_size=VOCAB),
        sft_args(tmp_path, **kwargs),
        train_dataset=dataset if dataset is not None else sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=peft_config or lora_config(),
        fora_config=fora_config or FoRAConfig(fisher_batches=3),
    )


def adapted_layers(model) -> set[int]:
    return {int(name.split(".layers.")[1].split(".")[0]) for name, _ in model.named_parameters() if "lora_A" in name}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fora")
    trainer = make_trainer(tmp_path, FoRAConfig(fisher_batches=3, lr_stiefel=5e-2), max_steps=30)
    trainer.train()
    return tmp_path, trainer


def test_lora_sits_on_exactly_the_k_chosen_layers_and_b_stays_orthonormal(trained):
    _, trainer = trained
    chosen = trainer.fora_selection.chosen
    scores = trainer.fora_selection.scores.scores
    assert len(chosen) == LAYERS // 2
    assert chosen == sorted(sorted(range(LAYERS), key=lambda i: -scores[i])[:2])  # the top-2 by score
    assert adapted_layers(trainer.model) == set(chosen)
    (group,) = [g for g in trainer.optimizer.param_groups if g["stiefel"]]
    assert {id(p) for p in group["params"]} == {id(p) for _, p in stiefel_parameters(trainer.model)}
    assert len(group["params"]) == len(chosen) * len(TARGETS)
    assert max(orthogonality_error(p.detach()).item() for p in group["params"]) < 1e-5
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert sum(losses[-5:]) < 0.95 * sum(losses[:5])  # 4.43 -> 4.16 on this run
    logged = next(e for e in trainer.state.log_history if "fora/layers_adapted" in e)
    assert logged["fora/layers_adapted"] == 2 and logged["fora/parameter_ratio_vs_lora_all"] == pytest.approx(0.5)
    assert all("fora/max_orthogonality_error" in e for e in trainer.state.log_history if "loss" in e)


def test_selection_json_plot_and_table(trained, capsys):
    tmp_path, trainer = trained
    saved = json.loads((tmp_path / "out" / "fora_scores.json").read_text())
    assert saved["chosen_layers"] == trainer.fora_selection.chosen and saved["k"] == 2
    assert saved["scores"] == trainer.fora_selection.scores.scores and saved["num_batches"] == 3
    assert (tmp_path / "out" / "fora_scores.png").read_bytes()[:4] == b"\x89PNG"
    table = format_selection_table(trainer.fora_selection)
    assert "| layer | Fisher score | trainable params |" in table
    for i in trainer.fora_selection.chosen:
        assert f"| {i} | " in table


def test_scoring_sees_the_completion_only_labels(tmp_path):
    trainer = make_trainer(tmp_path, FoRAConfig(fisher_batches=2), train_sampling_strategy="sequential")
    batches = [next(iter(trainer.get_train_dataloader()))]
    batches.append(list(trainer.get_train_dataloader())[1])
    assert all((b["labels"] == -100).any() for b in batches)  # the prompts are masked
    reference = fisher_scores(tiny_llama(LAYERS, vocab_size=VOCAB), batches, 2, progress=False).scores
    for a, e in zip(trainer.fora_selection.scores.scores, reference):
        assert a == pytest.approx(e, rel=1e-4)
    unmasked = [{**b, "labels": b["input_ids"]} for b in batches]
    full = fisher_scores(tiny_llama(LAYERS, vocab_size=VOCAB), unmasked, 2, progress=False).scores
    assert any(abs(a - b) > 1e-2 * b for a, b in zip(reference, full))


@pytest.mark.parametrize(
    ("mode", "layers", "stiefel"),
    [("fora", 2, True), ("fg-lora", 2, False), ("stiefel-lora", 4, True), ("lora", 4, False)],
)
def test_every_mode_builds_what_it_says(tmp_path, mode, layers, stiefel):
    trainer = make_trainer(tmp_path, FoRAConfig(mode=mode, fisher_batches=2), max_steps=1)
    trainer.train()
    assert len(adapted_layers(trainer.model)) == layers
    groups = trainer.optimizer.param_groups
    assert any(g.get("stiefel") for g in groups) == stiefel
    if not stiefel:  # PEFT's standard init: B = 0 before training
        assert not stiefel_parameters(trainer.model)


def test_lora_mode_trains_exactly_what_sft_trainer_trains(tmp_path):
    fora = make_trainer(tmp_path / "fora", FoRAConfig(mode="lora"), max_steps=6)
    fora.train()
    plain = SFTTrainer(
        tiny_llama(LAYERS, vocab_size=VOCAB),
        sft_args(tmp_path / "plain", max_steps=6),
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
    )
    plain.train()
    trainable = [{n for n, p in t.model.named_parameters() if p.requires_grad} for t in (fora, plain)]
    assert trainable[0] == trainable[1]
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (fora, plain)]
    assert losses[0] == losses[1]


def test_resume_reuses_the_selection_and_the_optimizer_state(tmp_path, monkeypatch):
    config = FoRAConfig(fisher_batches=2, lr_stiefel=5e-2)
    full = make_trainer(tmp_path / "full", config, max_steps=6, save_strategy="steps", save_steps=3)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-3"
    assert json.loads((checkpoint / "fora_scores.json").read_text())["chosen_layers"] == full.fora_selection.chosen

    def no_scoring(*args, **kwargs):
        raise AssertionError("a resumed run must not score again")

    monkeypatch.setattr(training_module, "fisher_scores", no_scoring)
    resumed = make_trainer(
        tmp_path / "full",
        config,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        resume_from_checkpoint=str(checkpoint),
    )
    assert resumed.fora_selection.chosen == full.fora_selection.chosen
    resumed.train(resume_from_checkpoint=str(checkpoint))
    final = dict(stiefel_parameters(full.model))
    for name, weight in stiefel_parameters(resumed.model):
        assert torch.allclose(weight, final[name], atol=1e-6)
    a_full = {n: p for n, p in full.model.named_parameters() if "lora_A" in n}
    for n, p in resumed.model.named_parameters():
        if "lora_A" in n:
            assert torch.allclose(p, a_full[n], atol=1e-6)

    other = make_trainer(
        tmp_path / "other", FoRAConfig(layers=[0, 1] if full.fora_selection.chosen != [0, 1] else [2, 3])
    )
    with pytest.raises(ValueError, match=r"was trained with LoRA on layers .* but this trainer adapts layers"):
        other.train(resume_from_checkpoint=str(checkpoint))


def test_scores_path_reuses_an_earlier_scoring(trained, tmp_path, monkeypatch):
    earlier, trainer = trained
    monkeypatch.setattr(training_module, "fisher_scores", lambda *a, **k: pytest.fail("scored again"))
    reused = make_trainer(tmp_path, FoRAConfig(scores_path=str(earlier / "out" / "fora_scores.json")))
    assert reused.fora_selection.chosen == trainer.fora_selection.chosen


@pytest.mark.parametrize(("strategy", "expected"), [("first", [0, 1]), ("last", [2, 3])])
def test_control_strategies_skip_scoring(tmp_path, monkeypatch, strategy, expected):
    monkeypatch.setattr(training_module, "fisher_scores", lambda *a, **k: pytest.fail("scored"))
    trainer = make_trainer(tmp_path, FoRAConfig(layer_strategy=strategy))
    assert trainer.fora_selection.chosen == expected == sorted(adapted_layers(trainer.model))


def test_saved_adapter_is_plain_peft_lora_on_exactly_the_chosen_layers(trained, tmp_path):
    _, trainer = trained
    trainer.save_model(str(tmp_path / "adapter"))
    base_dir = tmp_path / "base"
    tiny_llama(LAYERS, vocab_size=VOCAB).save_pretrained(base_dir)
    adapter_dir = str(tmp_path / "adapter")
    script = f"""
import json, sys
from transformers import AutoModelForCausalLM
from peft import PeftModel
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(base_dir)!r}), {adapter_dir!r})
assert not any(name.startswith("fora_plugin") for name in sys.modules)
print(json.dumps(sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    expected = sorted(
        f"base_model.model.model.layers.{i}.{'self_attn' if t[0] in 'qkv' else 'mlp'}.{t}"
        for i in trainer.fora_selection.chosen
        for t in TARGETS
    )
    assert modules == expected
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys()
    assert keys and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in keys)
    assert {int(k.split(".layers.")[1].split(".")[0]) for k in keys} == set(trainer.fora_selection.chosen)


def test_bad_inputs_fail_loudly_with_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"got a PeftModel.*merge_and_unload"):
        FoRASFTTrainer(
            get_peft_model(tiny_llama(LAYERS, vocab_size=VOCAB), lora_config()),
            sft_args(tmp_path),
            train_dataset=sums_dataset(),
            processing_class=char_tokenizer(),
            peft_config=lora_config(),
        )
    with pytest.raises(TypeError, match=r"needs peft_config=LoraConfig"):
        FoRASFTTrainer(
            tiny_llama(LAYERS, vocab_size=VOCAB),
            sft_args(tmp_path),
            train_dataset=sums_dataset(),
            processing_class=char_tokenizer(),
        )
    with pytest.raises(ValueError, match=r"layers_to_transform=\[1\].*FoRA chooses the layers"):
        make_trainer(tmp_path, peft_config=lora_config(layers_to_transform=[1]))
    with pytest.raises(ValueError, match=r"'all-linear'.*name the target linears"):
        make_trainer(tmp_path, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"target modules \['gate_projection'\] are absent from the chosen layers"):
        make_trainer(tmp_path, peft_config=LoraConfig(r=4, target_modules=["q_proj", "gate_projection"]))
    with pytest.raises(ValueError, match=r"layers=\[1, 9\] has indices \[9\] outside 0..3"):
        make_trainer(tmp_path, FoRAConfig(layers=[1, 9]))
    with pytest.raises(ValueError, match=r"layer_budget=5 layers is outside 1..4"):
        make_trainer(tmp_path, FoRAConfig(layer_budget=5))
    with pytest.raises(ValueError, match=r"optim='sgd' cannot be combined with FoRA"):
        make_trainer(tmp_path, optim="sgd")
    with pytest.warns(UserWarning, match=r"fisher_batches=50 but only 9 batches"):
        make_trainer(tmp_path, FoRAConfig(fisher_batches=50))


# ----------------------------------------------------------------------------------- settings refused up front
# (A LoraConfig with init_lora_weights="loftq" needs scipy, absent here: test_axolotl refuses loftq_config.)
@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "lora_ga", "eva", "mica"])
def test_inits_that_change_the_base_or_lora_b_are_refused_before_wrapping(tmp_path, init):
    base = tiny_llama(LAYERS, vocab_size=VOCAB)
    weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    with pytest.raises(
        ValueError, match=rf"init_lora_weights='{init}' cannot be combined with mode='fora'.*Use one of"
    ):
        FoRASFTTrainer(
            base,
            sft_args(tmp_path),
            train_dataset=sums_dataset(),
            processing_class=char_tokenizer(),
            peft_config=lora_config(init_lora_weights=init),
        )
    assert all(torch.equal(p, weights[n]) for n, p in base.named_parameters())  # refused before any wrap


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal"])
def test_inits_that_keep_the_base_are_accepted_and_the_base_is_scored_unchanged(tmp_path, init):
    trainer = make_trainer(
        tmp_path, peft_config=lora_config(init_lora_weights=init), train_sampling_strategy="sequential"
    )
    batches = list(trainer.get_train_dataloader())[:3]
    reference = fisher_scores(tiny_llama(LAYERS, vocab_size=VOCAB), batches, 3, progress=False).scores
    assert trainer.fora_selection.scores.scores == pytest.approx(reference, rel=1e-4)
    base = tiny_llama(LAYERS, vocab_size=VOCAB).state_dict()
    for name, weight in trainer.model.get_base_model().state_dict().items():
        key = name.replace(".base_layer", "")
        if key in base:
            assert torch.equal(weight, base[key]), name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e-3])
def test_a_learning_rate_that_is_not_finite_and_nonnegative_is_refused(tmp_path, value):
    for mode in ("fora", "lora"):
        with pytest.raises(ValueError, match=rf"learning_rate={value!r} is invalid: use a finite float >= 0"):
            make_trainer(tmp_path, FoRAConfig(mode=mode), learning_rate=value)


def test_fsdp1_and_a_single_process_fsdp2_are_refused_up_front(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError, match=r"\(FSDP2, fsdp_config=.*cannot be combined with mode='fora' in a single process"
    ):
        make_trainer(tmp_path, fsdp="full_shard", fsdp_config={"version": 2})
    with pytest.raises(ValueError, match=r"\(FSDP1, fsdp_config=.*FSDP1 flattens parameters"):
        make_trainer(tmp_path, fsdp="full_shard", fsdp_config={"version": 1})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_FSDP=true \(FSDP1, from `accelerate launch`"):
        make_trainer(tmp_path)


def test_the_stiefel_betas_and_eps_reach_the_cayley_adam_group(tmp_path):
    config = FoRAConfig(layers=[1, 2], stiefel_beta1=0.8, stiefel_beta2=0.95, stiefel_eps=1e-6)
    trainer = make_trainer(tmp_path, config, adam_beta1=0.7, adam_epsilon=1e-7)
    optimizer = trainer.create_optimizer()
    (stiefel,) = [g for g in optimizer.param_groups if g.get("stiefel")]
    assert (stiefel["betas"], stiefel["eps"]) == ((0.8, 0.95), 1e-6)
    assert all((g["betas"], g["eps"]) == ((0.7, 0.999), 1e-7) for g in optimizer.param_groups if not g.get("stiefel"))


def test_a_diverging_run_warns_once_with_the_step_and_the_fix(tmp_path, caplog):
    # lora_A at lr 1e30 without clipping overflows float32 activations at the first update, so the loss turns
    # non-finite on every CPU (at lr 1e6 a CPU without AVX-512 kept the tiny model's loss at chance level, finite);
    # FoRA's own logs must not crash on the NaN weights.
    fora = FoRAConfig(fisher_batches=2, layers=[1, 3])
    trainer = make_trainer(tmp_path, fora, learning_rate=1e30, max_grad_norm=0.0, max_steps=6)
    with caplog.at_level(logging.WARNING, logger="fora_plugin.monitor"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if r.name == "fora_plugin.monitor"]
    assert warnings, "the diverging run was silent"
    assert any("step" in w and "learning_rate" in w for w in warnings), warnings
    assert len(warnings) == len(set(warnings))  # once per kind, not once per log


def test_a_scheduler_that_breaks_the_lr_ratio_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"lr_scheduler_type='greedy' cannot be used with FoRA"):
        make_trainer(tmp_path, lr_scheduler_type="greedy", eval_strategy="steps", eval_steps=2)


@pytest.mark.slow
def test_the_readmes_trl_snippet_runs_as_written_but_for_the_model_and_the_step_counts(tmp_path, monkeypatch):
    """The README's TRL snippet, run as written but for its model (a tiny Llama and the character tokenizer) and its
    counts (2 training steps, 2 scoring batches: 500 and 128 would take an hour on a CPU)."""
    code = readme_code("python", "FoRASFTTrainer(")
    for written in ('"path/to/model"', "max_steps=500", "fisher_batches=128"):
        assert code.count(written) == 1, written
    model_dir = tmp_path / "model"
    # 2 key/value heads of 16: k_proj and v_proj have the 32 outputs that the snippet's r = 32 Stiefel columns need.
    LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128)).save_pretrained(
        model_dir
    )
    char_tokenizer().save_pretrained(model_dir)
    code = code.replace('"path/to/model"', repr(str(model_dir)))
    code = code.replace("max_steps=500", "max_steps=2").replace("fisher_batches=128", "fisher_batches=2")
    if not torch.cuda.is_available():  # as the snippet's comment says: TRL's default bf16 needs a GPU otherwise
        code = code.replace("SFTConfig(", "SFTConfig(use_cpu=True, ")
    monkeypatch.chdir(tmp_path)  # its relative paths: the bundled data it reads, the `out` folder it writes
    (tmp_path / "example_configs").symlink_to(Path(__file__).resolve().parents[1] / "example_configs")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 (the README's own code)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and len(trainer.fora_selection.chosen) == 2  # K = 0.5 of 4 layers
    assert trainer.fora_selection.scores.num_batches == 2 and trainer.fora_config.lr_stiefel == 1e-3
    saved = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert {int(key.split(".layers.")[1].split(".")[0]) for key in saved} == set(trainer.fora_selection.chosen)
    assert json.loads((tmp_path / "out" / "fora_scores.json").read_text())["chosen_layers"] == (
        trainer.fora_selection.chosen
    )
