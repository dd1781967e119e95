"""Data: synthetic tasks, prepared text and TFDS sources, packing, and the step-indexed pipeline."""
