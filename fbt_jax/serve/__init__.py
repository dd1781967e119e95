"""fbt-serve: a trained run behind an OpenAI-compatible API (docs/serving.md)."""
