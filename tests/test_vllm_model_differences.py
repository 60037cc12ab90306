"""Checkpoints whose config vLLM's gpt-oss model does not follow are another model there: their exports never load.

The layer pattern: vLLM's gpt-oss model makes the even layers sliding whatever config.layer_types says, while
slope_jax (and transformers) follow layer_types. Exports of a checkpoint of another pattern were loaded anyway and vLLM
decoded wrong tokens (measured on a held-out config: |Δ logprob| up to 1.5 against vLLM's own prefill, prefix caching
off) or failed to place them (prefix caching on: "token 0 maps to the null block"). The connector now compares each
layer's attention in vLLM with layer_types: under the hybrid KV cache manager (vLLM's default) the scheduler refuses
every export, so vLLM prefills each prompt itself (its own tokens, the reason in the status); under the plain
manager, which hides the windows from the scheduler, the worker refuses the load and kv_load_failure_policy decides
(here `recompute`: vLLM's own tokens). Fields vLLM fixes (swiglu_limit, swiglu_alpha, rms_norm_eps, the RoPE type)
are compared with the config by `vllm_plan.vllm_model_differences`, which the same refusal uses.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess

import pytest
from support import REPO, random_prompt
from test_vllm_connector import VLLM_PYTHON, _vllm_env

from slope_jax.kv import vllm_plan as plan
from slope_jax.model.config import ModelConfig

CKPT = os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64")
KINDS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
REASON = (r"layer 0: vLLM runs it with a sliding window of {w}, config.layer_types .* with full attention .*vLLM "
          r"serves another model than the exports hold")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The hd64 checkpoint with layer_types KINDS, exports of two prompts (crossing the window), and two vLLM engines
    over them: the hybrid manager with prefix caching on (vLLM's defaults), and the plain manager with
    kv_load_failure_policy=recompute. Returns (results by engine, logs by engine, prompt lengths, window)."""
    from slope_jax.serve.engine import PrefillEngine

    base = tmp_path_factory.mktemp("kinds")
    ckpt = base / "ckpt"
    shutil.copytree(CKPT, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["layer_types"] != KINDS and len(KINDS) == config["num_hidden_layers"]
    config["layer_types"] = KINDS
    (ckpt / "config.json").write_text(json.dumps(config, indent=1))
    cfg = ModelConfig.from_json(str(ckpt / "config.json"))
    lens = [cfg.sliding_window + 3, 3 * cfg.sliding_window + 1]
    prompts = [random_prompt(cfg, n, seed=70 + n) for n in lens]
    PrefillEngine.from_checkpoint(str(ckpt), dtype="float32", progress=False).prefill(
        prompts, str(base / "kv"), ids=[f"len-{n}" for n in lens])
    phases = [{"requests": [{"id": f"plain/{n}", "prompt": p.tolist(), "params": None} for n, p in zip(lens, prompts)]},
              {"reset_prefix_cache": True, "requests": [
                  {"id": f"export/{n}", "prompt": p.tolist(), "params": {plan.PATH_KEY: str(base / "kv" / f"len-{n}")}}
                  for n, p in zip(lens, prompts)]}]
    results, logs = {}, {}
    for name, spec in {"hybrid": {"hybrid": True, "prefix_caching": True},
                       "plain": {"hybrid": False, "prefix_caching": False, "policy": "recompute"}}.items():
        spec_path, out = base / f"{name}.spec.json", base / f"{name}.out.json"
        spec_path.write_text(json.dumps({"model": str(ckpt), "max_tokens": 8, "phases": phases, **spec}))
        proc = subprocess.run([VLLM_PYTHON, os.path.join(REPO, "tests", "vllm_driver.py"), str(spec_path), str(out)],
                              cwd=str(base), env=_vllm_env(), capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[name], logs[name] = json.loads(out.read_text())["results"], proc.stdout + proc.stderr
    return results, logs, lens, cfg.sliding_window


@pytest.mark.parametrize("engine", ["hybrid", "plain"])
def test_exports_of_another_layer_pattern_are_never_loaded(runs, engine):
    results, logs, lens, window = runs
    got = results[engine]
    for n in lens:
        exp, ref = got[f"export/{n}"], got[f"plain/{n}"]
        assert exp["tokens"] == ref["tokens"], (engine, n)
        # vLLM prefills both itself in one engine: equal up to batch-order rounding (measured 0.0 on every run)
        assert exp["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-5), (engine, n)
        status = exp["kv_transfer_params"][plan.STATUS_KEY]
        assert re.search(REASON.format(w=window), status), (engine, status)
        if engine == "hybrid":  # refused by the scheduler: nothing loaded, vLLM prefilled it
            assert exp["num_cached_tokens"] == 0 and status.startswith("not used: "), status
            assert exp["kv_transfer_params"][plan.LOADED_KEY] == 0
    if engine == "hybrid":
        assert re.search("every export will be refused: " + REASON.format(w=window), logs[engine])


def test_fields_vllm_fixes_are_compared_with_the_config():
    """swiglu_limit, rms_norm_eps and the RoPE type are fixed in vLLM's gpt-oss model: a config with another value is
    another model there (swiglu_limit 0.5 measured: |Δ logprob| up to 0.86 with the export loaded, against vLLM's own
    prefill); every shipped and released config passes."""
    for name in ("gpt-oss-120b.json", "gpt-oss-20b.json", "tiny.json", "tiny-hd64.json", "peer-hd64.json"):
        assert plan.vllm_model_differences(ModelConfig.from_json(os.path.join(REPO, "configs", name))) == [], name
    base = ModelConfig.from_json(os.path.join(CKPT, "config.json"))
    for field, value in (("swiglu_limit", 0.5), ("swiglu_alpha", 1.5), ("rms_norm_eps", 1e-6),
                         ("rope_type", "default")):
        diff = plan.vllm_model_differences(dataclasses.replace(base, **{field: value}))
        assert len(diff) == 1 and re.match(rf"config {field} is {value!r}, vLLM's gpt-oss model uses "
                                           rf"{plan.VLLM_GPT_OSS_FIXED[field]!r} whatever", diff[0]), diff
