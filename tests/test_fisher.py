"""fisher_scores against a brute-force reference: full per-batch gradients of every layer parameter, summed."""

import os
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from conftest import GPT2_TARGETS, TARGETS, tiny_gpt2, tiny_llama
from peft import LoraConfig, get_peft_model
from torch import nn

from fora_plugin.fisher import _LayerAccumulator, fisher_scores, squared_norm_of_outer_sum
from fora_plugin.targets import find_decoder_layers


def make_batches(n=3, batch=2, length=10, seed=0, masked_prefix=0):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, 96, (batch, length), generator=gen)
        labels = ids.clone()
        labels[:, :masked_prefix] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def brute_force_scores(model, batches, targets=None, loss_fn=None):
    """Keep every gradient: for each batch, backward, then sum ‖grad‖² over each layer's parameters."""
    _, layers = find_decoder_layers(model)
    model.requires_grad_(False)
    params = []
    for layer in layers:
        chosen = [p for n, p in layer.named_parameters() if targets is None or any(f"{t}." in n for t in targets)]
        for p in chosen:
            p.requires_grad_(True)
        params.append(chosen)
    totals = torch.zeros(len(layers), dtype=torch.float64)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch) if loss_fn else model(**batch).loss
        loss.backward()
        for i, chosen in enumerate(params):
            totals[i] += sum(p.grad.double().square().sum() for p in chosen)
    model.zero_grad(set_to_none=True)
    return (totals / len(batches)).tolist()


