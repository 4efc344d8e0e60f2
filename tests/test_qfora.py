"""QFoRA: FoRA on a 4-bit NF4 (bitsandbytes) base, on a CPU.

Fisher scores of the 4-bit model (x/g path for its Linear4bit layers) are checked against brute-force autograd on an
independent float model that holds the dequantised weights; FoRASFTTrainer is run end to end on the 4-bit model.
"""

from pathlib import Path

import pytest
import torch
import yaml
from conftest import TARGETS, char_tokenizer, tiny_llama


bnb = pytest.importorskip("bitsandbytes", reason="QFoRA needs bitsandbytes: pip install -e '.[qlora]'")

from bitsandbytes.functional import dequantize_4bit  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from test_fisher import brute_force_scores  # noqa: E402
from test_trainer import sft_args  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402
from trl import get_quantization_config  # noqa: E402

from fora_plugin import FoRAConfig, FoRASFTTrainer, stiefel_parameters  # noqa: E402
from fora_plugin.fisher import fisher_scores  # noqa: E402
from fora_plugin.recipe import parse_config  # noqa: E402
from fora_plugin.stiefel import orthogonality_error  # noqa: E402
from fora_plugin.targets import find_decoder_layers  # noqa: E402


VOCAB = 99  # the character tokenizer's size
LAYERS = 4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels")
CONFIG = Path(__file__).parent.parent / "example_configs" / "qfora_llama3_8b.yaml"


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(LAYERS, vocab_size=VOCAB).save_pretrained(path)
    return path


def load_4bit(path) -> torch.nn.Module:
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,  # float32 compute: the float reference then agrees to rounding
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cpu")


