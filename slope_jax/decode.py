"""`python -m slope_jax.decode`: continue exported KV caches to text with a decode engine (implementation and full
usage in `slope_jax.serve.decode_cli`; `--help` explains every flag)."""

from slope_jax.serve import decode_cli
from slope_jax.serve.decode_cli import run

__doc__ = decode_cli.__doc__  # noqa: A001 - absl prints the main module's docstring as the usage text

if __name__ == "__main__":
    run()