def assert_close(actual, expected, rtol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert abs(a - e) <= rtol * abs(e), (actual, expected)


@pytest.mark.parametrize("fisher_params", ["layer", "targets"])
def test_scores_equal_brute_force(fisher_params):
    batches = make_batches()
    targets = TARGETS if fisher_params == "targets" else None
    result = fisher_scores(
        tiny_llama(), batches, 3, fisher_params=fisher_params, target_modules=targets, progress=False
    )
    assert_close(result.scores, brute_force_scores(tiny_llama(), batches, targets))
    assert result.num_batches == 3 and result.layer_prefix == "model.layers"


def test_targets_scores_are_part_of_layer_scores():
    batches = make_batches()
    layer = fisher_scores(tiny_llama(), batches, 3, progress=False).scores
    targets = fisher_scores(
        tiny_llama(), batches, 3, fisher_params="targets", target_modules=["q_proj"], progress=False
    ).scores
    assert all(0 < t < full for t, full in zip(targets, layer))


def test_activation_path_equals_autograd_on_the_same_float_model():
    batches = make_batches()
    autograd = fisher_scores(tiny_llama(), batches, 3, progress=False).scores
    activations = fisher_scores(tiny_llama(), batches, 3, linear_grad="activations", progress=False).scores
    assert_close(activations, autograd)


@pytest.mark.parametrize(("tokens", "d_out", "d_in"), [(4, 30, 20), (50, 6, 8)])
def test_squared_norm_of_outer_sum_both_forms(tokens, d_out, d_in):
    gen = torch.Generator().manual_seed(1)
    g, x = (
        torch.randn(tokens, d_out, generator=gen, dtype=torch.float64),
        torch.randn(tokens, d_in, generator=gen, dtype=torch.float64),
    )
    direct = sum(torch.outer(g[t], x[t]) for t in range(tokens)).square().sum()
    assert torch.isclose(squared_norm_of_outer_sum(g, x), direct, rtol=1e-12)


def test_masked_labels_do_not_contribute():
    batches = make_batches(masked_prefix=6)

    def loss_on_unmasked_only(model, batch):  # cross-entropy over the 3 predicted, unmasked tokens, by hand
        logits = model(input_ids=batch["input_ids"]).logits[:, 5:-1]
        targets = batch["input_ids"][:, 6:]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    expected = brute_force_scores(tiny_llama(), batches, loss_fn=loss_on_unmasked_only)
    assert_close(fisher_scores(tiny_llama(), batches, 3, progress=False).scores, expected)
    unmasked = fisher_scores(tiny_llama(), make_batches(), 3, progress=False).scores
    assert all(abs(a - b) > 1e-3 * b for a, b in zip(expected, unmasked))


def test_scoring_restores_flags_modes_and_grads():
    model = tiny_llama()
    model.lm_head.weight.requires_grad_(True)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    model.model.layers[1].train()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    fisher_scores(model, make_batches(), 3, progress=False)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_does_not_change_scores(reentrant, linear_grad):
    batches = make_batches()
    plain = fisher_scores(tiny_llama(), batches, 3, linear_grad=linear_grad, progress=False).scores
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert_close(fisher_scores(model, batches, 3, linear_grad=linear_grad, progress=False).scores, plain)


def test_modules_given_as_quantized_are_scored_from_their_inputs_and_output_gradients():
    """fora plan's fake 4-bit models hold float linears that stand for quantized ones: passed as ``quantized``, they
    take the route of a quantized linear (x and g, no weight gradient), which gives the same scores."""
    batches = make_batches()
    expected = brute_force_scores(tiny_llama(), batches)
    model = tiny_llama()
    linears = [m for layer in find_decoder_layers(model)[1] for m in layer.modules() if isinstance(m, nn.Linear)]
    with mock.patch(
        "fora_plugin.fisher.squared_norm_of_outer_sum", side_effect=squared_norm_of_outer_sum
    ) as outer_sums:
        scores = fisher_scores(model, batches, 3, quantized=linears, progress=False).scores
    assert_close(scores, expected)
    # One ‖Σ g xᵀ‖² per stand-in and batch (weights and biases of the tiny Llama: none have a bias).
    assert outer_sums.call_count == len(linears) * len(batches)
    assert all(p.grad is None for p in model.parameters())
    with mock.patch("fora_plugin.fisher.squared_norm_of_outer_sum", side_effect=squared_norm_of_outer_sum) as none:
        fisher_scores(tiny_llama(), batches, 3, progress=False)
    assert none.call_count == 0  # without them, float linears go through autograd


def test_a_peft_model_is_scored_on_its_base_and_its_adapter_stays_trainable():
    batches = make_batches()
    base_scores = fisher_scores(tiny_llama(), batches, 3, progress=False).scores
    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert_close(fisher_scores(peft_model, batches, 3, progress=False).scores, base_scores)
    assert {n for n, p in peft_model.named_parameters() if p.requires_grad} == trainable


def test_too_few_batches_warns_and_uses_what_there_is():
    batches = make_batches(n=2)
    with pytest.warns(UserWarning, match=r"fisher_batches=10 but only 2 batches"):
        result = fisher_scores(tiny_llama(), batches, 10, progress=False)
    assert result.num_batches == 2
    assert_close(result.scores, brute_force_scores(tiny_llama(), batches))


def test_bad_inputs_name_the_value():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"fisher_batches=0 is invalid"):
        fisher_scores(model, make_batches(), 0)
    with pytest.raises(ValueError, match=r"fisher_params='all' is invalid.*\('layer', 'targets'\)"):
        fisher_scores(model, make_batches(), 1, fisher_params="all")
    with pytest.raises(ValueError, match=r"needs target_modules"):
        fisher_scores(model, make_batches(), 1, fisher_params="targets")
    with pytest.raises(ValueError, match=r"got no batch"):
        fisher_scores(model, [], 1, progress=False)
    with pytest.raises(
        ValueError,
        match=r"Cannot find the decoder layers of Sequential: looked for "
        r"get_decoder\(\).layers",
    ):
        fisher_scores(nn.Sequential(nn.Linear(2, 2)), make_batches(), 1)


def _score_on_rank(rank, world, port, batches, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mine = batches[rank::world]
        out[rank] = fisher_scores(tiny_llama(), mine, len(mine), progress=False).scores
    finally:
        torch.distributed.destroy_process_group()


def test_distributed_ranks_all_reduce_to_the_single_process_scores():
    batches = make_batches(n=4)
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29500 + os.getpid() % 1000
        mp.spawn(_score_on_rank, args=(2, port, batches, out), nprocs=2, join=True)
        ranks = [out[0], out[1]]
    assert ranks[0] == ranks[1]  # every rank selects the same layers
    assert_close(ranks[0], fisher_scores(tiny_llama(), batches, 4, progress=False).scores)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float32])