def dequantised_float_model(quantized: torch.nn.Module) -> torch.nn.Module:
    """A float Llama of the same config computing what ``quantized`` computes: every weight set from it.

    Built from another seed so that a weight this copy missed would show up as a mismatch, not pass unnoticed.
    """
    reference = tiny_llama(LAYERS, seed=1, vocab_size=VOCAB)
    targets = dict(reference.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                weight = module.weight
                targets[name + ".weight"].copy_(dequantize_4bit(weight.data, weight.quant_state))
                copied.add(name + ".weight")
        for name, param in quantized.named_parameters():
            if param.is_floating_point():
                targets[name].copy_(param)
                copied.add(name)
    assert copied == set(targets), set(targets) - copied
    return reference


def make_batches(n=3, batch=2, length=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
        labels = ids.clone()
        labels[:, :3] = -100  # as with a masked prompt
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def assert_close(actual, expected, rtol=1e-4):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert abs(a - e) <= rtol * abs(e), (actual, expected)


def test_decoder_linears_load_as_nf4_and_the_reference_computes_the_same_function(float_dir):
    quantized = load_4bit(float_dir)
    _, layers = find_decoder_layers(quantized)
    for layer in layers:
        for name in LINEARS:
            linear = layer.get_submodule(("self_attn." if name[0] in "qkvo" else "mlp.") + name)
            assert isinstance(linear, bnb.nn.Linear4bit)
            assert linear.weight.dtype == torch.uint8 and linear.weight.quant_state.quant_type == "nf4"
            assert linear.weight.quant_state.nested  # double quantisation of the absmax constants
    reference = dequantised_float_model(quantized)
    original = tiny_llama(LAYERS, vocab_size=VOCAB)
    q_deq, q_orig = reference.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.q_proj.weight
    assert 0 < (q_deq - q_orig).abs().max() < 0.1  # NF4 rounding: close to, not equal to, the float weights
    # Train mode: in eval mode without grad, bitsandbytes on a CPU repacks the weights in place for its inference
    # kernel, which needs in_features >= 64 (32 here) and leaves the layer without a backward.
    quantized.train()
    ids = make_batches(1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.allclose(quantized(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fisher_params", ["layer", "targets"])
def test_4bit_scores_equal_brute_force_on_the_dequantised_float_model(float_dir, fisher_params):
    quantized = load_4bit(float_dir)
    reference = dequantised_float_model(quantized)
    batches = make_batches()
    # On the 4-bit model "layer" is the Linear4bit weights (x/g path) plus the float norms (autograd); "targets" is
    # the target Linear4bit weights only. The float reference's matching sets: all layer parameters, target weights.
    targets = TARGETS if fisher_params == "targets" else None
    flags = {n: p.requires_grad for n, p in quantized.named_parameters()}
    result = fisher_scores(quantized, batches, 3, fisher_params=fisher_params, target_modules=targets, progress=False)
    assert_close(result.scores, brute_force_scores(reference, batches, targets))
    assert {n: p.requires_grad for n, p in quantized.named_parameters()} == flags
    assert all(p.grad is None for p in quantized.parameters())


def test_4bit_peft_model_is_scored_on_its_base(float_dir):
    quantized = load_4bit(float_dir)
    reference = dequantised_float_model(quantized)
    batches = make_batches()
    peft_model = get_peft_model(quantized, LoraConfig(r=4, target_modules=list(TARGETS), init_lora_weights=False))
    scores = fisher_scores(peft_model, batches, 3, progress=False).scores
    assert_close(scores, brute_force_scores(reference, batches))


def sums_dataset() -> Dataset:
    return Dataset.from_list(
        [{"prompt": f"Q: {a}+{b}=", "completion": f" {a + b}"} for a in range(6) for b in range(6)]
    )


@pytest.mark.slow
def test_qfora_trains_lora_on_the_chosen_layers_of_a_4bit_base(float_dir, tmp_path):
    args = sft_args(
        tmp_path,
        per_device_train_batch_size=8,
        max_steps=15,
        learning_rate=3e-2,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",  # the scoring batches are then the dataloader's first ones
    )
    trainer = FoRASFTTrainer(
        load_4bit(float_dir),
        args,
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(TARGETS)),
        fora_config=FoRAConfig(fisher_batches=3, lr_stiefel=5e-2),
    )
    trainer.train()
    chosen, scores = trainer.fora_selection.chosen, trainer.fora_selection.scores.scores
    # Scored through the trainer's own batches (prompts masked) as brute force scores the dequantised float model.
    batches = [{k: b[k] for k in MODEL_INPUTS if k in b} for b in trainer.get_train_dataloader()]
    assert all((b["labels"] == -100).any() for b in batches)
    reference = dequantised_float_model(load_4bit(float_dir))
    assert_close(scores, brute_force_scores(reference, batches[:3]))
    assert chosen == sorted(sorted(range(LAYERS), key=lambda i: -scores[i])[: LAYERS // 2])
    adapted = {int(n.split(".layers.")[1].split(".")[0]) for n, _ in trainer.model.named_parameters() if "lora_A" in n}
    assert adapted == set(chosen)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    _, layers = find_decoder_layers(trainer.model)
    assert all(isinstance(layer.self_attn.o_proj, bnb.nn.Linear4bit) for layer in layers)  # base stays 4-bit
    stiefel = stiefel_parameters(trainer.model)
    assert len(stiefel) == len(chosen) * len(TARGETS)
    (group,) = [g for g in trainer.optimizer.param_groups if g["stiefel"]]
    assert {id(p) for p in group["params"]} == {id(p) for _, p in stiefel}
    # A bf16 lora_B (SFTTrainer's QLoRA adapter dtype) is rounded; its fp32 master is the point on the manifold.
    errors = [
        orthogonality_error(trainer.optimizer.state[p].get("master", p).detach().float()).item() for _, p in stiefel
    ]
    assert max(errors) < 1e-4, errors
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 15 and sum(losses[-5:]) < 0.97 * sum(losses[:5]), losses  # 4.45 -> 4.21 on this run
    # The same batches through the trained model and through its 4-bit base (the model at step 0: B A = 0).
    # Train mode (no dropout here): bitsandbytes' CPU inference path (eval, no grad) needs in_features >= 64.
    model = trainer.model.train()
    with torch.no_grad():
        trained = sum(model(**b).loss.item() for b in batches) / len(batches)
        with model.disable_adapter():
            base = sum(model(**b).loss.item() for b in batches) / len(batches)
    assert trained < 0.95 * base, (trained, base)  # 4.19 vs 4.57 on this run


def test_example_config_is_nf4_double_quant_with_bf16_compute():
    raw = yaml.safe_load(CONFIG.read_text())
    assert raw["bf16"] is True and raw["dtype"] == "bfloat16"
    overrides = ["--bf16", "false", "--use_cpu", "true"]  # bf16 is refused on a CPU-only host
    script_args, training_args, model_args, fora = parse_config(str(CONFIG), overrides)
    quantization = get_quantization_config(model_args)
    assert quantization.load_in_4bit and not quantization.load_in_8bit
    assert quantization.bnb_4bit_quant_type == "nf4" and quantization.bnb_4bit_use_double_quant
    assert quantization.bnb_4bit_compute_dtype == torch.bfloat16
    assert (model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout) == (32, 64, 0.0)
    assert sorted(model_args.lora_target_modules) == sorted(TARGETS)
    assert (fora.mode, fora.layer_budget, fora.fisher_batches, fora.fisher_params) == ("fora", 0.5, 128, "layer")
    assert (fora.lr_stiefel, fora.qr_period, training_args.learning_rate) == (1e-3, 200, 2e-4)
    assert (training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps) == (16, 4)
    assert getattr(training_args.optim, "value", training_args.optim) in ("adamw_torch", "adamw_torch_fused")


def load_4bit_as_on_a_cpu(path, monkeypatch, avx512bf16: bool) -> torch.nn.Module:
    """``load_4bit`` as on a CPU with or without AVX512-BF16, whichever this one has.

    bitsandbytes asks the CPU once per Linear4bit, in its ``__init__`` (``support_avx512bf16_for_cpu``), and its
    forward repacks a weight for the AVX512-BF16 inference kernel only where the answer was yes. Tests of the repack
    pin the answer, so that they test the same thing on every CPU (on one without AVX512-BF16 nothing ever repacks).
    """
    monkeypatch.setattr("bitsandbytes.nn.modules.has_avx512bf16", lambda: avx512bf16)
    model = load_4bit(path)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(bool(m.support_avx512bf16_for_cpu) is avx512bf16 for m in layers)  # bitsandbytes asked us
    return model


def repacked(model: torch.nn.Module) -> list[bool]:
    """Whether each Linear4bit weight is in bitsandbytes' CPU inference layout."""
    return [
        bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False))
        for m in model.modules()
        if isinstance(m, bnb.nn.Linear4bit)
    ]


def test_a_4bit_model_repacked_by_an_eval_forward_is_refused(tmp_path, monkeypatch):
    # On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for inference at the first no-grad eval forward
    # and never back; gradients then stop at that layer, so scoring must refuse rather than give wrong scores.
    # in_features 128: the repack needs in_features >= 64 (one absmax block).
    tiny_llama(2, vocab_size=VOCAB, hidden_size=128, intermediate_size=256).save_pretrained(tmp_path)
    model = load_4bit_as_on_a_cpu(tmp_path, monkeypatch, avx512bf16=True)
    batches = make_batches()
    fisher_scores(model, batches, 1)  # fine before
    assert not any(repacked(model))
    model.eval()
    with torch.no_grad():
        # Where this CPU lacks AVX512-BF16, bitsandbytes multiplies the repacked weight with its generic kernel,
        # which gives wrong logits; only the repack matters here.
        model(batches[0]["input_ids"])
    assert all(repacked(model))
    with pytest.raises(ValueError, match="packing_format_for_cpu=True: an eval-mode forward"):
        fisher_scores(model, batches, 1)


def test_an_eval_forward_on_a_cpu_without_avx512bf16_leaves_the_4bit_model_scorable(tmp_path, monkeypatch):
    # Without AVX512-BF16 bitsandbytes never repacks: the same eval forward changes nothing, and scoring after it
    # gives the scores from before (the refusal above reads the weight's layout, not the model's history).
    tiny_llama(2, vocab_size=VOCAB, hidden_size=128, intermediate_size=256).save_pretrained(tmp_path)
    model = load_4bit_as_on_a_cpu(tmp_path, monkeypatch, avx512bf16=False)
    batches = make_batches()
    before = fisher_scores(model, batches, 3, progress=False).scores
    model.eval()
    with torch.no_grad():
        model(batches[0]["input_ids"])
    assert not any(repacked(model))
    assert_close(fisher_scores(model, batches, 3, progress=False).scores, before, rtol=1e-6)


def test_scoring_under_reentrant_checkpointing_leaves_the_4bit_weights_trainable(tmp_path, monkeypatch):
    # A reentrant checkpoint's first forward runs without gradients: a Linear4bit in eval mode would repack its
    # weight for inference there (for good). Scoring turns dropout off without putting the model in eval mode.
    # Loaded as on a CPU with AVX512-BF16, the only kind on which bitsandbytes repacks: elsewhere this proves nothing.
    tiny_llama(2, vocab_size=VOCAB, hidden_size=128, intermediate_size=256).save_pretrained(tmp_path)
    batches = make_batches()
    plain = fisher_scores(load_4bit_as_on_a_cpu(tmp_path, monkeypatch, True), batches, 3, progress=False).scores
    model = load_4bit_as_on_a_cpu(tmp_path, monkeypatch, True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert_close(fisher_scores(model, batches, 3, progress=False).scores, plain, rtol=1e-5)
    assert not any(repacked(model))
