import pytest
import torch

import policy

MICRO = policy.TinyConfig(seed=0, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, corpus_tasks=300)


@pytest.fixture(scope="session")
def micro_path(tmp_path_factory):
    """A smaller sibling of the embedded tiny model (same recipe and code path), so tests stay fast."""
    return policy.build_tiny(tmp_path_factory.mktemp("micro") / "model", MICRO)


@pytest.fixture(scope="session")
def micro64(micro_path):
    model, tok = policy.load_policy(str(micro_path), dtype=torch.float64)
    return model.eval(), tok
