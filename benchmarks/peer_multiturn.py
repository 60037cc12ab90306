"""Multi-turn prefill with prefix reuse: slope_jax vs vLLM-CPU (prefix caching on), identical weights, turn by turn.

    python benchmarks/peer_multiturn.py                                   # both traces, full size, bf16
    python benchmarks/peer_multiturn.py --doc_tokens=1024 --turns=2 --qa_doc_tokens=1024 --questions=2 \
        --out=/tmp/pm.json                                                # smoke test, a few minutes

Two traces (random token ids from `--seed`; every turn re-sends the whole conversation):
- agent: a `--doc_tokens` document (turn 0, cold), then `--turns` follow-ups, each adding an "assistant answer" of
  `--answer_tokens` and a user message of `--message_min`..`--message_max` tokens (turn k = turn k−1 + answer +
  message);
- docqa: one `--qa_doc_tokens` document, `--questions` questions of `--question_min`..`--question_max` tokens,
  each prompt = document + question (turn 0 is cold, the others share the document).

Engines, on the dense peer checkpoint of benchmarks/peer_cpu.py (configs/peer-hd64.json), in `--dtype`:
- slope_jax: `PrefillEngine` with its defaults (prefix reuse on: host-memory tier), ONE CPU device, in this process.
  TTFT = the result's `compute_ms` (step start → first token on the host); also the wall time of the `prefill` call
  (the prefix lookup, the cached rows' copy to the device, the step, keeping the prompt's KV in the host tier).
- vLLM-CPU: one persistent process per trace (benchmarks/vllm_turns.py) with `enable_prefix_caching=True`, eager,
  every core bound to its OpenMP compute threads (`VLLM_CPU_OMP_THREADS_BIND` = all cores,
  `VLLM_CPU_NUM_OF_RESERVED_CPU=0`, `VLLM_CPU_ATTN_SPLIT_KV=0`). TTFT = wall time of
  `generate(prompt_token_ids, SamplingParams(max_tokens=1, temperature=0))` inside the vLLM process.
Method per trace: a warm-up pass over a trace of the same shapes with other random tokens (compiles slope_jax's
programs — their compile time is reported apart —, warms vLLM), then both prefix caches are emptied (slope_jax: a
fresh `HostTier`; vLLM: `reset_prefix_cache()`) and the real trace is timed, turn by turn, the engines alternating
(which one goes first flips every turn), with a `--settle_s` pause before each call (vLLM's worker process
busy-polls its queue for 1 s after a step, which would take a core from slope_jax's next step). Timings are
warm-program: no compile inside a timed turn (checked).

Prints per trace a table (per turn: tokens, cached tokens of each engine, TTFTs, ratio, first tokens) and the
"cold first turn" and "follow-up turns total" ratios against the issue-30 goals (≤ 0.6 and ≤ 0.5); writes JSON via
common.write_result (default benchmarks/measured/cpu/peer_multiturn.json).
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GOAL_COLD, GOAL_FOLLOWUPS = 0.6, 0.5


def agent_trace(lens, toks, vocab: int, doc: int, turns: int, answer: int, msg_min: int, msg_max: int
                ) -> list[list[int]]:
    """Turn 0: the document; turn k: turn k−1 + an answer of `answer` tokens + a message of msg_min..msg_max.
    `lens` (a NumPy Generator) draws the message lengths, `toks` the token ids: the same `lens` seed with another
    `toks` seed gives a trace of the same shapes with other tokens."""
    hi = vocab - 16
    prompts = [toks.integers(0, hi, doc).tolist()]
    for _ in range(turns):
        prompts.append(prompts[-1] + toks.integers(0, hi, answer + int(lens.integers(msg_min, msg_max + 1))).tolist())
    return prompts


def docqa_trace(lens, toks, vocab: int, doc: int, questions: int, q_min: int, q_max: int) -> list[list[int]]:
    """Each prompt: the same document + its own question of q_min..q_max tokens (`lens`, `toks`: as agent_trace)."""
    hi = vocab - 16
    d = toks.integers(0, hi, doc).tolist()
    return [d + toks.integers(0, hi, int(lens.integers(q_min, q_max + 1))).tolist() for _ in range(questions)]


def run_trace(name: str, prompts: list[list[int]], warm: list[list[int]], eng, vllm, *, log, settle_s: float = 0.0
              ) -> dict:
    """Warm-up pass on `warm`, caches emptied, then `prompts` timed turn by turn, engines alternating. `settle_s`:
    a pause before each engine call, so that neither runs while the other is still busy (vLLM's worker process
    busy-polls its shared-memory queue for 1 s after each step before it idles: `shm_broadcast.SpinCondition`)."""
    import numpy as np

    from slope_jax.kv.prefix import HostTier

    def vllm_turn(p):
        time.sleep(settle_s)
        return vllm.generate(p)

    def slope_turn(p):
        time.sleep(settle_s)
        t, c = time.perf_counter(), time.process_time()
        r = eng.prefill([np.asarray(p, np.int32)], return_kv=False)[0]
        wall, cpu = time.perf_counter() - t, time.process_time() - c  # cpu: this process's CPU seconds (all threads)
        return {"compute_s": r.compute_ms / 1e3, "wall_s": wall, "cpu_s": cpu, "queue_s": r.queue_ms / 1e3,
                "compile_s": r.compile_ms / 1e3, "cached_tokens": int(r.cached_tokens),
                "first_token": int(r.first_token), "step_key": list(eng.step_key(len(p), int(r.cached_tokens)))}

    warmup, compile_s = [], 0.0  # compile_s: getting each turn's program (compiling, or a lookup when compiled)
    eng.host_tier = HostTier(eng.reuse.host_bytes)
    for k, p in enumerate(warm):
        v, s = vllm_turn(p), slope_turn(p)
        compile_s += s["compile_s"]
        warmup.append({"turn": k, "tokens": len(p), "vllm": v, "slope_jax": s})
        log(f"  [{name} warm-up] turn {k}: {len(p)} tokens  vLLM {v['seconds']:.2f} s (cached "
            f"{v['num_cached_tokens']})  slope_jax {s['compute_s']:.2f} s (cached {s['cached_tokens']}, compile "
            f"{s['compile_s']:.1f} s)")
    eng.host_tier = HostTier(eng.reuse.host_bytes)
    reset = vllm.reset()
    programs = len(eng.compile_ms)  # compiled step programs (a timed turn must not add one)
    turns = []
    for k, p in enumerate(prompts):
        if k % 2 == 0:
            v = vllm_turn(p)
            s = slope_turn(p)
        else:
            s = slope_turn(p)
            v = vllm_turn(p)
        row = {"turn": k, "tokens": len(p), "new_tokens": len(p) - s["cached_tokens"], "first": "vllm" if k % 2 == 0
               else "slope_jax", "vllm": v, "slope_jax": s, "ratio_compute": s["compute_s"] / v["seconds"],
               "ratio_wall": s["wall_s"] / v["seconds"], "same_first_token": v["first_token"] == s["first_token"],
               "loadavg": os.getloadavg()[0]}
        turns.append(row)
        log(f"  [{name}] turn {k}: {len(p)} tokens  vLLM {v['seconds']:.3f} s (cached {v['num_cached_tokens']})  "
            f"slope_jax {s['compute_s']:.3f} s / wall {s['wall_s']:.3f} s (cached {s['cached_tokens']})  "
            f"ratio {row['ratio_compute']:.2f}  tokens {v['first_token']}/{s['first_token']}")
    return {"trace": name, "turns": turns, "warmup": warmup, "warmup_compile_s": compile_s,
            "compiled_in_timed_turns": len(eng.compile_ms) > programs,
            "vllm_reset_prefix_cache": reset, "vllm_init_s": vllm.init_s, "summary": summarize(turns)}


def summarize(turns: list[dict]) -> dict:
    first, rest = turns[0], turns[1:]
    v_rest = sum(t["vllm"]["seconds"] for t in rest)
    s_rest = sum(t["slope_jax"]["compute_s"] for t in rest)
    w_rest = sum(t["slope_jax"]["wall_s"] for t in rest)
    return {
        "cold_first_turn": {"vllm_s": first["vllm"]["seconds"], "slope_jax_s": first["slope_jax"]["compute_s"],
                            "slope_jax_wall_s": first["slope_jax"]["wall_s"], "ratio": first["ratio_compute"],
                            "ratio_wall": first["ratio_wall"], "goal": GOAL_COLD,
                            "meets_goal": first["ratio_compute"] <= GOAL_COLD},
        "followup_turns_total": {"turns": len(rest), "vllm_s": v_rest, "slope_jax_s": s_rest,
                                 "slope_jax_wall_s": w_rest, "ratio": s_rest / v_rest if v_rest else None,
                                 "ratio_wall": w_rest / v_rest if v_rest else None, "goal": GOAL_FOLLOWUPS,
                                 "meets_goal": bool(v_rest) and s_rest / v_rest <= GOAL_FOLLOWUPS},
        "followup_turns_both_hit": _both_hit(rest),
        "first_tokens_agree": sum(t["same_first_token"] for t in turns), "turns": len(turns),
    }


def _both_hit(rest: list[dict]) -> dict:
    """The follow-up turns where both engines reused a cached prefix (vLLM's hybrid sliding-window prefix cache misses
    a prompt that branches off before its last window: docqa's first question recomputes the whole document)."""
    both = [t for t in rest if t["slope_jax"]["cached_tokens"] and t["vllm"]["num_cached_tokens"]]
    v = sum(t["vllm"]["seconds"] for t in both)
    s = sum(t["slope_jax"]["compute_s"] for t in both)
    return {"turns": [t["turn"] for t in both], "vllm_s": v, "slope_jax_s": s, "ratio": s / v if v else None}


def print_table(res: dict, dtype: str) -> None:
    print(f"\n{res['trace']} ({dtype}; warm-program timings: slope_jax compiled its programs during the warm-up pass, "
          f"{res['warmup_compile_s']:.1f} s, not counted)")
    print(f"{'turn':>4} {'tokens':>7} {'cached sj':>9} {'cached vL':>9} {'vLLM s':>8} {'slope s':>8} {'wall s':>7} "
          f"{'ratio':>6} {'wall r':>6} {'1st tok vL/sj':>14}")
    for t in res["turns"]:
        v, s = t["vllm"], t["slope_jax"]
        vc = v["num_cached_tokens"] if v["num_cached_tokens"] is not None else "-"
        print(f"{t['turn']:>4} {t['tokens']:>7} {s['cached_tokens']:>9} {vc:>9} {v['seconds']:>8.3f} "
              f"{s['compute_s']:>8.3f} {s['wall_s']:>7.3f} {t['ratio_compute']:>6.2f} {t['ratio_wall']:>6.2f} "
              f"{str(v['first_token']) + '/' + str(s['first_token']):>14}")
    c, f = res["summary"]["cold_first_turn"], res["summary"]["followup_turns_total"]
    print(f"cold first turn:       vLLM {c['vllm_s']:.3f} s  slope_jax {c['slope_jax_s']:.3f} s (wall "
          f"{c['slope_jax_wall_s']:.3f})  ratio {c['ratio']:.2f} (wall {c['ratio_wall']:.2f})  goal ≤ {GOAL_COLD}")
    if f["turns"]:
        print(f"follow-up turns total: vLLM {f['vllm_s']:.3f} s  slope_jax {f['slope_jax_s']:.3f} s (wall "
              f"{f['slope_jax_wall_s']:.3f})  ratio {f['ratio']:.2f} (wall {f['ratio_wall']:.2f})  goal ≤ "
              f"{GOAL_FOLLOWUPS}")
    b = res["summary"]["followup_turns_both_hit"]
    if b["ratio"] is not None and len(b["turns"]) != f["turns"]:
        print(f"follow-up turns where both engines hit ({len(b['turns'])}): vLLM {b['vllm_s']:.3f} s  slope_jax "
              f"{b['slope_jax_s']:.3f} s  ratio {b['ratio']:.2f}")
    print(f"first tokens agree: {res['summary']['first_tokens_agree']}/{res['summary']['turns']} turns"
          f"{'' if res['compiled_in_timed_turns'] is False else '  (WARNING: a timed turn compiled)'}")


def main(argv):
    del argv
    from absl import flags

    F = flags.FLAGS
    from slope_jax import xla_env

    xla_env.configure(cpu_devices=1)  # one CPU device
    from common import start_load, write_result
    from peer_cpu import CONFIG, ensure_checkpoint, ensure_vllm
    from vllm_turns import VllmTurns

    import numpy as np

    from slope_jax.serve.engine import PrefillEngine

    load0 = start_load()
    ensure_checkpoint(F.checkpoint_dir)
    ensure_vllm(F.vllm_python)
    t0 = time.perf_counter()
    eng = PrefillEngine.from_checkpoint(F.checkpoint_dir, dtype=F.dtype, progress=False)
    init_s = time.perf_counter() - t0
    vocab = eng.cfg.vocab_size
    rng = np.random.default_rng
    traces = {}
    for name in F.traces:
        def make(tok_seed, name=name):
            if name == "agent":
                return agent_trace(rng(F.seed), rng(tok_seed), vocab, F.doc_tokens, F.turns, F.answer_tokens,
                                   F.message_min, F.message_max)
            return docqa_trace(rng(F.seed), rng(tok_seed), vocab, F.qa_doc_tokens, F.questions, F.question_min,
                               F.question_max)
        traces[name] = (make(F.seed + 1000), make(F.seed + 2000))  # (timed trace, warm-up trace: same shapes)
    results = []
    for name, (prompts, warm) in traces.items():
        assert [len(p) for p in warm] == [len(p) for p in prompts]
        spec = {"model": F.checkpoint_dir, "dtype": F.dtype, "max_model_len": max(map(len, prompts)) + 16,
                "kv_cache_bytes": F.vllm_kv_cache_bytes, "prefix_caching": True, "eager": True}
        print(f"{name}: {len(prompts)} turns, {len(prompts[0])}..{len(prompts[-1])} tokens; starting vLLM", flush=True)
        vllm = VllmTurns(F.vllm_python, spec, os.path.join(F.vllm_log_dir, f"vllm_{name}.log"), REPO)
        try:
            res = run_trace(name, prompts, warm, eng, vllm, log=lambda s: print(s, flush=True), settle_s=F.settle_s)
        finally:
            vllm.close()
        results.append(res)
        print_table(res, F.dtype)
    payload = {"config": CONFIG, "checkpoint": F.checkpoint_dir, "dtype": F.dtype, "cpus": os.cpu_count(),
               "slope_jax": {"devices": 1, "init_s": init_s, "reuse": {"block_size": eng.reuse.block_size,
                                                                        "host_bytes": eng.reuse.host_bytes}},
               "vllm": {"prefix_caching": True, "mode": "eager", "env": _vllm_env_shown()},
               "timings": "warm-program: slope_jax's programs compiled in a warm-up pass of the same shapes "
                          "(warmup_compile_s), then prefix caches emptied and the trace timed",
               "goals": {"cold_first_turn": GOAL_COLD, "followup_turns_total": GOAL_FOLLOWUPS},
               "traces": results}
    write_result(F.out, payload, load_start=load0)
    print(f"\nwrote {F.out}")


def _vllm_env_shown() -> dict:
    from vllm_turns import vllm_env

    e = vllm_env()
    return {k: e[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_ATTN_SPLIT_KV")}


def _define_flags():
    from absl import flags

    flags.DEFINE_list("traces", ["agent", "docqa"], "Which traces to run.")
    flags.DEFINE_integer("doc_tokens", 8192, "agent: the document's tokens (turn 0).")
    flags.DEFINE_integer("turns", 6, "agent: follow-up turns after the document.")
    flags.DEFINE_integer("answer_tokens", 64, "agent: tokens of each assistant answer.")
    flags.DEFINE_integer("message_min", 200, "agent: fewest tokens of a new user message.")
    flags.DEFINE_integer("message_max", 400, "agent: most tokens of a new user message.")
    flags.DEFINE_integer("qa_doc_tokens", 16384, "docqa: the document's tokens.")
    flags.DEFINE_integer("questions", 8, "docqa: questions (turns).")
    flags.DEFINE_integer("question_min", 50, "docqa: fewest tokens of a question.")
    flags.DEFINE_integer("question_max", 150, "docqa: most tokens of a question.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Both engines' dtype.")
    flags.DEFINE_float("settle_s", 2.0, "Pause before each engine call (vLLM's worker busy-polls for 1 s after a "
                       "step).")
    flags.DEFINE_integer("seed", 0, "Random token ids of the trace (the warm-up trace: seed + 1).")
    flags.DEFINE_integer("vllm_kv_cache_bytes", 1 << 30, "vLLM's KV cache (bytes).")
    flags.DEFINE_string("checkpoint_dir", "/tmp/slope_jax_peer_hd64", "The dense peer checkpoint (peer_cpu.py).")
    flags.DEFINE_string("vllm_python", os.environ.get("SLOPE_VLLM_PYTHON",
                                                      os.path.join(REPO, ".venv-vllm", "bin", "python")),
                        "python of the vLLM venv.")
    flags.DEFINE_string("vllm_log_dir", "/tmp", "Where vLLM's logs go (vllm_<trace>.log).")
    flags.DEFINE_string("out", "benchmarks/measured/cpu/peer_multiturn.json", "JSON output path.")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    from absl import app

    _define_flags()
    app.run(main)
