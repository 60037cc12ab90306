"""Prefix hits under two `prefix_kv_tile` settings, alternated in one process: a same-conditions A/B of the tiles.

    python benchmarks/prefix_tile_ab.py                                   # 2048 vs 256, two hit shapes, 5 rounds
    python benchmarks/prefix_tile_ab.py --cases=1024+100 --rounds=2 --out=/tmp/ab.json     # smoke, ~1 minute

One `PrefillEngine` per tile setting (`StepOptions(prefix_kv_tile=...)`, every other option its default), ONE CPU
device, `--dtype`, on the dense peer checkpoint of benchmarks/peer_cpu.py (configs/peer-hd64.json). Per case
`P+N` (P cached tokens, a whole number of 128-token blocks; N new): random ids (seed 0); each engine first compiles
its programs (an untimed prefill of the prefix and one hit). Then `--rounds` rounds; in each, every engine in turn
(the order flips every round) gets a fresh host tier, prefills the prefix (untimed) and the whole prompt, whose
`compute_ms` (step start → first token) is recorded; the hit must report P cached tokens. Medians per setting and
their ratio to the first setting; on a shared 2-core machine single hits scatter by up to ~1.8×, so read the
medians. Prints a table; writes JSON via common.write_result (default benchmarks/measured/cpu/prefix_tile_ab.json).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run_case(engines: dict, cached: int, new: int, rounds: int, seed: int) -> dict:
    """Alternated hits of `new` tokens over `cached` cached ones; `{tile: [compute ms per round]}`."""
    import numpy as np

    from slope_jax.kv.prefix import HostTier

    rng = np.random.default_rng(seed)
    doc = rng.integers(0, 30000, cached).astype(np.int32)
    prompt = np.concatenate([doc, rng.integers(0, 30000, new).astype(np.int32)])

    def hit(eng) -> float:
        eng.host_tier = HostTier(eng.reuse.host_bytes)
        eng.prefill([doc], return_kv=False)
        r = eng.prefill([prompt], return_kv=False)[0]
        if r.cached_tokens != cached:
            raise RuntimeError(f"expected a hit of {cached} cached tokens, got {r.cached_tokens}")
        return r.compute_ms

    for eng in engines.values():  # compile both programs (prefix, hit) untimed
        hit(eng)
    times: dict[int, list[float]] = {tile: [] for tile in engines}
    order = list(engines)
    for r in range(rounds):
        for tile in (order if r % 2 == 0 else order[::-1]):
            times[tile].append(hit(engines[tile]))
    return times


def main(argv):
    del argv
    from absl import flags

    F = flags.FLAGS
    from slope_jax import xla_env

    xla_env.configure(cpu_devices=1)
    import numpy as np
    from common import start_load, write_result
    from peer_cpu import ensure_checkpoint

    from slope_jax.model.options import StepOptions
    from slope_jax.serve.engine import PrefillEngine

    load0 = start_load()
    ensure_checkpoint(F.checkpoint_dir)
    tiles = [int(t) for t in F.tiles]
    engines = {t: PrefillEngine.from_checkpoint(F.checkpoint_dir, dtype=F.dtype, progress=False,
                                                options=StepOptions(prefix_kv_tile=t)) for t in tiles}
    rows = []
    print(f"| cached + new | {' | '.join(f'prefix_kv_tile {t}: median ms (rounds)' for t in tiles)} | "
          f"median / {tiles[0]}'s |")
    print("|---" * (len(tiles) + 2) + "|")
    for case in F.cases:
        cached, new = (int(x) for x in case.split("+"))
        times = run_case(engines, cached, new, F.rounds, F.seed)
        med = {t: float(np.median(v)) for t, v in times.items()}
        ratios = {t: med[t] / med[tiles[0]] for t in tiles}
        rows.append({"cached": cached, "new": new, "times_ms": {str(t): v for t, v in times.items()},
                     "median_ms": {str(t): m for t, m in med.items()}, "ratio_median": {str(t): r for t, r in
                                                                                        ratios.items()}})
        cells = [f"{med[t]:.0f} ({', '.join(f'{x:.0f}' for x in times[t])})" for t in tiles]
        print(f"| {cached} + {new} | {' | '.join(cells)} | "
              f"{', '.join(f'{ratios[t]:.2f}' for t in tiles[1:])} |", flush=True)
    payload = {"what": "prefix-hit compute_ms (step start -> first token) under each prefix_kv_tile, engines "
                       "alternated in one process, order flipped every round", "config": "configs/peer-hd64.json",
               "checkpoint": F.checkpoint_dir, "dtype": F.dtype, "devices": 1, "tiles": tiles, "rounds": F.rounds,
               "rows": rows}
    write_result(F.out, payload, load_start=load0)
    print(f"\nwrote {F.out}")


def _define_flags():
    from absl import flags

    flags.DEFINE_list("tiles", ["2048", "256"], "prefix_kv_tile settings to compare (the first is the reference).")
    flags.DEFINE_list("cases", ["8576+442", "16384+100"], "Hits as CACHED+NEW tokens (CACHED a multiple of 128).")
    flags.DEFINE_integer("rounds", 5, "Timed rounds (one hit per setting each).")
    flags.DEFINE_integer("seed", 0, "Random token ids.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Activation dtype.")
    flags.DEFINE_string("checkpoint_dir", "/tmp/slope_jax_peer_hd64", "The dense peer checkpoint (peer_cpu.py).")
    flags.DEFINE_string("out", "benchmarks/measured/cpu/prefix_tile_ab.json", "JSON output path.")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.path.insert(0, REPO)
    from absl import app

    _define_flags()
    app.run(main)
