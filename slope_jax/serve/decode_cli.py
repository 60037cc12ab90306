r"""slope_jax decode: the decode half of prefill/decode disaggregation. Continues each exported request from its KV
cache to text with a decode engine that did not compute the prefill.

  # 1) prefill on 2 processes, exporting each request's KV cache
  PYTHON=.venv/bin/python launch/local.sh 2 --cpu_devices=4 --ring=2 --ulysses=4 \
      --requests=launch/requests.jsonl --results=out/pd/results.jsonl --kv_dir=out/pd/kv
  # 2) continue every exported request for 24 tokens with Hugging Face transformers
  python -m slope_jax.decode --kv_dir=out/pd/kv --requests=launch/requests.jsonl --max_new_tokens=24

The default --checkpoint, the shipped tiny model (checkpoints/tiny-gpt-oss), has random weights: its text is
gibberish by design (the summary says so); first_token_check = ok is what shows prefill and decode agree.

Engines: `transformers` (GptOssForCausalLM from --checkpoint, its cache built by `slope_jax.kv.to_transformers_cache`)
or `reference` (slope_jax's own single-device JAX decoder, `slope_jax.kv.decode.Decoder`). Before decoding, the
export's model record is checked against the engine's config (KVModelMismatch names the field).

First-token check: the prefill's first token (manifest `first_token`) was computed from the prompt's last position.
With --requests (the launcher's request file; the prompt is matched by id and verified against the manifest's
SHA-256 of the token ids), the decode engine recomputes it — cache of the first n−1 tokens, the prompt's last token
fed at position n−1 — and the two must agree; this also catches a decode engine with other weights, which no config
check can. The continuation itself starts from the full exported cache: the first token is fed at position n.

Output: one JSON line per request (--output, default stdout, as each is done; a file is written whole or not at all,
replacing an earlier one only when complete): id, num_tokens, first_token, first_token_check
("ok"; "near_tie" when the two top logits are within --tie_tolerance, as rounding differences between a bfloat16
prefill and the decode engine can swap them; "mismatch", also for logits that are not finite or all equal, with a
`first_token_note`; or "skipped"), first_token_logit_gap, tokens
(first_token and the decoded ones, `max_new_tokens` in all unless an EOS token stops it), text (tokenizer.json of
--checkpoint), finish_reason, decode time; then a summary on stderr.
Exit status 1 if any request failed or its first token did not match.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import zlib

import numpy as np
from absl import app, flags, logging

from slope_jax.atomic import atomic_write

FLAGS = flags.FLAGS
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED_CHECKPOINT = os.path.join(_REPO, "checkpoints", "tiny-gpt-oss")  # random weights (make_checkpoint.py)

def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """Define this command's flags on `fv` (the global FLAGS for the command line). Defined on call, not at import:
    `--checkpoint`, `--dtype`, `--kv_dir` ... are also the launcher's flags, and both modules may be imported in one
    process (tests), where a second definition on the global FLAGS would clash."""
    d = dict(flag_values=fv)
    flags.DEFINE_string("kv_dir", None, "Directory of exports (<kv_dir>/<request id>/manifest.json), as written by "
                        "`python -m slope_jax.launch --kv_dir`.", **d)
    flags.DEFINE_list("ids", [], "Request ids to decode (default: every export in --kv_dir, sorted).", **d)
    flags.DEFINE_string("checkpoint", SHIPPED_CHECKPOINT, "HF checkpoint directory the decode engine loads "
                        "(config.json, weights, tokenizer.json). The default, the shipped tiny model, has random "
                        "weights: its text is gibberish by design.", **d)
    flags.DEFINE_enum("engine", "transformers", ["transformers", "reference"], "Decode engine: Hugging Face "
                      "transformers GptOssForCausalLM, or slope_jax's JAX reference decoder.", **d)
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Decode engine weights, activations and KV cache "
                      "(a bfloat16 export is converted exactly to float32).", **d)
    flags.DEFINE_integer("max_new_tokens", 32, "Tokens to produce per request, the prefill's first token included.",
                         lower_bound=1, **d)
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy (argmax).", lower_bound=0.0, **d)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: sample from the smallest set of tokens whose probability "
                       "reaches top_p (with --temperature > 0).", lower_bound=0.0, upper_bound=1.0, **d)
    flags.DEFINE_integer("seed", 0, "Sampling seed (each request draws from its own generator seeded by --seed and "
                         "its id, so results do not depend on which requests run together).", **d)
    flags.DEFINE_bool("stop_at_eos", True, "Stop a request at the model's EOS token(s) (config eos_token_id).", **d)
    flags.DEFINE_string("requests", None, "The launcher's requests JSONL: each prompt's tokens (or text, encoded with "
                        "the checkpoint's tokenizer.json) for the first-token check.", **d)
    flags.DEFINE_string("results", None, "The launcher's results JSONL: first_token for exports whose manifest "
                        "lacks it.", **d)
    flags.DEFINE_string("output", "-", "JSONL file for the decode results, or '-' for stdout.", **d)
    flags.DEFINE_bool("check_fingerprint", True, "Refuse an export whose model config fingerprint differs from the "
                      "decode engine's (shapes are always checked).", **d)
    flags.DEFINE_float("tie_tolerance", None, "Logit gap under which a first token that differs from the decode "
                       "engine's argmax is still accepted as a near tie (default: 1e-4 for float32 exports, 0.125 for "
                       "bfloat16 ones: the prefill and the decode engine round differently).", **d)
    flags.DEFINE_bool("summary", True, "Print a summary table to stderr at the end.", **d)
    return fv


# Default logit gap under which a different argmax still counts as the same first token ("near_tie"): the prefill
# and the decode engine round differently (op order; a bfloat16 prefill against a float32 decode engine), so two
# almost equal top logits may swap. Per export dtype; logits of gpt-oss are O(10), bf16 keeps 8 mantissa bits.
TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.125}


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The command's options, one field per flag of `define_flags` (same name; read once, by `from_flags`)."""

    kv_dir: str | None = None
    ids: tuple[str, ...] = ()
    checkpoint: str = SHIPPED_CHECKPOINT
    engine: str = "transformers"
    dtype: str = "float32"
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True
    requests: str | None = None
    results: str | None = None
    output: str = "-"
    check_fingerprint: bool = True
    tie_tolerance: float | None = None
    summary: bool = True

    @classmethod
    def from_flags(cls, fv: flags.FlagValues) -> DecodeConfig:
        """The options the parsed flags `fv` give (`define_flags`)."""
        values = {f.name: fv[f.name].value for f in dataclasses.fields(cls)}
        return cls(**{**values, "ids": tuple(values["ids"])})


