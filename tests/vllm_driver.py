"""The vLLM driver lives in benchmarks/vllm_driver.py (benchmarks/vllm_connector_load.py runs it too, and benchmarks
import nothing from tests/); this path runs it unchanged for the callers that name tests/vllm_driver.py."""

import os
import runpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
runpy.run_path(os.path.join(REPO, "benchmarks", "vllm_driver.py"), run_name="__main__")
