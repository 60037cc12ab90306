"""`python -m slope_jax.launch`: the per-host prefill launcher (implementation in `slope_jax.serve.launcher`)."""

from slope_jax.serve.launcher import run

if __name__ == "__main__":
    run()
