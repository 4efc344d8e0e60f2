"""Adapter diagnostics against hand computations and the paper's Lemma."""

import json
import math
import re

import pytest
import torch
from conftest import TARGETS, tiny_llama
from peft import LoraConfig, get_peft_model

from fora_plugin import make_stiefel
from fora_plugin.diagnostics import delta_w_singular_values, effective_rank
from fora_plugin.report import adapter_report, check_adapter_folder, kl_to_base, markdown_summary, plot_spectra
from fora_plugin.stiefel import random_stiefel


def test_effective_rank_matches_a_hand_computation():
    gen = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(12, 4, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(9, 4, generator=gen, dtype=torch.float64))
    s = [4.0, 2.0, 1.0, 1.0]
    M = U @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ V.T
    p = [x / 8.0 for x in s]
    expected = math.exp(-sum(q * math.log(q) for q in p))  # = exp(1.2130...) ≈ 3.3636
    assert effective_rank(torch.linalg.svdvals(M)) == pytest.approx(expected, rel=1e-12)
    assert effective_rank(torch.tensor([5.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert effective_rank(torch.ones(6)) == pytest.approx(6.0)
    assert effective_rank(torch.zeros(3)) == 0.0


def test_stiefel_b_preserves_the_singular_values_of_a():  # the paper's Lemma
    gen = torch.Generator().manual_seed(1)
    B = random_stiefel(64, 8, generator=gen, dtype=torch.float64)
    A = torch.randn(8, 40, generator=gen, dtype=torch.float64)
    dense = torch.linalg.svdvals(B @ A)[:8]
    assert torch.allclose(dense, torch.linalg.svdvals(A), atol=1e-5)
    assert torch.allclose(delta_w_singular_values(A, B), dense, atol=1e-10)


def test_delta_w_singular_values_of_a_general_b_match_the_dense_product():
    gen = torch.Generator().manual_seed(2)
    B, A = (
        torch.randn(30, 5, generator=gen, dtype=torch.float64),
        torch.randn(5, 20, generator=gen, dtype=torch.float64),
    )
    assert torch.allclose(delta_w_singular_values(A, B), torch.linalg.svdvals(B @ A)[:5], atol=1e-10)


@pytest.fixture
def saved_adapter(tmp_path):
    model = get_peft_model(
        tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=[1, 2])
    )
    make_stiefel(model, init_a="gaussian", generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", model


def test_adapter_report_reads_spectra_ranks_norms_and_orthogonality(saved_adapter, tmp_path):
    adapter_dir, model = saved_adapter
    report = adapter_report(adapter_dir)
    assert report["adapted_layers"] == [1, 2] and set(report["by_type"]) == set(TARGETS)
    q = next(m for m in report["modules"] if m["module"].endswith("layers.1.self_attn.q_proj"))
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    dense = 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # scaling = alpha / r = 2
    expected = torch.linalg.svdvals(dense.double())[:4]
    assert torch.allclose(torch.tensor(q["singular_values"], dtype=torch.float64), expected, atol=1e-5)
    assert q["delta_w_norm"] == pytest.approx(torch.linalg.norm(dense).item(), rel=1e-5)
    assert q["orthogonality_error"] < 1e-6
    assert 1.0 < report["by_type"]["q_proj"]["mean_effective_rank"] <= 4.0
    png = plot_spectra(tmp_path / "spectra.png", {"fora": report})
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "| fora | q_proj | 2 | 1,2 |" in markdown_summary({"fora": report})


def test_kl_to_base_is_zero_at_initialisation_and_positive_after_a_change():
    from conftest import char_tokenizer

    tokenizer = char_tokenizer()
    model = get_peft_model(tiny_llama(vocab_size=99), LoraConfig(r=4, target_modules=TARGETS))
    make_stiefel(model)  # A = 0: the adapted model is the base model
    assert kl_to_base(model, tokenizer, "hello world, hello fora") == pytest.approx(0.0, abs=1e-7)
    make_stiefel(model, init_a="gaussian", generator=torch.Generator().manual_seed(3))
    assert kl_to_base(model, tokenizer, "hello world, hello fora") > 1e-6


def test_a_non_adapter_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"is not a PEFT adapter folder"):
        adapter_report(tmp_path)


def test_kl_to_base_gives_the_model_back_in_its_mode():
    from conftest import char_tokenizer

    model = get_peft_model(tiny_llama(vocab_size=99), LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.1))
    model.train()
    kl_to_base(model, char_tokenizer(), "hello fora")
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    kl_to_base(model, char_tokenizer(), "hello fora")
    assert not any(m.training for m in model.modules())


def test_report_scales_each_module_by_its_rank_and_alpha_pattern(tmp_path):
    # Reference: PEFT's own ΔW of each module (get_delta_weight: scaling · B A with that module's r and alpha).
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"v_proj": 2, "layers.0.self_attn.q_proj": 3},
        alpha_pattern={"layers.1.self_attn.q_proj": 32},
    )
    model = get_peft_model(tiny_llama(), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "adapter")
    report = adapter_report(tmp_path / "adapter")
    for m in report["modules"]:
        layer = model.get_submodule(m["module"])
        expected = torch.linalg.svdvals(layer.get_delta_weight("default").double())[: m["rank"]]
        assert m["rank"] == (
            2 if m["type"] == "v_proj" else 3 if m["module"].endswith("layers.0.self_attn.q_proj") else 4
        )
        found = torch.tensor(m["singular_values"], dtype=torch.float64)
        assert torch.allclose(found, expected, rtol=1e-5), m["module"]
    q1 = next(m for m in report["modules"] if m["module"].endswith("layers.1.self_attn.q_proj"))
    assert q1["scaling"] == 8.0  # alpha 32 / r 4
    q = report["by_type"]["q_proj"]  # ranks 3 and 4 in one type
    assert q["rank"] == 4 and len(q["mean_normalised_spectrum"]) == 4
    q_modules = [m for m in report["modules"] if m["type"] == "q_proj"]
    expected_ratio = sum(m["effective_rank"] / m["rank"] for m in q_modules) / len(q_modules)
    assert q["effective_rank_ratio"] == pytest.approx(expected_ratio)


