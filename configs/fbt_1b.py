"""A ~1B-parameter Full-Bandwidth Transformer, sized like the paper's 1B model.

Training it needs an accelerator pod; on a CPU it only builds (abstractly) and validates. The
data section still points at the built-in task: a real run points it at a dataset prepared by
fbt-prepare with `seq_len` 2048 (docs/data.md, "A real run"):
    --config.data.source=text --config.data.path=gs://bucket/prepared/web-2048
and the run takes the dataset's tokenizer; `model.vocab_size` must cover its ids (a larger
tokenizer than cl100k's, e.g. Llama 3's 128,256 ids, needs --config.model.vocab_size=128256).
"""

from fbt_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/fbt_1b"
    c.data.seq_len = 2048
    c.model.vocab_size = 100_352  # a cl100k-sized tokenizer, padded to a multiple of 128
    c.model.embed_dim = 2048
    c.model.num_layers = 18
    c.model.num_heads = 16
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 5376
    c.model.rope_theta = 500_000.0
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "bfloat16"
    c.model.scan_layers = True  # compile time flat in depth
    # Memory, chosen by the TPU compiler (benchmarks/compile_memory.py, docs/launch.md): on a v5e-64
    # slice the least recompute that fits K = 1, 2 and 3 with 10% of the 15.75 GiB free is `block`
    # (keep each block's input, recompute the rest in the backward pass) over the whole batch at
    # once: 6.7 / 8.7 / 11.3 GiB per chip. Keeping more (`save_matmuls_no_batch`, `none`) does not
    # fit K = 3 even in 4 microbatches. The (tokens × 100k) logits are never held at once.
    c.model.remat = "block"
    c.model.loss_chunk_size = 256
    # A 64-chip slice: FSDP within groups of 8, data parallel across them. Compile for it from any
    # machine: fbt-train --config=configs/fbt_1b.py --config.dry_run=True --config.dry_run_topology=v5e:8x8
    # (without libtpu the dry run simulates the 64 devices with the CPU compiler).
    c.mesh.data = -1
    c.mesh.fsdp = 8
    c.mesh.tensor = 1
    c.dry_run_devices = 64
    c.dry_run_chip = "v5e"
    c.train.steps = 100_000  # 100k steps × 512 × 2048 tokens ≈ 100B tokens
    c.train.batch_size = 512
    c.train.microbatches = 1
    c.train.log_every = 50
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 2000
    c.eval.batch_size = 512
    c.eval.num_batches = 20
    c.eval.every_steps = 5000
    return c
