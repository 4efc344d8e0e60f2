"""`fora plan`: simulated memory and FLOPs against independent counts, and its refusals of bad input."""

import dataclasses
import json

import pytest
import torch
import yaml
from conftest import tiny_llama_config
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, T5Config


try:
    from trl.trainer.sft_trainer import add_fused_lm_head  # TRL >= 1.16: SFTTrainer's loss never builds the logits
except ImportError:
    add_fused_lm_head = None

from fora_plugin import cli as cli_module
from fora_plugin import plan as plan_module
from fora_plugin.cli import main
from fora_plugin.errors import FoRAInputError
from fora_plugin.plan import (
    BUNDLED_MODEL_CONFIGS,
    MODEL_CONFIGS,
    FourBit,
    Phase,
    kinds_of,
    plan_setup,
    planned_layers,
    run_plan,
    truncated_config,
)
from fora_plugin.plan import depth as depth_module
from fora_plugin.plan import measure as measure_module
from fora_plugin.plan.memory import LiveTensorTracker, flop_formulas
from fora_plugin.wiring import set_input_cast


TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV_HEADS, HEADS = 64, 128, 4, 96, 2, 4


def tiny_config(num_layers: int = LAYERS) -> LlamaConfig:
    return tiny_llama_config(num_layers, VOCAB, HIDDEN, INTERMEDIATE)


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
    lora_parts = {m: result["phases"][m]["step"].peak["lora_params"] for m in ("fora", "fg-lora", "lora")}
    assert lora_parts["lora"] == 2 * lora_parts["fg-lora"] == 2 * 4 * per_layer * (LAYERS // 2)  # fp32 adapters
    # Every lora_B owns its storage (Cayley-Adam steps copies of [B, m] in scratch buffers): fora's LoRA parameters
    # are fg-lora's.
    assert lora_parts["fora"] == lora_parts["fg-lora"]


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


def _sft_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The loss as SFTTrainer forms it: under bf16 autocast (SFTConfig's default bf16=True) and through TRL's fused
    LM head where the installed TRL has one."""
    fused = {} if add_fused_lm_head is None else {"fused_lm_head": True}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, **fused).loss


def _real_step_peak(checkpointing: bool) -> tuple[int, int]:
    """A real CPU LoRA step of the tiny Llama (fp32), measured by the same storage tracker: peak bytes and FLOPs."""
    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM(tiny_config()), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    )
    if add_fused_lm_head is not None:  # as SFTTrainer.__init__ does
        add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    set_input_cast(model, "auto")  # as FoRASFTTrainer sets it (fora_input_cast's default)
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
            loss = _sft_loss(model, ids)
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    flops = FlopCounterMode(display=False)
    flops.flop_registry = flop_formulas()  # + the CPU attention kernel's FLOPs (tests/test_memory.py checks them)
    with flops:
        loss = _sft_loss(model, ids)
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


def test_the_plans_attention_runs_as_the_runs_on_a_batch_with_every_token_kept(tmp_path, monkeypatch):
    """transformers drops the all-ones mask of a batch with every token kept, and SDPA runs a grouped-query model's
    key/value heads as they are. On fake tensors it cannot read the position ids and would build a mask, and repeat
    k and v to every query head (3-5% of LLaMA-3.2-3B's step, against an H100). The plan runs the run's path, and its
    note gives what a padded batch adds: k and v of the extra heads, per layer."""
    from transformers.integrations import sdpa_attention

    seen = []
    own = sdpa_attention.use_gqa_in_sdpa

    def recorded(attention_mask, key, value):
        seen.append((attention_mask is None, key.shape[1]))
        return own(attention_mask, key, value)

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", recorded)
    setup = plan_setup(write_config(tmp_path, dtype="float32", activation_checkpointing=False), [])
    run_plan(setup, modes=("lora",))
    config = tiny_config()
    assert seen and set(seen) == {(True, config.num_key_value_heads)}
    head_dim = config.hidden_size // config.num_attention_heads
    extra = 2 * 2 * 32 * (config.num_attention_heads - config.num_key_value_heads) * head_dim * 4  # fp32
    (note,) = [n for n in setup.notes if n.startswith("attention:")]
    assert f"+{extra / 2**20:.0f} MiB for each layer" in note
    # A model whose every query head has its own key/value head gets no note.
    mha = tmp_path / "mha"
    mha.mkdir()
    # Packed sequences keep the mask that sets them apart: the plan builds it, and SDPA repeats k and v, as in the run.
    seen.clear()
    packed = plan_setup(write_config(tmp_path, dtype="float32", activation_checkpointing=False, packing=True), [])
    run_plan(packed, modes=("lora",))
    assert seen and set(seen) == {(False, config.num_key_value_heads)}
    assert (
        run_plan(packed, modes=("lora",))["phases"]["lora"]["step"].total
        > run_plan(setup, modes=("lora",))["phases"]["lora"]["step"].total
    )
    (note,) = [n for n in packed.notes if n.startswith("attention:")]
    assert note.startswith("attention: planned for packed sequences") and f"({extra / 2**20:.0f} MiB a layer" in note
    mha_config = LlamaConfig(**{**config.to_dict(), "num_key_value_heads": config.num_attention_heads})
    mha_config.save_pretrained(mha / "model")
    assert not [n for n in plan_setup(write_config(mha), []).notes if n.startswith("attention:")]


def _saved_by_a_forward(cast: str, layers: list[int] | None) -> int:
    """Bytes a real bf16 forward (SFTTrainer's loss, bf16 autocast) leaves alive for its backward, LoRA on ``layers``
    with PEFT's input cast as ``cast`` sets it."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, layers_to_transform=layers)
    model = get_peft_model(LlamaForCausalLM(tiny_config()).to(torch.bfloat16), config)
    if add_fused_lm_head is not None:
        add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    set_input_cast(model, cast)
    model.train()
    tracker = LiveTensorTracker()
    for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        tracker.register(t)
    with tracker:
        loss = _sft_loss(model, torch.randint(3, VOCAB, (2, 32)))
        saved = sum(tracker.live().values())
    del loss
    return saved


def test_the_plan_counts_the_smaller_peak_without_peft_input_cast(tmp_path):
    # bf16 weights, fp32 adapters, bf16 autocast, no checkpointing: PEFT's cast gives each LoRA layer its own copy of
    # its input to keep for the backward (q, k and v share one input without it).
    config = write_config(tmp_path, dtype="bfloat16", activation_checkpointing=False, fora_layers=[1, 3])
    plans = {cast: run_plan(plan_setup(config, ["--fora_input_cast", cast]))["phases"] for cast in ("peft", "auto")}
    for mode, layers in (("fora", [1, 3]), ("fg-lora", [1, 3]), ("lora", None)):
        peft, auto = plans["peft"][mode]["step"], plans["auto"][mode]["step"]
        real = _saved_by_a_forward("peft", layers) - _saved_by_a_forward("auto", layers)
        assert real > 0
        assert kinds_of(peft)["activations"] - kinds_of(auto)["activations"] == real, mode
        assert peft.total - auto.total == real, mode


def test_bf16_adapters_are_planned_with_their_fp32_masters(tmp_path):
    config = write_config(tmp_path, dtype="bfloat16", activation_checkpointing=False, fora_layers=[1, 3])
    for adapter_dtype, param_bytes, state_bytes in (("auto", 4, 8), ("bfloat16", 2, 12)):
        phases = run_plan(plan_setup(config, ["--fora_adapter_dtype", adapter_dtype]), modes=("fg-lora",))["phases"]
        step = phases["fg-lora"]["step"]
        matrices = 2 * 2 * len(TARGETS)  # lora_A and lora_B of 5 targets on 2 layers
        assert step.peak["lora_params"] == param_bytes * step.trainable
        # AdamW's two moments, plus an fp32 master for a bf16 weight, and a step count per matrix (fp32).
        assert step.peak["optimizer_states"] == state_bytes * step.trainable + 4 * matrices


def test_deepspeed_bf16_is_planned_with_bf16_lora_and_fp32_masters(tmp_path):
    """DeepSpeed's bf16 mode casts every parameter to bf16, LoRA's included (an fp32 base too); its ZeRO-2 optimizer
    keeps fp32 partitions (the masters) and fp32 moments, divided by the GPUs, and FoRA's Cayley-Adam an fp32 master of
    each Stiefel lora_B, whole on every GPU. "auto" follows the Trainer's bf16; without it the LoRA stays fp32."""
    config = write_config(tmp_path, dtype="float32", activation_checkpointing=False, fora_layers=[1, 3])
    ds = tmp_path / "zero2.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    setup = plan_setup(config, ["--deepspeed", str(ds), "--bf16", "true"], gpus=2)
    assert setup.lora_dtype == setup.dtype == torch.bfloat16
    assert any(n.startswith("precision: DeepSpeed's bfloat16 mode casts every float parameter") for n in setup.notes)
    phases = run_plan(setup, modes=("fora", "fg-lora", "lora"))["phases"]
    lora_b = (HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS + INTERMEDIATE + HIDDEN) * 4  # per layer, r 4
    lora_a = (3 * HIDDEN + INTERMEDIATE + HIDDEN) * 4  # q, k, v, down, up's d_in
    for mode, layers, stiefel_b in (("fora", 2, True), ("fg-lora", 2, False), ("lora", LAYERS, False)):
        step = phases[mode]["step"]
        euclidean = layers * (lora_a + (0 if stiefel_b else lora_b))
        matrices = layers * len(TARGETS) * (1 if stiefel_b else 2)
        assert step.trainable == layers * (lora_a + lora_b)
        assert step.peak["lora_params"] == 2 * step.trainable, mode  # bf16, whole on every GPU under ZeRO-2
        # fp32 master and two fp32 moments per element, a step count per matrix: divided by the 2 GPUs.
        assert step.peak["optimizer_states"] == -(-(12 * euclidean + 4 * matrices) // 2), mode
    # Cayley-Adam's fp32 master is whole on every GPU: 4 bytes per lora_B element more than with fp32 lora_B.
    plain = tmp_path / "fp32.json"
    plain.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}))
    fp32 = plan_setup(config, ["--deepspeed", str(plain), "--bf16", "true"], gpus=2)
    assert fp32.lora_dtype is None and fp32.dtype == torch.float32
    assert not any(n.startswith("precision:") for n in fp32.notes)
    fp32_step = run_plan(fp32, modes=("fora",))["phases"]["fora"]["step"]
    assert fp32_step.peak["lora_params"] == 4 * fp32_step.trainable
    stiefel = phases["fora"]["step"].peak["stiefel"] - fp32_step.peak["stiefel"]
    assert stiefel == 4 * 2 * lora_b  # the fp32 masters (the peak is the forward's: no lora_B gradient alive)
    assert plan_setup(config, ["--deepspeed", str(ds), "--bf16", "false"], gpus=2).lora_dtype is None  # "auto"
    # ZeRO-3 partitions each Stiefel lora_B too: DeepSpeed's fp32 partition of it, beside Cayley-Adam's whole master.
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    setup = plan_setup(config, ["--deepspeed", str(zero3), "--bf16", "true"], gpus=2)
    step = run_plan(setup, modes=("fora",))["phases"]["fora"]["step"]
    assert step.peak["lora_params"] == -(-2 * step.trainable // 2)
    assert step.peak["optimizer_states"] == -(-(12 * 2 * lora_a + 4 * 2 * len(TARGETS) + 4 * 2 * lora_b) // 2)
    assert step.peak["stiefel"] == phases["fora"]["step"].peak["stiefel"]  # whole on every GPU, as under ZeRO-2


def test_a_captured_step_is_planned_with_its_static_gradients_and_graph_pool(tmp_path):
    """cuda_graph keeps, from the capture on, a static copy of each Stiefel lora_B gradient and the graph's pool,
    which holds at least the staged step's stacked copies of B and G. Planned before, it raised a traceback (the
    fake parameters are on the CPU, where a capture is refused)."""
    config = write_config(tmp_path, dtype="float32")
    eager_setup = plan_setup(config, ["--fora_cuda_graph", "false"])
    assert not any(n.startswith("cuda_graph:") for n in eager_setup.notes)
    eager = run_plan(eager_setup, modes=("fora", "fg-lora"))["phases"]
    setup = plan_setup(config, ["--fora_cuda_graph", "true"])
    assert any(n.startswith("cuda_graph: the captured Cayley-Adam step keeps") for n in setup.notes)
    captured = run_plan(setup, modes=("fora", "fg-lora"))["phases"]
    # Unset, a plan for one GPU plans the captured step (CayleyAdam's default there); one to check against a CPU run
    # plans the eager step, as that run takes.
    default = plan_setup(config, [])
    assert default.captures_cayley_step and any(n.startswith("cuda_graph: the captured") for n in default.notes)
    assert run_plan(default, modes=("fora",))["phases"]["fora"]["step"] == captured["fora"]["step"]
    assert not dataclasses.replace(default, loss_head_device="cpu").captures_cayley_step
    # Under a data-parallel engine the trainer leaves an unset cuda_graph eager, and so does the plan; true captures.
    for engine in ("ddp", "zero1", "zero2", "zero3", "fsdp2"):
        assert not dataclasses.replace(default, engine=engine).captures_cayley_step, engine
        assert dataclasses.replace(setup, engine=engine).captures_cayley_step, engine
    lora_b = (HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS + INTERMEDIATE + HIDDEN) * (LAYERS // 2) * 4 * 4  # d_out, r 4
    added = captured["fora"]["step"].peak["stiefel"] - eager["fora"]["step"].peak["stiefel"]
    assert added >= lora_b + 2 * lora_b  # the static gradients, and a pool of at least B and G stacked
    assert captured["fora"]["step"].total - eager["fora"]["step"].total == added
    assert captured["fg-lora"]["step"] == eager["fg-lora"]["step"]  # AdamW on lora_B: nothing captured


def test_the_plan_says_it_does_not_model_liger_or_compile(tmp_path):
    config = write_config(tmp_path, use_liger_kernel=True, torch_compile=True)
    notes = plan_setup(config, []).notes
    assert any(n.startswith("use_liger_kernel: Liger's kernels are not modelled") for n in notes), notes
    assert any(n.startswith("torch_compile: not modelled: the plan runs the eager step") for n in notes), notes
    assert not any("Liger" in n or "torch_compile" in n for n in plan_setup(write_config(tmp_path), []).notes)
    axolotl = tmp_path / "axolotl.yaml"
    tiny = yaml.safe_load((tmp_path / "config.yaml").read_text())
    keys = {"base_model": tiny["model_name_or_path"], "sequence_len": 32, "micro_batch_size": 2, "lora_r": 4}
    axolotl.write_text(yaml.safe_dump({**keys, "lora_target_modules": TARGETS, "liger_rms_norm": True}))
    assert any(n.startswith("liger_rms_norm: Liger's kernels") for n in plan_setup(str(axolotl), []).notes)


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
    assert payload["depths_run"] == [LAYERS]  # 4 layers: fewer than 2 + 4 + 6, all run
    assert set(payload["phases"]) == {"fora", "fg-lora", "lora"}
    assert (out / "plan.png").stat().st_size > 0


def test_sharded_engines_divide_what_they_shard(tmp_path):
    config = write_config(tmp_path, dtype="bfloat16")
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    setup = plan_setup(config, ["--deepspeed", str(zero3)], gpus=4)
    # The same run on one GPU: with the LoRA weights in the dtype DeepSpeed's bf16 mode casts them to.
    single = dataclasses.replace(plan_setup(config, []), lora_dtype=setup.lora_dtype)
    single = run_plan(single, modes=("lora",))["phases"]["lora"]["step"]
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


# ------------------------------------------------------------------------------------------- depth extrapolation
def _counts(result) -> dict:
    return {
        (mode, name): (phase.peak, phase.flops, phase.trainable)
        for mode, entry in result["phases"].items()
        for name, phase in entry.items()
    }


@pytest.mark.parametrize(
    "keys, gpus",
    [
        ({"dtype": "float32", "activation_checkpointing": False}, 1),
        ({"dtype": "bfloat16", "bf16": True, "activation_checkpointing": True}, 1),
        ({"dtype": "bfloat16", "bf16": True, "load_in_4bit": True, "use_bnb_nested_quant": True}, 1),
        ({"dtype": "bfloat16", "bf16": True, "deepspeed": "zero3"}, 4),
    ],
    ids=["fp32", "bf16-checkpointing", "4bit", "zero3"],
)
def test_depth_extrapolation_gives_the_counts_of_running_every_layer(tmp_path, monkeypatch, keys, gpus):
    """10 layers, fora on every 2nd: run at depths 2, 4, 6 (or, where layer 0's first period differs in its transient
    peak, one period later: 4, 6, 8) and extrapolated to 10, against all 10 layers run."""
    monkeypatch.setattr(depth_module, "_saves_time", lambda depths, num_layers: True)
    model_dir = tmp_path / "model"
    tiny_config(10).save_pretrained(model_dir)
    if keys.get("deepspeed") == "zero3":
        zero3 = tmp_path / "zero3.json"
        zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
        keys = {**keys, "deepspeed": str(zero3)}
    setup = plan_setup(write_config(tmp_path, **keys), [], gpus=gpus)
    extrapolated = run_plan(setup)
    assert extrapolated["depths"] in ([2, 4, 6], [4, 6, 8])
    assert any("repeat every 2" in note for note in extrapolated["notes"])
    full = run_plan(setup, full_depth=True)
    assert full["depths"] == [10]
    assert _counts(extrapolated) == _counts(full)


def test_a_stack_that_does_not_repeat_runs_every_layer(tmp_path):
    # LoRA on the top half: layers 0-7 and 8-15 differ, no period shorter than the stack.
    model_dir = tmp_path / "model"
    tiny_config(16).save_pretrained(model_dir)
    setup = plan_setup(write_config(tmp_path, fora_layers=list(range(8, 16))), [])
    base = plan_module.meta_model_of(setup)
    assert plan_module.extrapolation_depths(base, plan_module.planned_layers(setup, 16)) is None
    # Every 2nd layer repeats with period 2; 2 + 4 + 6 = 12 layers run instead of 16.
    setup = plan_setup(write_config(tmp_path, fora_layers=list(range(0, 16, 2))), [])
    assert plan_module.extrapolation_depths(base, plan_module.planned_layers(setup, 16)) == (2, 4, 6)


def test_gemma3_layer_pattern_sets_the_period_and_truncation_keeps_it(monkeypatch):
    """Gemma-3's 5 sliding + 1 full attention layers repeat every 6: its layer_types are cut with the stack."""
    setup_config = AutoConfig.from_pretrained(MODEL_CONFIGS / "gemma-3-270m")
    short = truncated_config(setup_config, 6)
    assert short.num_hidden_layers == 6 and short.layer_types == setup_config.layer_types[:6]
    assert setup_config.num_hidden_layers == 18  # the original is untouched
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(setup_config)
    signatures = depth_module._layer_signatures(model, planned=list(range(0, 18, 2)))
    assert signatures[:6] == signatures[6:12] == signatures[12:]
    # (sliding, adapted), (sliding, not) and the 6th layer's full attention (not adapted).
    assert len(set(signatures[:6])) == 3 and signatures[5] != signatures[3]
    planned = list(range(0, 18, 2))
    assert plan_module.extrapolation_depths(model, planned) is None  # 6 + 12 + 18 layers: slower than 18
    monkeypatch.setattr(depth_module, "_saves_time", lambda depths, num_layers: True)
    assert plan_module.extrapolation_depths(model, planned) == (6, 12, 18)


def test_counts_off_a_line_are_named_and_the_plan_runs_every_layer(tmp_path, monkeypatch):
    a, b = plan_module.Phase({"activations": 10}, 100, 5), plan_module.Phase({"activations": 20}, 200, 10)
    on_line = depth_module._extrapolate(
        [{"k": [a]}, {"k": [b]}, {"k": [plan_module.Phase({"activations": 30}, 300, 15)]}], (2, 4, 6), 32
    )
    assert on_line["k"][0] == plan_module.Phase({"activations": 160}, 1600, 80)
    off = depth_module._extrapolate(
        [{"k": [a]}, {"k": [b]}, {"k": [plan_module.Phase({"activations": 31}, 300, 15)]}], (2, 4, 6), 32
    )
    assert off == "k: activations bytes at (2, 4, 6) layers is [10, 20, 31], not on a line"
    falling = [{"k": [plan_module.Phase({"activations": b}, 100, 5)]} for b in (30, 20, 10)]
    assert "falls below 0 at 32" in depth_module._extrapolate(falling, (2, 4, 6), 32)

    monkeypatch.setattr(depth_module, "_saves_time", lambda depths, num_layers: True)
    monkeypatch.setattr(depth_module, "_extrapolate", lambda runs, depths, num_layers: "scoring: FLOPs off")
    tiny_config(6).save_pretrained(tmp_path / "model")
    result = run_plan(plan_setup(write_config(tmp_path), []), modes=("lora",))
    assert result["depths"] == [6]
    assert any("did not hold (scoring: FLOPs off): ran all 6 layers" in note for note in result["notes"])


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_keeps_the_stiefel_part_whole_on_every_gpu(tmp_path, stage):
    """ZeRO partitions AdamW's states and gradients; FoRA's Stiefel lora_B and their Cayley-Adam state stay whole
    on every rank (zero.py: beside the partition under ZeRO-1/2, gathered under ZeRO-3), so the plan divides the
    one and not the other."""
    config = write_config(tmp_path, dtype="float32")
    eager = ["--fora_cuda_graph", "false"]  # as under DeepSpeed, where the step is not captured unless asked
    single = run_plan(plan_setup(config, eager), modes=("fora", "fg-lora"))["phases"]
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    result = run_plan(plan_setup(config, ["--deepspeed", str(zero)], gpus=4), modes=("fora", "fg-lora"))
    fora, one = result["phases"]["fora"]["step"].peak, single["fora"]["step"].peak
    # Per Stiefel lora_B (d_out x r 4, fp32): Cayley-Adam's first moment, whole on every rank, at least.
    d_out = (HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS + INTERMEDIATE + HIDDEN) * (LAYERS // 2)
    # Zero3FoRAOptimizer steps each lora_B on a whole fp32 copy of its own (gathered from DeepSpeed's partition).
    assert fora["stiefel"] == one["stiefel"] + (4 * d_out * 4 if stage == 3 else 0) >= d_out * 4 * 4
    # lora_A's AdamW states; under ZeRO-1/2 also DeepSpeed's fp32 partition of lora_A, a copy even of fp32 weights
    # (ZeRO-3 steps an fp32 partition in place).
    partitions = 4 * (4 * HIDDEN + INTERMEDIATE) * 4 * (LAYERS // 2) if stage != 3 else 0  # d_in x r 4, fp32
    assert fora["optimizer_states"] == -(-(one["optimizer_states"] + partitions) // 4)
    assert "stiefel" not in result["phases"]["fg-lora"]["step"].peak  # AdamW on lora_B: all partitioned
    if stage == 3:
        return
    # fg-lora shares fora's forward and backward, not its optimizer: planned beside fora or alone, the same step;
    # and fora's step does not depend on the order of the modes.
    alone = run_plan(plan_setup(config, eager), modes=("fg-lora",))["phases"]["fg-lora"]["step"]
    assert single["fg-lora"]["step"] == alone != single["fora"]["step"]
    reversed_order = run_plan(plan_setup(config, eager), modes=("fg-lora", "fora"))["phases"]
    assert reversed_order["fora"]["step"] == single["fora"]["step"]
    assert reversed_order["fg-lora"]["step"] == alone
    assert any("Stiefel lora_B gradients and Cayley-Adam states are whole" in note for note in result["notes"])


def test_zero2_reduce_buffers_live_in_the_backward_only(tmp_path):
    """DeepSpeed ZeRO-1/2 allocate their gradient reduction buffers (reduce_bucket_size elements, twice with
    overlap_comm, in the dtype the engine reduces in) at each backward's first gradient hook and free them at its
    end: the backward candidate grows by exactly their bytes, the forward and optimizer-step candidates not at all.
    HF fills reduce_bucket_size "auto" with hidden_size**2; tests/test_zero.py checks the bytes against a real
    engine."""
    config = write_config(tmp_path, dtype="bfloat16", bf16=True)
    zero = tmp_path / "zero.json"
    block = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"}
    zero.write_text(json.dumps({"zero_optimization": block, "bf16": {"enabled": "auto"}}))
    setup = plan_setup(config, ["--deepspeed", str(zero)], gpus=4)
    assert (setup.reduce_buffers.count, setup.reduce_buffers.elements) == (2, HIDDEN * HIDDEN)
    assert setup.reduce_buffers.nbytes == 2 * HIDDEN * HIDDEN * 2  # bf16
    modes = ("fora", "lora")
    planned = planned_layers(setup, LAYERS)
    with_buffers = measure_module.measure(setup, modes, planned, scoring=False)
    without = measure_module.measure(dataclasses.replace(setup, reduce_buffers=None), modes, planned, scoring=False)
    for mode in modes:
        (forward, backward, step), (forward0, backward0, step0) = with_buffers[mode], without[mode]
        assert forward == forward0 and step == step0
        assert backward.peak["transient"] - backward0.peak.get("transient", 0) == setup.reduce_buffers.nbytes
        assert {k: v for k, v in backward.peak.items() if k != "transient"} == {
            k: v for k, v in backward0.peak.items() if k != "transient"
        }
    result = run_plan(setup, modes=("lora",))
    assert any(f"2 x {HIDDEN * HIDDEN:,} bfloat16 elements" in note for note in result["notes"])
    # Without contiguous_gradients DeepSpeed allocates none (stage 2's default overlap_comm is false: one buffer).
    zero.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "large"}}))
    with pytest.raises(FoRAInputError, match=r"zero_optimization.reduce_bucket_size='large', which DeepSpeed refuses"):
        plan_setup(config, ["--deepspeed", str(zero)], gpus=4)
    zero.write_text(json.dumps({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}))
    assert plan_setup(config, ["--deepspeed", str(zero)], gpus=4).reduce_buffers is None
    zero.write_text(
        json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}, "bf16": {"enabled": False}})
    )
    one = plan_setup(config, ["--deepspeed", str(zero)], gpus=4).reduce_buffers
    assert (one.count, one.elements, one.dtype) == (1, 1000, torch.float32)


def test_fsdp2_adds_the_unsharded_root_to_two_gathered_layers(tmp_path):
    """FSDP2's root (embeddings, final norm, head) stays gathered from forward to backward: bench/
    plan_fsdp2_simulation.py measured it under fully_shard on a fake process group (the plan had missed the
    embeddings: 7% under at 8B)."""
    config = write_config(tmp_path, dtype="bfloat16")
    single = run_plan(plan_setup(config, []), modes=("lora",))["phases"]["lora"]["step"]
    fsdp = ["--fsdp", "full_shard", "--fsdp_config", json.dumps({"version": 2})]
    result = run_plan(plan_setup(config, fsdp, gpus=4), modes=("lora",))
    sharded = result["phases"]["lora"]["step"]
    kv = KV_HEADS * HIDDEN // HEADS
    layer = 2 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN)
    root = 2 * (VOCAB * HIDDEN + HIDDEN + VOCAB * HIDDEN)  # embeddings, final norm, head (untied), bf16
    assert sharded.peak["transient"] == single.peak["transient"] + 2 * layer + root
    assert sharded.peak["weights"] == -(-single.peak["weights"] // 4)
    assert any("the root (embeddings, norm, head)" in note for note in result["notes"])
    # FSDP2 on one GPU (one launched rank) is planned too, as FSDP2 (it was refused as a single process): nothing is
    # divided, and it still all-gathers into buffers of its own, one layer and the root beyond the unsharded model
    # (FSDPMemTracker on a fake process group of one rank; an H100 measured 2.82 GiB where 1.83 had been planned).
    # Scoring runs before fully_shard: no gathered copy.
    one_setup = plan_setup(config, fsdp, gpus=1)
    assert one_setup.engine == "fsdp2"
    one = run_plan(one_setup, modes=("fora",))
    eager = ["--fora_cuda_graph", "false"]  # as FSDP2's row-sharded step runs
    alone = run_plan(plan_setup(config, eager), modes=("fora",))["phases"]["fora"]
    step, unsharded = one["phases"]["fora"]["step"], alone["step"]
    assert step.peak == {**unsharded.peak, "transient": unsharded.peak["transient"] + layer + root}
    assert one["phases"]["fora"]["scoring"] == alone["scoring"]
    assert any("fsdp2 on 1 GPU: nothing divided" in note for note in one["notes"])
    # A ZeRO-3 rank alone gathers nothing (the H100: 1.96 GiB measured, 1.84 planned unsharded).
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    zero3_setup = plan_setup(config, ["--deepspeed", str(zero3)], gpus=1)
    assert zero3_setup.engine == "zero3"
    alone3 = run_plan(zero3_setup, modes=("fora",))
    assert alone3["phases"]["fora"]["step"].peak["transient"] == unsharded.peak["transient"]


def test_fsdp2_peaks_at_the_first_all_gather_when_the_rest_of_the_step_holds_less(tmp_path):
    """While fully_shard copies the root and the prefetched first layer out of their all-gather buffers, both copies
    are alive, before any activation (bench/plan_fsdp2_simulation.py: the peak under FSDPMemTracker with
    checkpointing). Hand-made counts: per GPU, the gathered moment is 100 (weights / 8) + 2 (states) + 2·(100 + 40)."""
    fsdp = ["--fsdp", "full_shard", "--fsdp_config", json.dumps({"version": 2})]
    setup = plan_setup(write_config(tmp_path, dtype="bfloat16"), fsdp, gpus=8)
    gathered = (40, 30, 100)  # a decoder layer, the head, the root
    counts = {"weights": 800, "lora_grads": 8, "optimizer_states": 16, "transient": 5}
    small, _ = plan_module.shard_phase(setup, Phase(peak={**counts, "activations": 10}, flops=0), False, gathered)
    assert small.peak == {"weights": 100, "optimizer_states": 2, "transient": 280}
    # With activations that outweigh it, the step's own moment stays: + two layers and the root as transient.
    large, _ = plan_module.shard_phase(setup, Phase(peak={**counts, "activations": 1000}, flops=0), False, gathered)
    expected = {"weights": 100, "lora_grads": 1, "optimizer_states": 2, "transient": 185, "activations": 1000}
    assert large.peak == expected


def test_full_depth_flag_reaches_the_plan(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_plan(config, overrides, **kwargs):
        seen.update(kwargs)
        return "planned", {"output_dir": str(tmp_path)}

    monkeypatch.setattr(cli_module, "plan", fake_plan)  # cli imports `plan` at its top
    config = write_config(tmp_path)
    assert main(["plan", config, "--full-depth"]) == 0 and seen["full_depth"] is True
    assert main(["plan", config]) == 0 and seen["full_depth"] is False


def test_lora_targets_reaching_some_layers_break_the_repeat(tmp_path, monkeypatch):
    """Full module names put LoRA on layers 0-3 of 8 only: the layers differ, and all of them run."""
    monkeypatch.setattr(depth_module, "_saves_time", lambda depths, num_layers: True)
    tiny_config(8).save_pretrained(tmp_path / "model")
    targets = [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    setup = plan_setup(write_config(tmp_path, lora_target_modules=targets), [])
    result = run_plan(setup, modes=("lora",))
    assert result["depths"] == [8]
    assert result["phases"]["lora"]["step"].trainable == 4 * 4 * (HIDDEN + HIDDEN)  # 4 q_proj, r 4


def test_bad_layers_and_modes_are_refused_before_planning(tmp_path, monkeypatch):
    monkeypatch.setattr(depth_module, "_saves_time", lambda depths, num_layers: True)
    tiny_config(8).save_pretrained(tmp_path / "model")
    # Layer 8 of 8 does not exist, though the depths run (2, 4, 6) never reach it.
    setup = plan_setup(write_config(tmp_path, fora_layers=[0, 2, 4, 6, 8]), [])
    with pytest.raises(ValueError, match=r"indices \[8\] outside 0..7"):
        run_plan(setup)
    with pytest.raises(ValueError, match=r"modes=\(\): plan one or more of"):
        run_plan(setup, modes=())
    with pytest.raises(ValueError, match=r"modes=\('qlora',\)"):
        run_plan(setup, modes=("qlora",))


# ---------------------------------------------------------------------- the backward stops at the lowest adapted layer
def _real_forward_backward_flops(layers: list[int], input_hook: bool) -> int:
    """FLOPs of a real forward + backward of the tiny Llama with LoRA on ``layers`` and (non-reentrant)
    checkpointing: with SFTTrainer's embeddings hook (the backward through every layer) or without it (plain
    autograd, which stops at the lowest adapted layer)."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, layers_to_transform=layers)
    model = get_peft_model(LlamaForCausalLM(tiny_config()), config)
    if add_fused_lm_head is not None:  # as SFTTrainer.__init__ does
        add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()
    if input_hook:
        model.enable_input_require_grads()
    model.train()
    ids = torch.randint(3, VOCAB, (2, 32))
    flops = FlopCounterMode(display=False)
    flops.flop_registry = flop_formulas()
    with flops:
        _sft_loss(model, ids).backward()
    return flops.get_total_flops()


def test_planned_step_with_checkpointing_stops_the_backward_at_the_lowest_adapted_layer(tmp_path):
    config = write_config(tmp_path, dtype="float32", activation_checkpointing=True, fora_layers=[2, 3])
    # fg-lora: AdamW, whose elementwise step FLOPs are not counted, so the step is forward + backward alone.
    result = run_plan(plan_setup(config, []), modes=("fg-lora", "lora"))
    stopped = _real_forward_backward_flops([2, 3], input_hook=False)
    through_all = _real_forward_backward_flops([2, 3], input_hook=True)
    assert through_all > 1.15 * stopped  # the two behaviours are told apart
    assert result["phases"]["fg-lora"]["step"].flops == pytest.approx(stopped, rel=0.01)
    # Plain LoRA keeps SFTTrainer's hook: its backward runs through every layer.
    assert result["phases"]["lora"]["step"].flops == pytest.approx(
        _real_forward_backward_flops(list(range(LAYERS)), input_hook=True), rel=0.01
    )
    assert "fora/fg-lora layers: [2, 3], as fora_layers gives them" in result["notes"]


def test_plan_takes_the_layers_of_a_scores_file_or_else_says_it_plans_the_worst_case(tmp_path):
    scores = tmp_path / "fora_scores.json"
    scores.write_text(json.dumps({"scores": [0.1, 0.2, 0.9, 0.8]}))
    setup = plan_setup(write_config(tmp_path, fora_scores_path=str(scores)), [])
    layers, note = plan_module.planned_placement(setup, LAYERS)
    assert layers == [2, 3] and "the top 2 of the scores in fora_scores_path" in note
    setup = plan_setup(write_config(tmp_path, fora_layer_strategy="last"), [])
    assert plan_module.planned_placement(setup, LAYERS)[0] == [2, 3]
    setup = plan_setup(write_config(tmp_path), [])
    layers, note = plan_module.planned_placement(setup, LAYERS)
    assert layers == [0, 2] and "worst case" in note and "fora_scores_path" in note
    scores.write_text(json.dumps({"scores": [0.1, 0.2]}))
    setup = plan_setup(write_config(tmp_path, fora_scores_path=str(scores)), [])
    with pytest.raises(ValueError, match=r"fora_scores_path=.* holds scores for 2 layers, but this model has 4"):
        plan_module.planned_placement(setup, LAYERS)


@pytest.mark.skipif(add_fused_lm_head is None, reason="this TRL's SFTTrainer has no fused LM head")
def test_the_plan_runs_trls_fused_head_as_on_cuda():
    """Inside the plan (fake tensors), TRL's fused-head product accumulates a @ b into the fp32 accumulator in place,
    as its CUDA branch does (no fp32 copies of the factors), and its tile folds allocate nothing (the GPU's Triton
    kernels); the product's FLOPs are counted. Outside the plan TRL's own functions are back."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from trl.kernels import chunked_logprob

    own = chunked_logprob._addmm_fp32, chunked_logprob._forward_tile, chunked_logprob._backward_tile
    with plan_module.fused_lm_head_as_on_cuda(), FakeTensorMode():
        acc = torch.zeros(6, 5)
        a, b = torch.zeros(6, 7, dtype=torch.bfloat16), torch.zeros(7, 5, dtype=torch.bfloat16)
        tile = torch.zeros(6, 5, dtype=torch.bfloat16)
        tracker = LiveTensorTracker(count_flops=True)
        for t in (acc, a, b, tile):
            tracker.register(t)
        before = tracker.current
        with tracker:
            chunked_logprob._addmm_fp32(acc, a, b)
            chunked_logprob._forward_tile(tile, 5, *[None] * 12, **dict.fromkeys(["BLOCK_SIZE"], 1))
            chunked_logprob._backward_tile(tile, 5)
        assert tracker.peak == before  # nothing allocated
        assert tracker.flops == 2 * 6 * 7 * 5
        assert acc.dtype == torch.float32 and acc.shape == (6, 5)
    assert (chunked_logprob._addmm_fp32, chunked_logprob._forward_tile, chunked_logprob._backward_tile) == own


@pytest.mark.skipif(add_fused_lm_head is None, reason="this TRL's SFTTrainer has no fused LM head")
def test_the_plans_fp32_product_of_half_factors_dispatches_no_out_dtype_op_and_allocates_nothing():
    """torch 2.11's fake mode runs addmm's decomposition for its out_dtype overloads, which takes out_dtype for beta
    (TypeError): the plan's fp32 product of bf16/fp16 factors dispatches none of them, returns no storage but those
    of its arguments, and refuses factors whose shapes the GPU's op would refuse, naming them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from trl.kernels import chunked_logprob

    if not hasattr(chunked_logprob, "_addmm_fp32"):
        pytest.skip("this TRL's fused LM head has no _addmm_fp32")

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.storages = [], set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append(func)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.storages.add(StorageWeakRef(t.untyped_storage()))
            return out

    with plan_module.fused_lm_head_as_on_cuda(), FakeTensorMode():
        for dtype in (torch.bfloat16, torch.float16):
            acc = torch.zeros(6, 5)
            a, b = torch.zeros(6, 7, dtype=dtype), torch.zeros(7, 5, dtype=dtype)
            with OpLog() as log:
                chunked_logprob._addmm_fp32(acc, a, b)
            assert log.ops  # the product is dispatched (its FLOPs are counted)
            assert not [op for op in log.ops if any(arg.name == "out_dtype" for arg in op._schema.arguments)]
            assert log.storages <= {StorageWeakRef(t.untyped_storage()) for t in (acc, a, b)}
            assert acc.dtype == torch.float32 and acc.shape == (6, 5)
            with pytest.raises(RuntimeError, match=r"acc \(6, 5\) torch.float32 .* a \(6, 7\) .* b \(8, 5\)"):
                chunked_logprob._addmm_fp32(acc, a, torch.zeros(8, 5, dtype=dtype))
            with pytest.raises(RuntimeError, match=r"acc \(5, 6\) .* a \(6, 7\) .* b \(7, 5\)"):
                chunked_logprob._addmm_fp32(torch.zeros(5, 6), a, b)
    # Real tensors get no silent non-result: the stand-ins compute nothing.
    acc, a, b = torch.zeros(6, 5), torch.ones(6, 7, dtype=torch.bfloat16), torch.ones(7, 5, dtype=torch.bfloat16)
    with plan_module.fused_lm_head_as_on_cuda():
        with pytest.raises(RuntimeError, match=r"_addmm_fp32 was called on real tensors of shapes \[\(6, 5\), "):
            chunked_logprob._addmm_fp32(acc, a, b)
        with pytest.raises(RuntimeError, match=r"tile fold was called on real tensors of shapes \[\(6, 5\)\]"):
            chunked_logprob._forward_tile(acc, 5)
    assert torch.equal(acc, torch.zeros(6, 5))


def test_a_loss_head_device_other_than_cuda_or_cpu_is_refused_by_name(tmp_path):
    setup = plan_setup(write_config(tmp_path), [])
    with pytest.raises(ValueError, match=r"loss_head_device='tpu': use one of \('cuda', 'cpu'\)"):
        dataclasses.replace(setup, loss_head_device="tpu")
