"""Tiny CPU config: a 2-layer model on the S3 word problem, about a minute on 2 CPU cores.

fbt-train --config=configs/tiny.py [--config.train.steps=100 ...]
"""

from fbt_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/tiny"
    c.data.group = "S3"  # smallest non-abelian group: hard enough that feedback passes help
    c.data.seq_len = 16
    c.model.vocab_size = 6
    c.model.embed_dim = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 256
    c.train.steps = 3000
    c.train.batch_size = 32
    c.train.log_every = 50
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 50
    return c
