"""Hugging Face checkpoints in and out: `fbt-import` (a Llama-family model directory → an fbt
run) and `fbt-export` (any run → a Hugging Face directory plus the fusion in its own files).

`hf_config.py` maps configs both ways, `tensors.py` names and lays out every tensor,
`hf_files.py` reads and writes model directories (safetensors only), `importer.py` and
`exporter.py` are the two commands. See docs/interop.md.
"""
