"""`python -m slope_jax.decode`: continue exported KV caches to text with a decode engine (implementation in
`slope_jax.serve.decode_cli`; `--help` explains every flag)."""

from slope_jax.serve.decode_cli import run

if __name__ == "__main__":
    run()
