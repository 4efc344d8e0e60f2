"""FoRA on fused MoE experts (LoraConfig.target_parameters): layer selection, Fisher scores, per-expert Stiefel B.

PEFT's ParamWrapper keeps the LoRA of E experts in one lora_B (d_out, r·E), the experts' columns interleaved; FoRA
keeps each expert's (d_out, r) block on its own Stiefel manifold, on the chosen layers only.
"""

import pytest
import torch
from conftest import EXPERT_PARAMETERS, char_tokenizer, tiny_moe
from peft import LoraConfig, PeftModel, get_peft_model
from test_fisher import assert_close, make_batches
from test_trainer import VOCAB, sft_args, sums_dataset

from fora_plugin import FoRAConfig, FoRASFTTrainer, build_fora_optimizer, stiefel_num_experts, stiefel_parameters
from fora_plugin.adapter import expert_blocks
from fora_plugin.fisher import fisher_scores
from fora_plugin.selection import FoRASelection
from fora_plugin.stiefel import orthogonality_error
from fora_plugin.targets import find_decoder_layers
from fora_plugin.wiring import _max_drift, format_selection_table, init_fora_adapters, restrict_lora_config


CHOSEN = [1, 3]
EXPERTS = 4
LINEARS = ["q_proj", "v_proj"]


def moe_lora_config(**kwargs) -> LoraConfig:
    return LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=list(LINEARS),
        target_parameters=list(EXPERT_PARAMETERS),
        **kwargs,
    )


def fora_moe(config=None, seed=0):
    """A tiny MoE with FoRA's adapter on CHOSEN, as readapt_lora builds it."""
    base = tiny_moe()
    config = config or moe_lora_config()
    selection = FoRASelection(CHOSEN, 4, "model.layers")
    restrict_lora_config(config, base, selection)
    model = get_peft_model(base, config)
    init_fora_adapters(model, selection, FoRAConfig(layers=CHOSEN), seed)
    return model, selection


def layer_of(name):
    return int(name.split(".layers.")[1].split(".")[0])


def reference_scores(model, batches, in_scope):
    """Brute force: every gradient of the parameters in scope, kept and summed per layer."""
    _, layers = find_decoder_layers(model)
    model.requires_grad_(False)
    chosen = [[p for n, p in layer.named_parameters() if in_scope(n)] for layer in layers]
    for p in (p for params in chosen for p in params):
        p.requires_grad_(True)
    totals = torch.zeros(len(layers), dtype=torch.float64)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        for i, params in enumerate(chosen):
            totals[i] += sum(p.grad.double().square().sum() for p in params if p.grad is not None)
    return (totals / len(batches)).tolist()


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
@pytest.mark.parametrize("fisher_params", ["layer", "targets"])
def test_expert_weights_count_in_the_layer_score(fisher_params, linear_grad):
    batches = make_batches()
    # "targets": the expert Parameters alone, so that their share (small at this init) is what is compared.
    targets = {"target_parameters": EXPERT_PARAMETERS} if fisher_params == "targets" else {}
    gradients_formed = []

    def watching_loss(model, batch):  # "activations": no base parameter may require or hold a gradient
        gradients_formed.extend(n for n, p in model.named_parameters() if p.requires_grad or p.grad is not None)
        return model(**batch).loss

    result = fisher_scores(
        tiny_moe(),
        batches,
        3,
        loss_fn=watching_loss,
        fisher_params=fisher_params,
        linear_grad=linear_grad,
        progress=False,
        **targets,
    )
    assert (gradients_formed == []) == (linear_grad == "activations")
    if fisher_params == "layer":
        expected = reference_scores(tiny_moe(), batches, lambda n: True)
    else:
        expected = reference_scores(tiny_moe(), batches, lambda n: n in EXPERT_PARAMETERS)
        assert all(e > 0 for e in expected)
    assert_close(result.scores, expected)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activations_mode_counts_each_expert_and_router_once_under_checkpointing(reentrant):
    # The router has two differentiable outputs (logits, weights) and the experts re-run on saved inputs: under
    # gradient checkpointing the recompute must add nothing.
    batches = make_batches()
    plain = fisher_scores(tiny_moe(), batches, 3, linear_grad="activations", progress=False).scores
    model = tiny_moe()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert_close(fisher_scores(model, batches, 3, linear_grad="activations", progress=False).scores, plain)