class DecodeError(ValueError):
    """A request cannot be decoded (missing export or first token, prompt mismatch); the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# Engines: start(path, num_tokens) → a session whose step(token) returns float32 next-token logits [V].
class TransformersEngine:
    """Hugging Face transformers `GptOssForCausalLM` (eager attention) decoding from `to_transformers_cache`."""

    name = "transformers"

    def __init__(self, checkpoint: str, dtype: str, check_fingerprint: bool = True):
        import torch
        import transformers

        from slope_jax.kv import compat

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
        from slope_jax.kv.transformers import lowest_index_ties

        lowest_index_ties(self.model)  # route exact router ties as the prefill did (lower expert index wins)
        self.cfg = compat.model_config(self.model)
        self.check_fingerprint = check_fingerprint
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers ≥ 5.2x renamed it

    def start(self, path: str, num_tokens: int):
        from slope_jax.kv import to_transformers_cache

        cache = to_transformers_cache(path, self.model, num_tokens=num_tokens, check_fingerprint=self.check_fingerprint)
        torch, model, kw = self.torch, self.model, self._cache_kw

        def step(token: int) -> np.ndarray:
            with torch.no_grad():
                out = model(torch.tensor([[int(token)]], device=model.device), use_cache=True, **{kw: cache})
            return out.logits[0, -1].float().cpu().numpy()

        return step


class ReferenceEngine:
    """slope_jax's single-device JAX decoder (`slope_jax.kv.decode.Decoder`) over `slope_jax.kv.load`."""

    name = "reference"

    def __init__(self, checkpoint: str, dtype: str, max_new_tokens: int, check_fingerprint: bool = True):
        from slope_jax.checkpoints import orbax_store
        from slope_jax.checkpoints.hf import load_checkpoint

        if orbax_store.is_orbax_checkpoint(checkpoint):  # a converted directory: restored onto one device
            self.cfg, self.params, _ = orbax_store.restore(checkpoint, dtype=dtype)
        else:
            self.cfg, self.params = load_checkpoint(checkpoint, dtype=dtype, progress=False)
        self.max_new_tokens = max_new_tokens
        self.check_fingerprint = check_fingerprint

    def start(self, path: str, num_tokens: int):
        from slope_jax import kv
        from slope_jax.kv import decode

        path = kv.resolve(path)  # one version of the export for the manifest check and the tensors
        kv.check_model(kv.read_manifest(path), self.cfg, path, check_fingerprint=self.check_fingerprint)
        return decode.Decoder(self.cfg, self.params, kv.load(path), num_tokens, self.max_new_tokens).step


