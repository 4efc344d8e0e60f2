"""make_stiefel on real PEFT LoRA models, and the parameter groups build_fora_optimizer makes from them."""

import json
import warnings

import pytest
import torch
from conftest import GPT2_TARGETS, TARGETS, tiny_gpt2, tiny_llama
from peft import LoraConfig, get_peft_model

from fora_plugin import FoRAConfig, build_fora_optimizer, make_stiefel, stiefel_parameters
from fora_plugin.selection import SCORES_FILE, FoRASelection
from fora_plugin.stiefel import orthogonality_error
from fora_plugin.targets import find_decoder_layers
from fora_plugin.wiring import choose_layers, init_fora_adapters, restrict_lora_config


def lora(model, r=4, adapter_name="default", **kwargs):
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, lora_dropout=0.0, **kwargs)
    return get_peft_model(model, config, adapter_name=adapter_name)


def layer_modules(peft_model, layer):
    return [n for n, _ in peft_model.named_modules() if f".layers.{layer}." in n and n.split(".")[-1] in TARGETS]


def logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_stiefel_init_is_orthonormal_and_leaves_the_model_unchanged(llama, token_batch):
    base_logits = logits(llama, token_batch)
    model = lora(llama, adapter_name="task")  # any adapter name, not only "default"
    names = make_stiefel(model, generator=torch.Generator().manual_seed(0))
    assert len(names) == 4 * len(TARGETS)
    for _, weight in stiefel_parameters(model):
        assert orthogonality_error(weight.detach()) < 1e-6
    for name in names:
        assert torch.count_nonzero(model.get_submodule(name).lora_A["task"].weight) == 0
    assert torch.equal(logits(model, token_batch), base_logits)  # ΔW = B·0 = 0 exactly


def test_only_the_named_modules_become_stiefel(llama):
    model = lora(llama)
    chosen = layer_modules(model, 2)
    names = make_stiefel(model, chosen)
    assert names == chosen
    marked = [name for name, _ in stiefel_parameters(model)]
    assert marked == [f"{n}.lora_B.default.weight" for n in chosen]


def test_gaussian_init_a_follows_the_paper_and_changes_the_output(llama, token_batch):
    base_logits = logits(llama, token_batch)
    model = lora(llama, r=8)
    make_stiefel(model, init_a="gaussian", generator=torch.Generator().manual_seed(1))
    a = torch.cat([m.lora_A["default"].weight.flatten() for n, m in model.named_modules() if n.endswith("up_proj")])
    assert abs(a.std().item() - 8**-0.5) < 0.02
    assert not torch.allclose(logits(model, token_batch), base_logits)


def test_seeded_generator_reproduces_the_initialisation():
    weights = []
    for _ in range(2):
        model = lora(tiny_llama())
        make_stiefel(model, generator=torch.Generator().manual_seed(7))
        weights.append(torch.cat([w.detach().flatten() for _, w in stiefel_parameters(model)]))
    assert torch.equal(*weights)


def test_bad_inputs_are_refused_by_name(llama):
    model = lora(llama)
    with pytest.raises(ValueError, match=r"init_a='normal'.*\('zeros', 'gaussian'\)"):
        make_stiefel(model, init_a="normal")
    with pytest.raises(ValueError, match=r"\['model.layers.9.q_proj'\] are not LoRA modules"):
        make_stiefel(model, ["model.layers.9.q_proj"])
    with pytest.raises(ValueError, match=r"no LoRA layer"):
        make_stiefel(tiny_llama())


def test_dora_and_oversized_rank_are_refused(llama):
    with pytest.raises(ValueError, match=r"uses DoRA"):
        make_stiefel(lora(tiny_llama(), use_dora=True))
    # k_proj has d_out = 16 (2 kv heads of 8): rank 24 cannot be orthonormal there.
    with pytest.raises(ValueError, match=r"d_out=16 < r=24"):
        make_stiefel(lora(llama, r=24))


def test_two_adapters_need_an_explicit_name(llama):
    model = lora(llama, adapter_name="first")
    model.add_adapter("second", LoraConfig(r=4, target_modules=TARGETS))
    model.base_model.set_adapter(["first", "second"])
    with pytest.raises(ValueError, match=r"adapters \['first', 'second'\].*adapter_name"):
        make_stiefel(model)
    make_stiefel(model, adapter_name="second")
    assert all(name.endswith("lora_B.second.weight") for name, _ in stiefel_parameters(model))


def test_optimizer_groups_adamw_first_and_only_stiefel_b_in_the_stiefel_group(llama):
    model = lora(llama, lora_bias=True)
    make_stiefel(model, layer_modules(model, 1) + layer_modules(model, 3))
    opt = build_fora_optimizer(model, lr=2e-4, lr_stiefel=1e-3, weight_decay=0.01)
    decay, no_decay, stiefel = opt.param_groups
    assert (decay["stiefel"], no_decay["stiefel"], stiefel["stiefel"]) == (False, False, True)
    assert (decay["lr"], stiefel["lr"]) == (2e-4, 1e-3)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.01, 0.0)
    expected = {id(w) for _, w in stiefel_parameters(model)}
    assert {id(p) for p in stiefel["params"]} == expected and len(expected) == 2 * len(TARGETS)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("lora_B" in names[id(p)] and "bias" not in names[id(p)] for p in stiefel["params"])
    assert all(names[id(p)].endswith("bias") for p in no_decay["params"])  # lora_bias -> no decay
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(trainable)  # every trainable parameter exactly once


def test_without_stiefel_adapters_there_is_no_stiefel_group(llama):
    opt = build_fora_optimizer(lora(llama), lr=1e-4)
    assert not opt.stiefel_groups
    with pytest.raises(ValueError, match=r"no trainable parameter"):
        build_fora_optimizer(tiny_llama().requires_grad_(False))