def test_report_refuses_an_adapter_holding_nan(saved_adapter):
    adapter_dir, _ = saved_adapter
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, adapter_dir / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=rf"holds NaN/inf weights in 1 tensors \({re.escape(key)}\).*diverged"):
        adapter_report(adapter_dir)


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}, {"use_rslora": True}])
def test_merged_delta_weight_is_merged_minus_base_for_lora_dora_and_rslora(variant):
    import copy

    from peft.tuners.lora import LoraLayer

    from fora_plugin.report import merged_delta_weight, merged_mean_effective_rank

    base = tiny_llama()
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **variant))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # DoRA's magnitude too: ΔW then rescales W's columns
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    # Reference: PEFT's merge_and_unload of a float64 copy, minus the base weights.
    merged = copy.deepcopy(model).double().merge_and_unload()
    base_weights = dict(base.double().named_parameters())
    ranks = []
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            key = name.removeprefix("base_model.model.") + ".weight"
            expected = dict(merged.named_parameters())[key] - base_weights[key]
            delta = merged_delta_weight(module, "default")
            assert torch.allclose(delta, expected, atol=1e-12), name
            ranks.append(effective_rank(torch.linalg.svdvals(expected)))
    assert merged_mean_effective_rank(model) == pytest.approx(sum(ranks) / len(ranks), rel=1e-9)
    if variant.get("use_dora"):  # the magnitude makes ΔW full rank: B·A alone (rank 4) would under-report it
        assert merged_mean_effective_rank(model) > 4.5


def test_report_refuses_a_selection_of_other_layers_than_the_adapters(saved_adapter):
    import json

    adapter_dir, _ = saved_adapter
    (adapter_dir / "fora_scores.json").write_text(
        json.dumps({"chosen_layers": [1, 2], "num_layers": 4, "scores": None})
    )
    assert adapter_report(adapter_dir)["fora_scores"]["chosen_layers"] == [1, 2]
    (adapter_dir / "fora_scores.json").write_text(
        json.dumps({"chosen_layers": [0, 3], "num_layers": 4, "scores": None})
    )
    with pytest.raises(
        ValueError, match=r"says layers \[0, 3\] were chosen, but the adapter .* is on layers \[1, 2\]"
    ):
        adapter_report(adapter_dir)


def test_report_refuses_a_config_whose_r_is_not_the_weights(saved_adapter):
    import json

    adapter_dir, _ = saved_adapter
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ValueError, match=r"r=8 is invalid: the weights of 10 modules have another rank .*rank 4"):
        adapter_report(adapter_dir)


def _adapter(folder, **lora):
    get_peft_model(tiny_llama(2), LoraConfig(target_modules=["q_proj", "v_proj"], **lora)).save_pretrained(folder)
    return folder


def test_adapter_config_must_match_the_weights_ranks(tmp_path):
    plain = _adapter(tmp_path / "plain", r=4)
    assert check_adapter_folder(plain, "adapter")["r"] == 4
    patterned = _adapter(tmp_path / "patterned", r=4, rank_pattern={"v_proj": 2})
    check_adapter_folder(patterned, "adapter")  # rank_pattern's ranks are the config's too
    config = json.loads((plain / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ValueError, match=r"adapter adapter_config\.json r=8 is invalid: the weights of 4 modules"):
        check_adapter_folder(plain, "adapter")
    (plain / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 0}))
    with pytest.raises(ValueError, match=r"lora_alpha=0 is invalid"):
        check_adapter_folder(plain, "adapter")