def test_4bit_weights_in_float_storage_are_scored_as_quantized(tmp_path, storage):
    # QLoRA under FSDP/DeepSpeed packs the 4-bit weights into a float storage (bnb_4bit_quant_storage): they have a
    # float dtype but no gradient, so they must take the x/g path like uint8-packed ones, with the same scores.
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(num_layers=2).save_pretrained(tmp_path)
    ids = [torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(i)) for i in (0, 1)]
    batches = [{"input_ids": x, "labels": x} for x in ids]
    scores = []
    for quant_storage in (torch.uint8, storage):
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.float32,
            bnb_4bit_quant_storage=quant_storage,
        )
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization, device_map="cpu")
        weight = model.model.layers[0].self_attn.q_proj.weight
        assert weight.dtype == quant_storage
        scores.append(fisher_scores(model, batches, num_batches=2).scores)
    torch.testing.assert_close(torch.tensor(scores[1]), torch.tensor(scores[0]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fisher_params", ["layer", "targets"])
def test_activations_mode_forms_no_parameter_gradient(fisher_params):
    # The mode sharded training scores with: norms (and any non-linear parameter) by a local re-run, linears by x/g;
    # no base parameter may require or hold a gradient at any point, and the scores are those of autograd.
    batches = make_batches()
    targets = TARGETS if fisher_params == "targets" else None
    model = tiny_llama()
    seen = []

    def watching_loss(model, batch):
        seen.append([n for n, p in model.named_parameters() if p.requires_grad or p.grad is not None])
        return model(**batch).loss

    activations = fisher_scores(
        model,
        batches,
        3,
        loss_fn=watching_loss,
        fisher_params=fisher_params,
        target_modules=targets,
        linear_grad="activations",
        progress=False,
    ).scores
    assert seen == [[], [], []]
    assert all(p.grad is None for p in model.parameters())
    assert_close(activations, brute_force_scores(tiny_llama(), batches, targets))


def _count_forwards(module):
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_dropout_is_off_while_scoring_and_checkpointing_still_applies(family):
    # With dropout > 0 in the config, scores were a random sample: they changed with the seed. They must be the
    # dropout-free scores (brute force in eval mode), while train mode still makes checkpointing recompute layers.
    batches = make_batches()

    def build():
        if family == "gpt2":
            return tiny_gpt2(dropout=0.1)
        model = tiny_llama()
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        return model

    expected = brute_force_scores(build().eval(), batches)
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = build()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        _, layers = find_decoder_layers(model)
        calls = _count_forwards(next(layers[1].children()))  # inside the checkpointed forward
        assert_close(fisher_scores(model, batches, 3, progress=False).scores, expected)
        assert len(calls) == 2 * len(batches)  # the forward, then the recompute in backward
    torch.manual_seed(2)
    activations = fisher_scores(build(), batches, 3, linear_grad="activations", progress=False).scores
    assert_close(activations, expected)


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
@pytest.mark.parametrize("fisher_params", ["layer", "targets"])
def test_gpt2_conv1d_layers_score_like_brute_force(fisher_params, linear_grad):
    batches = make_batches()
    targets = GPT2_TARGETS if fisher_params == "targets" else None
    result = fisher_scores(
        tiny_gpt2(),
        batches,
        3,
        fisher_params=fisher_params,
        target_modules=targets,
        linear_grad=linear_grad,
        progress=False,
    )
    assert result.layer_prefix == "transformer.h"
    assert_close(result.scores, brute_force_scores(tiny_gpt2(), batches, targets))


def test_contributions_from_another_device_are_moved_to_the_totals_device():
    # device_map="auto": a layer on another device computes its part there; it is added on the totals' device.
    # (A second real device is not available on a CPU-only machine: the contribution is a stand-in that records
    # where it is moved to.)
    accumulator = _LayerAccumulator(2, torch.device("cpu"))
    elsewhere = mock.MagicMock()
    elsewhere.to.return_value = torch.tensor(3.0)
    accumulator.add(1, elsewhere)
    elsewhere.to.assert_called_once_with(accumulator.totals.device)
    assert accumulator.totals.tolist() == [0.0, 3.0]


@pytest.mark.parametrize("linear_grad", ["auto", "activations"])
@pytest.mark.parametrize("checkpointing", [None, False, True])  # off, non-reentrant, reentrant
def test_a_scoring_run_makes_one_host_sync(linear_grad, checkpointing):
    # Scores accumulate on the device; the totals and the batch count are read back once, after the last batch (a
    # read per batch or per layer would stall a GPU's launch queue). Budget: what the model's own training forward
    # and backward make per batch (transformers' packed-sequence check in train mode: 1), plus one per run.
    from host_sync import HostSyncCounter

    model = tiny_llama().train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    batches = make_batches()
    with HostSyncCounter() as training:
        model(**batches[0]).loss.backward()
    assert all("fora_plugin" not in " ".join(s.where) for s in training.syncs)
    model.zero_grad(set_to_none=True)
    with HostSyncCounter() as syncs:
        result = fisher_scores(model, batches, 3, linear_grad=linear_grad, progress=False)
    assert syncs.count == len(batches) * training.count + 1, syncs.report()
    assert_close(result.scores, brute_force_scores(tiny_llama(), batches))
