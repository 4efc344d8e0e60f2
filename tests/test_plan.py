"""`fora plan`: simulated memory and FLOPs against independent counts, and its refusals of bad input."""

import json

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, T5Config

from fora_plugin.cli import main
from fora_plugin.memory import LiveTensorTracker
from fora_plugin.plan import (
    BUNDLED_MODEL_CONFIGS,
    MODEL_CONFIGS,
    FourBit,
    kinds_of,
    plan_setup,
    run_plan,
)


TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV_HEADS, HEADS = 64, 128, 4, 96, 2, 4


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        pad_token_id=0,
    )


def write_config(tmp_path, **keys) -> str:
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        tiny_config().save_pretrained(model_dir)
    values = {
        "model_name_or_path": str(model_dir),
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 2,
        "max_length": 32,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_modules": TARGETS,
        "fora_layer_budget": 0.5,
        "report_to": "none",
        **keys,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_bundled_model_configs_exist():
    for folder in set(BUNDLED_MODEL_CONFIGS.values()):
        assert (MODEL_CONFIGS / folder / "config.json").is_file()


def test_weights_and_trainable_parameters_match_an_independent_count(tmp_path):
    config = write_config(tmp_path, dtype="bfloat16")
    setup = plan_setup(config, [])
    result = run_plan(setup)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16)  # fp32 rotary buffers
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    # LoRA r (d_in + d_out) per target linear: q (64->64), k and v (64->32), up (64->128), down (128->64).
    head_dim = HIDDEN // HEADS
    shapes = [(HIDDEN, HIDDEN), (HIDDEN, KV_HEADS * head_dim), (HIDDEN, KV_HEADS * head_dim)]
    shapes += [(HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    per_layer = sum(4 * (d_in + d_out) for d_in, d_out in shapes)
    for mode, layers in (("fora", LAYERS // 2), ("fg-lora", LAYERS // 2), ("lora", LAYERS)):
        step = result["phases"][mode]["step"]
        assert kinds_of(step)["weights"] == weight_bytes
        assert step.trainable == per_layer * layers
    # fora and fg-lora adapt K = L/2 layers: half the LoRA parameters of lora.
    lora_parts = {m: result["phases"][m]["step"].peak["lora_params"] for m in ("fora", "lora")}
    assert lora_parts["lora"] == 2 * lora_parts["fora"] == 2 * 4 * per_layer * (LAYERS // 2)  # fp32 adapters


def test_four_bit_weights_take_their_packed_size(tmp_path):
    config = write_config(tmp_path, dtype="bfloat16", load_in_4bit=True, use_bnb_nested_quant=True)
    setup = plan_setup(config, [])
    step = run_plan(setup, modes=("lora",))["phases"]["lora"]["step"]
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16)  # fp32 rotary buffers
    spec = FourBit(nested=True)
    expected = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
            expected += spec.packed_bytes(module.weight.numel())
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - {
        id(model.lm_head.weight)
    }
    expected += sum(p.numel() * 2 for p in model.parameters() if id(p) not in linear_weights)
    expected += sum(b.numel() * b.element_size() for b in model.buffers())
    assert kinds_of(step)["weights"] == expected
    # NF4: about half a byte per weight (the absmax constants add a little).
    assert spec.packed_bytes(4096 * 4096) / (4096 * 4096) == pytest.approx(0.5 + 1 / 64, abs=2e-3)


def _real_step_peak(checkpointing: bool) -> tuple[int, int]:
    """A real CPU LoRA step of the tiny Llama (fp32), measured by the same storage tracker: peak bytes and FLOPs."""
    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM(tiny_config()), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    )
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    tracker = LiveTensorTracker()
    seen = set()
    for p in [*model.parameters(), *model.buffers()]:
        if id(p) not in seen:
            seen.add(id(p))
            tracker.register(p)
    ids = torch.randint(3, VOCAB, (2, 32))
    # Two steps: the second holds the optimizer states through forward and backward (the steady state).
    for _ in range(2):
        with tracker:
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as flops:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
    return tracker.peak, flops.get_total_flops()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_simulated_step_matches_a_real_run(tmp_path, checkpointing):
    config = write_config(tmp_path, dtype="float32", activation_checkpointing=checkpointing)
    step = run_plan(plan_setup(config, []), modes=("lora",))["phases"]["lora"]["step"]
    real_peak, real_flops = _real_step_peak(checkpointing)
    assert step.total == pytest.approx(real_peak, rel=0.05)
    # The optimizer's few elementwise FLOPs are not in FlopCounterMode's formulas: forward + backward only.
    assert step.flops == pytest.approx(real_flops, rel=0.01)


def test_plan_command_writes_json_and_png_and_names_the_fix(tmp_path, capsys):
    config = write_config(tmp_path, dtype="float32", max_length=128, activation_checkpointing=False)
    out = tmp_path / "planned"
    assert (
        main(["plan", config, "--gpu-memory", "0.0001", "--output", str(out), "--per_device_train_batch_size", "16"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "| fora | scoring |" in printed and "| lora | step |" in printed
    assert "does not fit" in printed and "activation_checkpointing: true" in printed
    payload = json.loads((out / "plan.json").read_text())
    assert payload["batch_size"] == 16  # the override applied
    assert set(payload["phases"]) == {"fora", "fg-lora", "lora"}
    assert (out / "plan.png").stat().st_size > 0


def test_sharded_engines_divide_what_they_shard(tmp_path):
    config = write_config(tmp_path, dtype="bfloat16")
    single = run_plan(plan_setup(config, []), modes=("lora",))["phases"]["lora"]["step"]
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    setup = plan_setup(config, ["--deepspeed", str(zero3)], gpus=4)
    result = run_plan(setup, modes=("lora",))
    sharded = result["phases"]["lora"]["step"]
    assert sharded.peak["weights"] == -(-single.peak["weights"] // 4)
    assert sharded.peak["activations"] == single.peak["activations"]
    # FSDP/ZeRO-3 gather two decoder layers and the head while computing: counted as transient, in bf16 here.
    kv = KV_HEADS * HIDDEN // HEADS
    layer = 2 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN)
    assert sharded.peak["transient"] == single.peak["transient"] + 2 * layer + 2 * VOCAB * HIDDEN
    assert any("divided by 4" in note for note in result["notes"])


def _bad(argv, capsys, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert match in err


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    config = write_config(tmp_path)
    _bad(["plan", config, "--gpus", "0"], capsys, "--gpus 0")
    _bad(["plan", config, "--gpus", "two"], capsys, "--gpus two")
    _bad(["plan", config, "--gpu-memory", "lots"], capsys, "--gpu-memory lots")
    empty = tmp_path / "empty"
    empty.mkdir()
    _bad(["plan", config, "--model_name_or_path", str(empty)], capsys, "without config.json")
    _bad(["plan", config, "--model_name_or_path", "nobody/unknown-model"], capsys, "has no config.json")
    seq2seq = tmp_path / "t5"
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(seq2seq)
    _bad(["plan", config, "--model_name_or_path", str(seq2seq)], capsys, "not a causal LM")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    _bad(["plan", config, "--deepspeed", str(ds)], capsys, "zero_optimization.stage=0")
    fsdp = write_config(tmp_path, fsdp="full_shard", fsdp_config={"version": 1})
    _bad(["plan", fsdp, "--gpus", "8"], capsys, "FSDP1")
