"""pytest plugin: every multi-device `PrefillEngine` uses the Pallas kernels (interpret mode on the CPU): the flash
attention kernel and the grouped MXFP4 MoE kernel (`SLOPE_PALLAS_EVERYWHERE=attention` for attention only), while
single-device engines (the references) keep the pure-JAX paths, so the existing parity files compare the kernels on
every CP/PP/EP layout against the reference:

    PYTHONPATH=$PWD:$PWD/tests python -m pytest -p pallas_everywhere \
        tests/test_context_parallel.py tests/test_pipeline.py tests/test_expert_parallel.py

Slow (interpret mode), hence not part of the default suite; tests/test_flash_attention.py runs a representative
subset there.
"""

import functools
import os


def pytest_configure(config):
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve import engine

    init = engine.PrefillEngine.__init__
    kernels = {"attention_impl": "pallas"}
    if os.environ.get("SLOPE_PALLAS_EVERYWHERE", "attention,moe") != "attention":
        kernels["moe_impl"] = "pallas"

    @functools.wraps(init)
    def patched(self, cfg, params, parallel=ParallelConfig(), *args, **kwargs):
        patch = parallel.num_devices > 1 and kwargs.get("options") is None  # (options= and fields do not mix)
        if patch:
            kwargs.update(kernels)
        init(self, cfg, params, parallel, *args, **kwargs)
        if patch:
            assert all(self.impls[k] == v for k, v in kernels.items()), self.impls

    engine.PrefillEngine.__init__ = patched
    config.addinivalue_line("markers", "pallas_everywhere: multi-device engines use the Pallas kernels")