# ---------------------------------------------------------------------------------------------------------------
def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Next token from float32 logits `[V]`: argmax if temperature == 0, else a draw from softmax(logits / T)
    restricted to the nucleus (the most probable tokens whose cumulative probability first reaches top_p;
    Holtzman et al. 2020, arXiv:1904.09751)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order]), top_p) + 1) if top_p < 1.0 else len(p)
    nucleus = order[:keep]
    return int(rng.choice(nucleus, p=p[nucleus] / p[nucleus].sum()))


def read_prompts(path: str, tokenizer) -> dict[str, np.ndarray]:
    """id → int32 token ids from a launcher requests JSONL (`tokens`, or `text` encoded with `tokenizer`). Lines the
    launcher would reject are skipped here (their requests have no export)."""
    out = {}
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                continue
            if isinstance(obj.get("tokens"), list):
                out[obj["id"]] = np.asarray(obj["tokens"], np.int64)
            elif isinstance(obj.get("text"), str) and tokenizer is not None:
                out[obj["id"]] = np.asarray(tokenizer.encode(obj["text"]).ids, np.int64)
    return out


def read_first_tokens(path: str) -> dict[str, int]:
    """id → first_token from the launcher's results JSONL (error records are skipped)."""
    out = {}
    with open(path) as f:
        for line in f:
            obj = json.loads(line)
            if isinstance(obj, dict) and "first_token" in obj and isinstance(obj.get("id"), str):
                out[obj["id"]] = int(obj["first_token"])
    return out


