"""Tiny randomly initialised models and a character tokenizer, built locally: no hub, no download."""

import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


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


def tiny_llama(
    num_layers: int = 4, seed: int = 0, vocab_size: int = 96, hidden_size: int = 32, intermediate_size: int = 64
) -> LlamaForCausalLM:
    config = LlamaConfig(
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
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def token_batch():
    gen = torch.Generator().manual_seed(123)
    return torch.randint(0, 96, (2, 12), generator=gen)
