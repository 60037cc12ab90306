"""pytest plugin: every multi-device `PrefillEngine` uses the Pallas attention kernel (interpret mode on the CPU),
while single-device engines (the references) keep the pure-JAX path, so the existing parity files compare the
kernel on every CP/PP layout against the reference:

    PYTHONPATH=$PWD:$PWD/tests python -m pytest -p pallas_everywhere \
        tests/test_context_parallel.py tests/test_pipeline.py

Slow (interpret mode), hence not part of the default suite; tests/test_flash_attention.py runs a representative
subset there.
"""

import functools


def pytest_configure(config):
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve import engine

    init = engine.PrefillEngine.__init__

    @functools.wraps(init)
    def patched(self, cfg, params, parallel=ParallelConfig(), *args, **kwargs):
        if parallel.num_devices > 1:
            kwargs["attention_impl"] = "pallas"
        init(self, cfg, params, parallel, *args, **kwargs)
        if parallel.num_devices > 1:
            assert self.impls["attention_impl"] == "pallas"

    engine.PrefillEngine.__init__ = patched
    config.addinivalue_line("markers", "pallas_everywhere: multi-device engines use the Pallas kernel")