def decode_request(engine, path: str, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                   seed: int = 0, eos: tuple[int, ...] = (), prompt: np.ndarray | None = None,
                   first_token: int | None = None, tie_tolerance: float | None = None) -> dict:
    """Continue one export. Returns the result record (see the module docstring).

    Raises:
      KVFormatError / KVModelMismatch for a bad or foreign export; DecodeError for a missing first token or a
      prompt whose SHA-256 differs from the manifest's.
    """
    from slope_jax import kv

    path = kv.resolve(path)  # one version of the export throughout, whatever a concurrent overwrite does
    m = kv.read_manifest(path)
    rid, n = m.get("request_id", os.path.basename(path)), int(m["num_tokens"])
    kv.check_model(m, engine.cfg, path, check_fingerprint=engine.check_fingerprint)
    first = m.get("first_token") if m.get("first_token") is not None else first_token
    if first is None:
        raise DecodeError(f"{path}: the manifest has no first_token; pass the launcher's --results")
    rec = {"id": rid, "num_tokens": n, "first_token": int(first), "engine": engine.name}
    t0 = time.perf_counter()
    if prompt is not None:
        if kv.token_hash(prompt) != m["token_ids_sha256"]:
            raise DecodeError(f"{path}: the prompt of request {rid!r} in --requests ({len(prompt)} tokens) is not the "
                              f"one exported (SHA-256 of the token ids differs; the export has {n} tokens)")
        logits = engine.start(path, n - 1)(int(prompt[-1]))
        mine = int(np.argmax(logits))
        gap = float(logits[mine] - logits[int(first)])
        tol = TIE_TOLERANCE.get(m.get("dtype"), 0.0) if tie_tolerance is None else tie_tolerance
        rec["decoded_first_token"] = mine
        rec["first_token_logit_gap"] = round(gap, 6) if np.isfinite(gap) else None  # strict JSON: no NaN
        rec["first_token_check"] = "ok" if mine == int(first) else ("near_tie" if gap <= tol else "mismatch")
        if not np.all(np.isfinite(logits)) or logits.max() == logits.min():  # no token is preferred: no tie either
            rec["first_token_check"] = "mismatch"
            rec["first_token_note"] = "the decode logits are not finite or all equal: the KV cache is corrupt"
    else:
        rec["first_token_check"] = "skipped"
    rng = np.random.default_rng([seed, zlib.crc32(rid.encode())])
    tokens = [int(first)]
    finish = "eos" if tokens[-1] in eos else "length"
    if finish == "length" and max_new_tokens > 1:
        step = engine.start(path, n)
        while len(tokens) < max_new_tokens:
            tokens.append(sample(step(tokens[-1]), temperature, top_p, rng))
            if tokens[-1] in eos:
                finish = "eos"
                break
    dt = time.perf_counter() - t0
    rec.update(tokens=tokens, finish_reason=finish, decode_ms=round(1e3 * dt, 1))
    return rec


def _engine(config: DecodeConfig):
    if config.engine == "transformers":
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            raise app.UsageError(f"--engine=transformers needs torch and transformers ({e}); install them with "
                                 "pip install -e '.[decode]', or use --engine=reference") from e
        return TransformersEngine(config.checkpoint, config.dtype, config.check_fingerprint)
    return ReferenceEngine(config.checkpoint, config.dtype, config.max_new_tokens, config.check_fingerprint)


def random_weights_note(checkpoint: str) -> str | None:
    """A one-line note when `checkpoint` is the shipped tiny model, whose weights are random, so that its gibberish
    text is not taken for a fault; None for any other checkpoint."""
    if os.path.realpath(checkpoint) != os.path.realpath(SHIPPED_CHECKPOINT):
        return None
    return ("note: checkpoints/tiny-gpt-oss has random weights (checkpoints/make_checkpoint.py), so its text is "
            "gibberish by design; first_token_check = ok is what shows prefill and decode agree")


def _summary(records: list[dict], wall_s: float, config) -> str:
    lines = [f"{'id':<20} {'prompt':>7} {'first':>6} {'check':>9} {'new':>4} {'ms':>8}  text / error"]
    for r in records:
        if "error" in r:
            lines.append(f"{str(r['id']):<20} {'':>7} {'':>6} {'':>9} {'':>4} {'':>8}  error: {r['error'][:90]}")
            continue
        text = r.get("text", " ".join(map(str, r["tokens"])))
        lines.append(f"{r['id']:<20} {r['num_tokens']:>7} {r['first_token']:>6} {r['first_token_check']:>9} "
                     f"{len(r['tokens']):>4} {r['decode_ms']:>8.1f}  {json.dumps(text)[:90]}")
    ok = [r for r in records if "error" not in r]
    bad = [r for r in ok if r["first_token_check"] == "mismatch"]
    lines.append(f"{len(ok)} decoded, {len(records) - len(ok)} failed, {len(bad)} first-token mismatch(es); "
                 f"{sum(len(r['tokens']) for r in ok)} tokens in {wall_s:.1f} s (engine {config.engine}, "
                 f"{config.dtype})")
    note = random_weights_note(config.checkpoint)
    if note:
        lines.append(note)
    return "\n".join(lines)


