"""Tiny randomly initialised models built locally: no hub, no download."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]


def tiny_llama(num_layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
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