def fora_wrap(base, config, chosen, seed=0):
    """What readapt_lora does on a fresh base: LoRA on the chosen layers only, Stiefel lora_B."""
    prefix, layers = find_decoder_layers(base)
    selection = FoRASelection(chosen, len(layers), prefix)
    restrict_lora_config(config, base, selection)
    model = get_peft_model(base, config)
    init_fora_adapters(model, selection, FoRAConfig(layers=chosen), seed)
    return model, selection


def adapted_layers(model):
    """Decoder layers with a trainable parameter (Llama's model.layers.i, GPT-2's transformer.h.i)."""
    found = set()
    for name, param in model.named_parameters():
        parts = name.split(".")
        index = next((parts[k + 1] for k, part in enumerate(parts[:-1]) if part in ("layers", "h")), None)
        if param.requires_grad and index is not None:
            found.add(int(index))
    return found


def test_gpt2_conv1d_targets_get_stiefel_lora_on_the_chosen_layers(token_batch):
    # GPT-2's projections are Conv1D (weight (in, out)): they were refused as "match no linear".
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(GPT2_TARGETS), fan_in_fan_out=True)
    model, selection = fora_wrap(tiny_gpt2(), config, [1, 3])
    assert selection.target_modules == [f"transformer.h.{i}.{t}" for i in (1, 3) for t in ("attn.c_attn", "mlp.c_fc")]
    assert adapted_layers(model) == {1, 3}
    for _, weight in stiefel_parameters(model):
        assert orthogonality_error(weight.detach()) < 1e-6
    assert len(stiefel_parameters(model)) == 4
    # c_attn: 32 -> 96, c_fc: 32 -> 128; r = 4; LoRA on the 4 layers would have twice these parameters.
    assert selection.trainable_parameters == {1: 4 * (32 + 96) + 4 * (32 + 128), 3: 4 * (32 + 96) + 4 * (32 + 128)}
    assert selection.lora_all_layers_parameters == 4 * selection.trainable_parameters[1]
    assert torch.equal(logits(model, token_batch), logits(tiny_gpt2(), token_batch))


def test_modules_to_save_inside_decoder_layers_follow_the_chosen_layers():
    config = LoraConfig(r=4, target_modules=TARGETS, modules_to_save=["post_attention_layernorm", "lm_head"])
    model, _ = fora_wrap(tiny_llama(), config, [0, 2])
    saved = {n.split(".modules_to_save")[0] for n, p in model.named_parameters() if "modules_to_save" in n}
    assert saved == {
        "base_model.model.model.layers.0.post_attention_layernorm",
        "base_model.model.model.layers.2.post_attention_layernorm",
        "base_model.model.lm_head",
    }
    assert adapted_layers(model) == {0, 2}


def _checkpoint_with_layers(tmp_path, chosen):
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / SCORES_FILE).write_text(json.dumps(FoRASelection(chosen, 4, "model.layers").to_dict()))
    return str(folder)


def test_resume_with_other_explicit_layers_is_refused_naming_both(tmp_path):
    checkpoint = _checkpoint_with_layers(tmp_path, [1, 3])
    never = lambda: pytest.fail("a resumed run is not scored")  # noqa: E731
    message = r"layers=\[0, 2\] differ from the layers \[1, 3\] that checkpoint \S*checkpoint-5"
    with pytest.raises(ValueError, match=message):
        choose_layers(tiny_llama(), FoRAConfig(layers=[2, 0]), seed=0, checkpoint=checkpoint, score=never)
    same = choose_layers(tiny_llama(), FoRAConfig(layers=[3, 1]), seed=0, checkpoint=checkpoint, score=never)
    assert same.chosen == [1, 3]


def test_resume_with_another_budget_warns_that_the_checkpoint_layers_are_kept(tmp_path):
    checkpoint = _checkpoint_with_layers(tmp_path, [1, 3])
    never = lambda: pytest.fail("a resumed run is not scored")  # noqa: E731
    with pytest.warns(UserWarning, match=r"layer_budget=3 gives K=3 layers, but checkpoint .* K=2 layers \[1, 3\]"):
        selection = choose_layers(tiny_llama(), FoRAConfig(layer_budget=3), seed=0, checkpoint=checkpoint, score=never)
    assert selection.chosen == [1, 3] and selection.source == "checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_layers(tiny_llama(), FoRAConfig(), seed=0, checkpoint=checkpoint, score=never).chosen == [1, 3]


def test_a_saved_adapter_and_optimizer_state_hold_each_tensor_on_its_own(llama, token_batch, tmp_path):
    from safetensors.torch import load_file

    model = lora(llama)
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    opt = build_fora_optimizer(model)
    for _ in range(2):
        model(input_ids=token_batch, labels=token_batch).loss.backward()
        opt.step()
        opt.zero_grad()
    lora_b = dict(stiefel_parameters(model))
    first = next(iter(lora_b.values()))
    assert first.untyped_storage().nbytes() == first.numel() * first.element_size()  # its own storage, no more
    expected = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == len(expected)
    for name, value in saved.items():
        key = name.replace(".weight", ".default.weight")
        assert torch.equal(value, expected[key])  # the same values, each tensor on its own
    assert (tmp_path / "adapter_model.safetensors").stat().st_size < sum(v.numel() * 4 for v in saved.values()) + 2**14
    # Reloaded into a fresh model, the adapter gives the trained model's output.
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert torch.allclose(logits(reloaded, token_batch), logits(model, token_batch), atol=1e-6)
    state = opt.state_dict()["state"]
    for entry in state.values():
        for value in entry.values():
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
