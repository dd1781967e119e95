"""Generative evaluation: tasks as files, batched decoding in the three modes, scoring, the sandbox."""
