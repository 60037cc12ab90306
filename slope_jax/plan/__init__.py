"""The cost model and SLO planner (no JAX needed to import): FLOPs (`flops`), collective bytes per link (`traffic`),
memory (`memory`), hardware profiles (`hardware`), predicted TTFT (`model.predict`), layout search and goodput
(`search`), compiled-HLO readers (`hlo`). CLI: `python -m slope_jax.plan` (or `slope-plan`).
"""

from slope_jax.plan.hardware import Hardware, HardwareError, load as load_hardware
from slope_jax.plan.model import Prediction, predict
from slope_jax.plan.search import choose_layout, enumerate_layouts, plan

__all__ = ["Hardware", "HardwareError", "Prediction", "choose_layout", "enumerate_layouts", "load_hardware", "plan",
           "predict"]
