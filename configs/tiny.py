"""Tiny CPU config: a 2-layer model on the S3 word problem, about a minute on 2 CPU cores.

fbt-train --config=configs/tiny.py [--config.train.steps=100 ...]
"""

from fbt_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/tiny"
    c.data.group = "S3"  # smallest non-abelian group: hard enough that feedback passes help
    c.data.seq_len = 16
    # The model is the default one (width 64, 2 layers, 4 heads, MLP 256), with 2 kv heads and
    # S3's 6 group elements as its vocabulary; batch 32 and learning rate 3e-3 are defaults too.
    c.model.vocab_size = 6
    c.model.num_kv_heads = 2
    c.train.steps = 3000
    c.train.log_every = 50
    c.optimizer.warmup_steps = 50
    return c