def test_lora_only_on_the_chosen_layers_with_one_stiefel_manifold_per_expert(token_batch):
    model, selection = fora_moe()
    with torch.no_grad():
        base_logits = tiny_moe()(input_ids=token_batch).logits
        assert torch.equal(model(input_ids=token_batch).logits, base_logits)  # A = 0: the base model at step 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert {layer_of(n) for n in trainable} == set(CHOSEN)
    assert sum("experts" in n for n in trainable) == 2 * 2 * len(CHOSEN)  # lora_A, lora_B of 2 Parameters, 2 layers
    assert selection.target_parameters == [f"model.layers.{i}.{t}" for i in CHOSEN for t in EXPERT_PARAMETERS]
    # LoRA on all 4 layers would have twice the chosen layers' parameters.
    assert "= 50.0% of LoRA on all layers" in format_selection_table(selection)

    experts = stiefel_num_experts(model)
    fused = [(n, p) for n, p in stiefel_parameters(model) if "experts" in n]
    assert len(fused) == 2 * len(CHOSEN) and {experts[id(p)] for _, p in fused} == {EXPERTS}
    for _, p in fused:
        blocks = expert_blocks(p.detach(), EXPERTS)  # (E, d_out, r)
        assert (orthogonality_error(blocks) < 1e-5).all()
        # Each expert is its own random Stiefel matrix: not orthogonal to the other experts' blocks.
        assert (blocks[0].T @ blocks[1]).abs().max() > 1e-2
        assert orthogonality_error(p.detach()) > 0.5  # the whole (d_out, r·E) matrix is not one Stiefel matrix
    assert all(id(p) not in experts for n, p in stiefel_parameters(model) if "experts" not in n)


def test_drift_is_read_per_expert_block():
    # Blocks each orthonormal but not jointly: the whole matrix is far from BᵀB = I, each expert is on its manifold.
    model, _ = fora_moe()
    assert _max_drift(model, None) < 1e-5
    name, p = next((n, p) for n, p in stiefel_parameters(model) if "experts" in n)
    with torch.no_grad():
        expert_blocks(p, EXPERTS)[2].mul_(1.5)  # expert 2 leaves its manifold
    expected = orthogonality_error(expert_blocks(p.detach(), EXPERTS)[2]).item()
    assert _max_drift(model, None) == pytest.approx(expected, rel=1e-6)


def test_fora_sft_trainer_adapts_only_the_chosen_layers_of_an_moe(tmp_path, capsys):
    # Seen before: explicit layers [1, 3], yet the experts of layers 0-3 were trainable ("200.0% of LoRA on all").
    trainer = FoRASFTTrainer(
        tiny_moe(vocab_size=VOCAB),
        sft_args(tmp_path, max_steps=3),
        train_dataset=sums_dataset(12),
        processing_class=char_tokenizer(),
        peft_config=moe_lora_config(),
        fora_config=FoRAConfig(layers=CHOSEN),
    )
    assert "= 50.0% of LoRA on all layers" in capsys.readouterr().out
    trainer.train()
    model = trainer.model
    assert {layer_of(n) for n, p in model.named_parameters() if p.requires_grad} == set(CHOSEN)
    experts = stiefel_num_experts(model)
    fused = [p for n, p in stiefel_parameters(model) if "experts" in n]
    assert len(fused) == 2 * len(CHOSEN)
    for p in fused:
        assert orthogonality_error(expert_blocks(p.detach(), experts[id(p)])).max() < 1e-5
    logged = [log for log in trainer.state.log_history if "fora/max_orthogonality_error" in log]
    assert logged and all(log["fora/max_orthogonality_error"] < 1e-5 for log in logged)


def test_training_keeps_each_expert_block_on_its_manifold_and_the_adapter_reloads(tmp_path, token_batch):
    model, _ = fora_moe()
    optimizer = build_fora_optimizer(model, lr=1e-2, lr_stiefel=5e-2)
    fused = [p for n, p in stiefel_parameters(model) if "experts" in n]
    before = [p.detach().clone() for p in fused]
    model.train()
    for batch in make_batches(n=4):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    drifts = []
    for p, start in zip(fused, before):
        blocks = expert_blocks(p.detach(), EXPERTS)
        drifts.append(orthogonality_error(blocks).max().item())
        assert drifts[-1] < 1e-5 and not torch.equal(p.detach(), start)
        assert (blocks[0].T @ blocks[1]).abs().max() > 1e-2  # still one manifold per expert
    assert _max_drift(model, optimizer) >= max(drifts)

    with torch.no_grad():
        trained_logits = model(input_ids=token_batch).logits
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_moe(), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=token_batch).logits, trained_logits, rtol=0, atol=1e-6)
    assert not torch.allclose(trained_logits, tiny_moe()(input_ids=token_batch).logits)
