"""Tiny randomly initialised models and a character tokenizer, built locally: no hub, no download; and the README's
code blocks, which tests run as written."""

import re
import string
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


README = Path(__file__).resolve().parent.parent / "README.md"
GPT2_TARGETS = ["c_attn", "c_fc"]  # GPT-2's Conv1D linears: weight (in, out)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # fused (E, ., .) expert Parameters
TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = list(string.printable[:95])


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, plus pad/bos/eos/unk (99 tokens)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_llama_config(
    num_layers: int = 4, vocab_size: int = 96, hidden_size: int = 32, intermediate_size: int = 64
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_llama(
    num_layers: int = 4, seed: int = 0, vocab_size: int = 96, hidden_size: int = 32, intermediate_size: int = 64
) -> LlamaForCausalLM:
    config = tiny_llama_config(num_layers, vocab_size, hidden_size, intermediate_size)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(num_layers: int = 4, seed: int = 0, dropout: float = 0.0, vocab_size: int = 96) -> GPT2LMHeadModel:
    """A GPT-2-style model: Conv1D projections, LayerNorm with biases, nn.Dropout modules at rate ``dropout``."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=64,
        n_embd=32,
        n_layer=num_layers,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def tiny_moe(num_layers: int = 4, seed: int = 0, num_experts: int = 4, vocab_size: int = 96) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE model whose experts are fused Parameters (gate_up_proj (E, 2I, H), down_proj (E, H, I))."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=num_experts,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A folder holding a saved 2-layer tiny Llama and the character tokenizer."""
    folder = tmp_path_factory.mktemp("model")
    tiny_llama(2).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def token_batch():
    gen = torch.Generator().manual_seed(123)
    return torch.randint(0, 96, (2, 12), generator=gen)


def readme_code(language: str, marker: str) -> str:
    """The README's one fenced ``language`` block that holds ``marker``, as written."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), re.M | re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"README.md has {len(found)} {language} blocks holding {marker!r}"
    return found[0]
