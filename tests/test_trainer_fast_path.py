"""FoRASFTTrainer with what makes a LoRA step fast: PEFT's input cast off under autocast, bf16 adapters with fp32
masters, Liger's kernels (refused where they cannot run) and ``torch_compile``; on a tiny bf16 Llama, CPU autocast."""

import pytest
import torch
from conftest import char_tokenizer, tiny_llama
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from test_trainer import LAYERS, VOCAB, lora_config, sft_args, sums_dataset

from fora_plugin import FoRAConfig, FoRASFTTrainer
from fora_plugin.cli import main
from fora_plugin.errors import FoRAInputError


def bf16_trainer(tmp_path, fora_config: FoRAConfig, **kwargs) -> FoRASFTTrainer:
    args = {"bf16": True, "max_steps": 8, **kwargs}
    return FoRASFTTrainer(
        tiny_llama(LAYERS, vocab_size=VOCAB).to(torch.bfloat16),
        sft_args(tmp_path, **args),
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=fora_config,
    )


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("mode", ["fora", "lora"])
def test_the_input_cast_off_trains_exactly_what_the_cast_on_trains(tmp_path, mode):
    runs = {}
    for cast in ("peft", "auto"):
        trainer = bf16_trainer(tmp_path / cast, FoRAConfig(mode=mode, fisher_batches=2, input_cast=cast), max_steps=4)
        trainer.train()
        runs[cast] = trainer
    assert losses(runs["peft"]) == losses(runs["auto"]) and len(losses(runs["auto"])) == 4
    # The last training forward ran under autocast: with "auto" every LoRA layer skipped PEFT's cast in it.
    for cast, expected in (("peft", True), ("auto", False)):
        layers = [m for m in runs[cast].model.modules() if isinstance(m, LoraLinear)]
        assert len(layers) == 5 * (LAYERS // 2 if mode == "fora" else LAYERS)
        assert {m.cast_input_dtype_enabled for m in layers} == {expected}


@pytest.fixture(scope="module")
def bf16_adapters(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bf16")
    trainer = bf16_trainer(tmp_path, FoRAConfig(fisher_batches=2, lr_stiefel=5e-2, adapter_dtype="bfloat16"))
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    return tmp_path, trainer


def test_bf16_adapters_keep_fp32_masters_and_moments_for_every_adapter_weight(bf16_adapters):
    _, trainer = bf16_adapters
    optimizer = trainer.optimizer
    lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(lora) == 2 * 5 * LAYERS // 2 and {p.dtype for p in lora.values()} == {torch.bfloat16}
    for name, p in lora.items():
        state = optimizer.state[p]
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32, name
        assert state["exp_avg"].shape == p.shape  # lora_A: AdamW's moments; lora_B: Cayley-Adam's first moment
        assert torch.equal(p, state["master"].to(torch.bfloat16)), name
    groups = {(bool(g.get("master_weights")), g["stiefel"]): len(g["params"]) for g in optimizer.param_groups}
    assert groups == {(True, False): 10, (False, True): 10}
    assert max(e["fora/max_orthogonality_error"] for e in trainer.state.log_history if "loss" in e) < 1e-5


def test_bf16_adapters_save_a_plain_peft_adapter_that_reloads(bf16_adapters):
    tmp_path, trainer = bf16_adapters
    reloaded = PeftModel.from_pretrained(tiny_llama(LAYERS, vocab_size=VOCAB).to(torch.bfloat16), tmp_path / "adapter")
    trained = dict(trainer.model.named_parameters())
    loaded = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert loaded.keys() == {n for n, p in trained.items() if p.requires_grad}
    assert all(torch.equal(p.to(torch.bfloat16), trained[n]) for n, p in loaded.items())  # the masters rounded
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = type(trainer.model).forward(trainer.model.eval(), input_ids=ids).logits
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


def test_bf16_adapters_train_within_the_noise_of_fp32_adapters(tmp_path):
    # The forward under bf16 autocast is the same; the runs part by one bf16 rounding of the initial lora_B (its
    # master is the rounded B projected back onto the manifold) and by clipping bf16 gradients. The noise: another
    # seed of the Stiefel init, the same data.
    runs = {}
    for name, dtype, seed in (("fp32", "auto", 0), ("bf16", "bfloat16", 0), ("fp32 seed 1", "auto", 1)):
        fora = FoRAConfig(fisher_batches=2, lr_stiefel=5e-2, adapter_dtype=dtype, seed=seed, layers=[1, 2])
        trainer = bf16_trainer(tmp_path / name, fora, max_steps=10)
        trainer.train()
        runs[name] = losses(trainer)
    difference = max(abs(a - b) for a, b in zip(runs["fp32"], runs["bf16"]))
    noise = max(abs(a - b) for a, b in zip(runs["fp32"], runs["fp32 seed 1"]))
    assert 0 < difference < noise / 4, (difference, noise)


def test_bf16_adapters_need_foras_optimizer():
    with pytest.raises(ValueError, match=r"adapter_dtype='bfloat16' contradicts mode='lora'"):
        FoRAConfig(mode="lora", adapter_dtype="bfloat16")


def test_liger_is_refused_before_the_model_loads_when_it_cannot_run(tmp_path):
    # No GPU here (nor liger-kernel, but in Axolotl's environment): the refusal comes before SFTTrainer would load
    # the model by its name.
    args = sft_args(tmp_path, use_liger_kernel=True)
    for mode in ("fora", "lora"):
        with pytest.raises(FoRAInputError, match=r"use_liger_kernel=True cannot run here: "):
            FoRASFTTrainer(
                str(tmp_path / "no-model-here"),
                args,
                train_dataset=sums_dataset(),
                peft_config=lora_config(),
                fora_config=FoRAConfig(mode=mode),
            )


def test_fora_train_refuses_liger_in_one_line(tmp_path, capsys):
    import yaml

    model = tmp_path / "model"
    tiny_llama(LAYERS, vocab_size=VOCAB).save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "Q: {i}+1=", "completion": " {i + 1}"}}\n' for i in range(8)))
    config = tmp_path / "config.yaml"
    keys = {"model_name_or_path": str(model), "dataset_name": str(data), "output_dir": str(tmp_path / "out")}
    config.write_text(yaml.safe_dump({**keys, "lora_target_modules": ["q_proj"], "report_to": "none"}))
    assert main(["train", str(config), "--use_liger_kernel", "true", "--use_cpu", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fora train: error: use_liger_kernel=True cannot run here") and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_compile_trains_without_a_recompile_or_graph_break_from_fora(tmp_path, reentrant):
    # Dynamo's counters name every graph break and every guard that failed (a recompile). aot_eager traces what
    # inductor would (dynamo and AOT autograd) without generating C++: the same breaks and recompiles, in seconds.
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    trainer = bf16_trainer(
        tmp_path,
        FoRAConfig(fisher_batches=2, adapter_dtype="bfloat16", layers=[1, 3]),
        max_steps=4,
        torch_compile=True,
        torch_compile_backend="aot_eager",
        pad_to_multiple_of=32,  # one batch shape: no recompile for a new length
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )
    trainer.train()
    assert len(losses(trainer)) == 4 and type(trainer.model_wrapped).__name__ == "OptimizedModule"
    breaks = dict(counters["graph_break"])
    recompiles = [f"{code.co_filename}: {reason}" for code, reasons in guard_failures.items() for reason in reasons]
    fora_names = ("fora_plugin", "_InputCastUnderAutocast", "_pre_hook", "BackwardStop", "cast_input_dtype")
    for text in [*breaks, *recompiles]:
        assert not any(name in text for name in fora_names), text
    # TRL's fused LM head calls mm with an out= tensor dynamo does not trace: its graph break, and no other.
    assert breaks and all("non-contiguous `out=`" in text for text in breaks), breaks
    # One batch shape, one graph per compiled frame: nothing recompiles (under reentrant checkpointing too, where
    # the backward stop makes the hidden state entering the lowest adapted layer require grad).
    assert recompiles == []
    assert all(not m.cast_input_dtype_enabled for m in trainer.model.modules() if isinstance(m, LoraLinear))
