import os

# Tests run on the CPU with 8 simulated devices, so that meshes can be tested on one machine
# (single-device references pass `devices=jax.devices()[:1]`).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import pytest  # noqa: E402

from fbt_jax.model import ModelConfig, build_model  # noqa: E402


def small_model_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=16, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64)
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(scope="module")
def small_model():
    return build_model(small_model_config(), seed=0)