def main(argv, F: flags.FlagValues = FLAGS) -> int:
    """Decode the requests named by the parsed flags `F`; returns the exit status."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = DecodeConfig.from_flags(F)  # the only read of the flags
    if not c.kv_dir:
        raise app.UsageError("--kv_dir is required")
    if not os.path.isdir(c.kv_dir):
        raise app.UsageError(f"--kv_dir={c.kv_dir}: no such directory")
    if not os.path.isfile(os.path.join(c.checkpoint, "config.json")):
        raise app.UsageError(f"--checkpoint={c.checkpoint}: not a checkpoint directory (no config.json)")
    for name in ("requests", "results"):
        path = getattr(c, name)
        if path and not os.path.isfile(path):
            raise app.UsageError(f"--{name}={path}: no such file")
    out_dir = os.path.dirname(os.path.abspath(c.output))
    if c.output != "-" and not (os.path.isdir(out_dir) and os.access(out_dir, os.W_OK)):
        raise app.UsageError(f"--output={c.output}: {out_dir} is not a writable directory")
    t_start = time.perf_counter()
    tokenizer = None
    tok_path = os.path.join(c.checkpoint, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tok_path)
    # every request directory; names starting with '.' are an exporter's staging / replaced directories, never exports
    ids = c.ids or sorted(d for d in os.listdir(c.kv_dir)
                          if not d.startswith(".") and os.path.isdir(os.path.join(c.kv_dir, d)))
    if not ids:  # before the model loads: nothing to decode is a usage mistake, not "0 decoded, 0 failed"
        own = os.path.exists(os.path.join(c.kv_dir, "manifest.json"))
        raise app.UsageError(f"--kv_dir={c.kv_dir}: no exports in it" + (
            " (it is an export itself: pass the directory that holds it, and --ids to pick it)" if own else ""))
    prompts = read_prompts(c.requests, tokenizer) if c.requests else {}
    firsts = read_first_tokens(c.results) if c.results else {}
    engine = _engine(c)
    eos = tuple(engine.cfg.eos_token_ids) if c.stop_at_eos else ()
    logging.info("decode engine %s (%s) from %s; %d request(s) in %s", engine.name, c.dtype, c.checkpoint,
                 len(ids), c.kv_dir)
    records: list[dict] = []
    if c.output == "-":
        _decode_all(engine, c, ids, prompts, firsts, eos, tokenizer, records, sys.stdout)
    else:  # written whole or not at all: an interrupted run leaves the earlier file as it was
        def write(path):
            with open(path, "w") as out:
                _decode_all(engine, c, ids, prompts, firsts, eos, tokenizer, records, out)

        atomic_write(c.output, write)
    if c.summary:
        print(_summary(records, time.perf_counter() - t_start, c), file=sys.stderr)
    failed = [r for r in records if "error" in r or r.get("first_token_check") == "mismatch"]
    return 1 if failed or not records else 0


def _decode_all(engine, c: DecodeConfig, ids, prompts, firsts, eos, tokenizer, records: list, out) -> None:
    """Decode each request of `ids`, appending its record to `records` and writing it to `out` as it is done."""
    from slope_jax import kv

    for rid in ids:
        path = os.path.join(c.kv_dir, rid)
        try:
            if c.requests and rid not in prompts:
                logging.warning("%s: not in --requests; first-token check skipped", rid)
            rec = decode_request(engine, path, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                                 top_p=c.top_p, seed=c.seed, eos=eos, prompt=prompts.get(rid),
                                 first_token=firsts.get(rid), tie_tolerance=c.tie_tolerance)
            if tokenizer is not None:
                rec["text"] = tokenizer.decode(rec["tokens"])
        except (kv.KVFormatError, DecodeError, ValueError) as e:
            rec = {"id": rid, "error": str(e)}
        records.append(rec)
        out.write(json.dumps(rec) + "\n")
        out.flush()


def run():
    """Console-script entry point (`slope-decode`, `python -m slope_jax.decode`)."""
    define_flags()
    for flag in FLAGS.flags_by_module_dict().get(__name__, []):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    from slope_jax import cli

    cli.run(lambda argv: sys.exit(main(argv)), name="slope_jax.decode")  # --help exits 0, backend noise filtered


if __name__ == "__main__":
    run()
