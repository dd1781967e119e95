"""The configs the benchmarks measure: configs/tiny.py and configs/fbt_1b.py as they are, and the
tiny config with a CPU-sized model (the task, optimizer and schedule stay tiny's); and the
Trainer that times a config's train step for every K."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))

from fbt_1b import get_config as fbt_1b_config  # noqa: E402
from tiny import get_config as tiny_config  # noqa: E402

__all__ = ["cpu_medium_config", "every_k_trainer", "fbt_1b_config", "nanodo_configs", "sized_config", "tiny_config"]


def sized_config(seq_len: int | None = None, batch_size: int | None = None, **model):
    """configs/tiny.py with the model fields in `model` (e.g. embed_dim=256) and, where given,
    another sequence length and batch size."""
    c = tiny_config()
    for name, value in model.items():
        c.model[name] = value
    if seq_len is not None:
        c.data.seq_len = seq_len
    if batch_size is not None:
        c.train.batch_size = batch_size
    return c


def cpu_medium_config():
    """D=256, L=4 on batches of 8 × 128 tokens: the bigger CPU model of step_cost and data_throughput."""
    return sized_config(
        seq_len=128, batch_size=8, embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=4, mlp_dim=1024
    )


def nanodo_configs() -> dict:
    """The two shapes compared with nanodo on this CPU (issue #12), at a real vocabulary (32768):
    D256 L4 H4 T256 B16 and D512 L6 H8 T256 B8. The SwiGLU width is 8D/3, so that its three
    matrices cost what nanodo's two 4D-wide ones do."""
    return {
        f"D{d}_L{layers}_B{batch}": sized_config(
            seq_len=256,
            batch_size=batch,
            vocab_size=32768,
            embed_dim=d,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads,
            mlp_dim=8 * d // 3,
        )
        for d, layers, heads, batch in ((256, 4, 4, 16), (512, 6, 8, 8))
    }


def every_k_trainer(config, devices):
    """A quiet Trainer for `config` on `devices` whose schedule draws every K in 1..3 (so each K's
    program is compiled) and which compiles no eval program."""
    from fbt_jax.train.trainer import Trainer

    config.passes.schedule = "0:1=0.4,2=0.3,3=0.3"
    config.eval.num_batches = 0
    return Trainer(config, log=lambda *_: None, devices=devices)
