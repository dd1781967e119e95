"""The feedback phase on top of an imported pretrained model (docs/interop.md).

fbt-import HF_DIR runs/imported
fbt-train --config=configs/upcycle.py:runs/imported --config.data.path=PREPARED [--config.workdir=...]

The imported model already did the paper's long first phase (one ordinary pass); this run is its
late phase only: the 2/3-pass mixture from step 0, started from the imported parameters
(`init_from`), with the imported model's own architecture, tokenizer, context and Hugging Face
config, a learning rate an order below pretraining's and a warmup that lets the optimizer's
moments settle before the pretrained weights move.
"""

import json

import ml_collections
from etils import epath

from fbt_jax.config import default_config


def get_config(imported: str = "") -> ml_collections.ConfigDict:
    c = default_config()
    if not imported:
        raise ValueError("give the imported run: --config=configs/upcycle.py:RUN (a directory fbt-import wrote)")
    recorded_path = epath.Path(imported) / "config.json"
    if not recorded_path.exists():
        raise ValueError(
            f"{imported} is not a run directory (no config.json); import the model first: fbt-import HF_DIR {imported}"
        )
    recorded = json.loads(recorded_path.read_text())
    c.model.update(recorded["model"])
    c.hf_config = recorded.get("hf_config", "")
    c.init_from = imported
    c.workdir = f"{str(imported).rstrip('/')}-feedback"
    c.data.source = "text"
    c.data.tokenizer = recorded["data"]["tokenizer"]
    c.data.seq_len = recorded["data"]["seq_len"]
    c.passes.schedule = "0:2=0.88,3=0.12"  # the paper's late-phase mixture, from the first step
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 100
    c.optimizer.weight_decay = 0.0  # decay would pull pretrained weights towards zero, not towards where they were
    c.train.steps = 2000
    c.train.batch_size = 32
    c.train.log_every = 20
    c.checkpoint.every_steps = 200
    c.eval.every_steps = 200
    return c
