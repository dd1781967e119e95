"""`python -m fbt_jax.train` is `fbt-train`."""

from fbt_jax.train.cli import cli

cli()
