"""Process 0's front of a launcher run: the request source (stdin / `--requests` `LineReader`, or the HTTP intake),
parsing with the intake checks (request rules, the KV directory's policy, memory admission), the SLO scheduler and
its cost model, and the result records and results file. Other processes only compute (`serve.compute`).

Everything here takes the run's `LaunchConfig`; nothing reads absl flags. No JAX or numpy at import.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from collections.abc import Sequence

from absl import logging

from slope_jax.serve.launch_config import FlagError, LaunchConfig


# ---- records ----------------------------------------------------------------------------------------------------
def slo_ms(req, default_slo_ms: float | None) -> float | None:
    """A request's TTFT SLO in ms: its own `ttft_slo_ms`, else the run's default (--ttft_slo_ms), else None."""
    return req.ttft_slo_ms if req.ttft_slo_ms is not None else default_slo_ms


def request_error(req, message: str, default_slo_ms: float | None, **extra) -> dict:
    """The error record of a parsed request (failed or rejected). A request with a TTFT SLO keeps it in its record
    with `"slo_met": false`: SLO attainment counts it as a miss."""
    rec = {"id": req.id, "line": req.line, "error": message, **extra}
    slo = slo_ms(req, default_slo_ms)
    if slo is not None:
        rec.update(ttft_slo_ms=round(slo, 3), slo_met=False)
    return rec


def result_record(req, res, engine, tokenizer, default_slo_ms: float | None, item=None) -> dict:
    """A served request's record; `"late": true` exactly when it carries an SLO and its TTFT exceeded it."""
    import numpy as np

    if not np.all(np.isfinite(res.logits)):
        return request_error(req, "the step produced non-finite logits (NaN/Inf); no result", default_slo_ms)
    rec = {"id": req.id, "line": req.line, "first_token": res.first_token}
    if tokenizer is not None:
        rec["first_token_text"] = tokenizer.decode([res.first_token], skip_special_tokens=False)
    rec.update({"logprob": round(res.logprob, 6), "top_k": [[t, round(v, 6)] for t, v in res.top_k],
                "num_tokens": res.num_tokens, "cached_tokens": res.cached_tokens,
                "bucket": engine.step_key(res.num_tokens, res.cached_tokens)[0],
                "ttft_ms": round(res.ttft_ms, 3), "queue_ms": round(res.queue_ms, 3),
                "compile_ms": round(res.compile_ms, 3), "compute_ms": round(res.compute_ms, 3),
                "export_ms": round(res.export_ms, 3), "kv_path": res.kv_path})
    if item is not None and item.predicted_ttft_ms is not None:  # the cost model's TTFT beside the measured one
        rec["predicted_ttft_ms"] = round(item.predicted_ttft_ms, 3)
        note = prediction_note(res, item)
        if note:
            rec["prediction_note"] = note
    slo = slo_ms(req, default_slo_ms)
    if slo is not None:
        rec["ttft_slo_ms"] = round(slo, 3)
        rec["slo_met"] = res.ttft_ms <= slo
        if not rec["slo_met"]:
            rec["late"] = True
    return rec


PREDICTION_TOLERANCE = 0.25  # a record says why its TTFT is further than this from the prediction (issue 32)


def prediction_note(res, item) -> str | None:
    """Why a served request's TTFT is more than PREDICTION_TOLERANCE from the scheduler's prediction, in words: the
    part of the TTFT that differs most — waiting for work ahead, compiling step programs (a program that is not in
    the persistent compilation cache compiles in seconds, one that is loads in a fraction of that), or computing —
    with measured and predicted ms, and a prefix-cache hit other than expected. None when within the tolerance.

    `res`: the PrefillResult (queue_ms includes compile_ms); `item`: the scheduler's Pending (predicted_ttft_ms,
    predicted_compute_ms (compiling included), predicted_compile_ms, cached_tokens)."""
    pred = item.predicted_ttft_ms
    if not pred or abs(res.ttft_ms / pred - 1) <= PREDICTION_TOLERANCE:
        return None
    p_compile = item.predicted_compile_ms or 0.0
    p_compute = (item.predicted_compute_ms or 0.0) - p_compile
    p_wait = pred - (item.predicted_compute_ms or 0.0)
    if p_compile > 0 and res.compile_ms < 1.0:  # (µs: a lookup of a program in memory) its batch's program was
        p_wait, p_compile = p_wait + p_compile, 0.0  # compiled by a request ahead of it, which it waited for
    parts = {"waiting for work ahead": (res.queue_ms - res.compile_ms, p_wait),
             "compiling step programs": (res.compile_ms, p_compile),
             "computing": (res.compute_ms, p_compute)}
    name, (got, want) = max(parts.items(), key=lambda kv: abs(kv[1][0] - kv[1][1]))
    note = (f"TTFT {res.ttft_ms:.0f} ms vs {pred:.0f} ms predicted ({res.ttft_ms / pred - 1:+.0%}): mostly "
            f"{name}, {got:.0f} ms vs {want:.0f} ms predicted")
    if name == "compiling step programs" and got > want:
        note += _slow_compile_reason(got, want)
    if res.cached_tokens != item.cached_tokens:
        note += f"; the prefix cache gave {res.cached_tokens} tokens, {item.cached_tokens} expected"
    return note


def _slow_compile_reason(got: float, want: float) -> str:
    """Why compiling took `got` ms where `want` were predicted: no compile expected (the program was taken for
    compiled already), or one that ran longer than its estimate, which says how it is made (`serve.slo`)."""
    from slope_jax.serve.slo import HIT_COMPILE_FACTOR
    if want <= 0:
        return " (a step program compiled that the estimate expected compiled already)"
    return (" (compiling or loading the step program ran longer than estimated: before this process has compiled "
            "or loaded one, a program is estimated at the hardware profile's compile_s scaled by the host's load, "
            f"a tenth of that when the persistent compilation cache holds it, {HIT_COMPILE_FACTOR:g}x for a "
            "prefix hit's program; later at the last measured compile or load of its kind)")


# ---- the results file -------------------------------------------------------------------------------------------
def refuse_existing_results(path: str, overwrite: bool) -> None:
    """FlagError if `path` holds an earlier run's results (a non-empty file) and not `overwrite`."""
    if overwrite or not os.path.exists(path):
        return
    if os.path.isdir(path):
        raise FlagError(f"--results={path}: is a directory; give a file path")
    if os.path.getsize(path) > 0:
        raise FlagError(f"--results={path} already holds an earlier run's results: pass --overwrite to replace it "
                        "(and the KV exports of the same ids), or give another --results file")


def open_results(path: str, overwrite: bool):
    """Open the results file for writing: created exclusively unless `overwrite` (an empty leftover file is reused),
    so a concurrent run that created it meanwhile is refused instead of interleaved."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    refuse_existing_results(path, overwrite)
    if overwrite or os.path.exists(path):  # only an empty file is left here without overwrite
        return open(path, "w")
    try:
        return open(path, "x")
    except FileExistsError as e:
        raise FlagError(f"--results={path} was created by another run meanwhile: pass --overwrite or give another "
                        "--results file") from e


# ---- request sources --------------------------------------------------------------------------------------------
def request_stream(config: LaunchConfig):
    """The byte stream of request lines (stdin or --requests), or None with --http_port."""
    if config.http_port is not None:
        return None
    if config.requests == "-":
        logging.info("reading requests from stdin, one JSON object per line (end of input ends the run)")
        return sys.stdin.buffer
    return open(config.requests, "rb")


def start_source(config: LaunchConfig, src, cfg, max_tokens: int, tokenizer_path: str | None, kv_store,
                 host_tier=None, peer_pools=None):
    """The request source: a `LineReader` thread over `src`, or (src None) the started HTTP intake (publishing into
    its NIXL pool from `host_tier`, the engine's, when that holds the prompt; `peer_pools`: the other processes'
    pool occupancy its GET /v1/kv/pool shows, `PeerRows.peer_pools`)."""
    if src is not None:
        from slope_jax.serve.batching import LineReader

        return LineReader(src)
    from slope_jax.serve.http import HttpIntake

    name = config.http_model_name or os.path.basename(os.path.normpath(config.checkpoint))
    source = HttpIntake(config.http_host, config.http_port, vocab_size=cfg.vocab_size, max_tokens=max_tokens,
                        model_name=name, tokenizer_path=tokenizer_path, top_k=config.top_k, kv_store=kv_store,
                        kv_pool_gib=config.kv_pool_gib, kv_lease_s=config.kv_lease_s, host_tier=host_tier,
                        peer_pools=peer_pools)
    try:
        source.start()
    except OSError as e:
        raise FlagError(f"--http_host={config.http_host} --http_port={config.http_port}: cannot listen ({e})") from e
    return source


def _load_tokenizer(checkpoint: str):
    """(tokenizer or None, its path or None): the checkpoint's tokenizer.json when there is one."""
    path = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.exists(path):
        return None, None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path), path


# ---- the front --------------------------------------------------------------------------------------------------
class Front:
    """Process 0's side of a run: the request source, parsing and intake checks, the scheduler and its cost model,
    and the result records (`emit`). Built by `open`; `config` is the run's `LaunchConfig`, `kv_store` the owner of
    the --kv_dir policy (`kv.store.KVStore`, or None), `memory` the memory admission (`admission.MemoryAdmission`)."""

    def __init__(self, engine, config: LaunchConfig, cfg, max_tokens: int, tokenizer, out, kv_store, memory):
        self.engine, self.config, self.cfg, self.max_tokens = engine, config, cfg, max_tokens
        self.tokenizer, self.out, self.kv_store, self.memory = tokenizer, out, kv_store, memory
        self.records: list[dict] = []
        self.seen: set[str] = set()
        self.lineno = 0
        self.source = self.intake = self.scheduler = self.predict_ms = None

    @classmethod
    def open(cls, engine, config: LaunchConfig, cfg, max_tokens: int, hardware: str, kv_store) -> Front:
        """Load the tokenizer, open the requests and the results, build the scheduler, start the source."""
        import jax

        from slope_jax.serve import admission, slo

        tokenizer, tok_path = _load_tokenizer(config.checkpoint)
        src = request_stream(config)
        out = sys.stdout if config.results == "-" else open_results(config.results, config.overwrite)
        if config.logits_dir:
            os.makedirs(config.logits_dir, exist_ok=True)
        memory = admission.for_engine(engine, hardware, config.dtype, jax.local_device_count(),
                                      config.memory_budget_bytes)
        front = cls(engine, config, cfg, max_tokens, tokenizer, out, kv_store, memory)
        front.predict_ms = slo.batch_model(engine, hardware, config.dtype, jax.local_device_count())
        front.scheduler = _scheduler(config, engine, front.predict_ms,
                                     engine.reuse.block_size if front.shares_prefixes else 0)
        peers = engine.peer_rows.peer_pools if engine.peer_rows is not None else None
        front.source = start_source(config, src, cfg, max_tokens, tok_path, kv_store, engine.host_tier, peers)
        front.intake = Intake(front.source, front.scheduler, front.parse_line, front.emit, config.ttft_slo_ms,
                              peek=front.expected_hit, hashes=front.prefix_hashes)
        return front

    def emit(self, rec: dict) -> None:
        """Write one result record (strict JSON, flushed) and hand it to the source (an HTTP request waits for it)."""
        try:
            text = json.dumps(rec, allow_nan=False)
        except ValueError:  # a non-finite number: never written as NaN/Infinity
            rec = {"id": rec.get("id"), "line": rec.get("line"), "error": "result had non-finite numbers",
                   **({"ttft_slo_ms": rec["ttft_slo_ms"], "slo_met": False} if "ttft_slo_ms" in rec else {})}
            text = json.dumps(rec)
        self.records.append(rec)
        self.out.write(text + "\n")
        self.out.flush()
        self.source.deliver(rec)

    def parse_line(self, raw, arrival) -> list:
        """One request line → [Request], or [] after emitting its error record (bad line, existing export, predicted
        to exceed the device memory budget)."""
        from slope_jax.serve import requests

        self.lineno += 1
        if isinstance(raw, OSError):
            self.emit({"id": None, "line": self.lineno, "error": f"reading the requests failed: {raw}"})
            return []
        if isinstance(raw, requests.ClientLeft):
            logging.info("request %s: its client left before the prefill started; not computed", raw.request_id)
            self.emit(requests.cancelled_record(raw.request_id, self.lineno))
            return []
        if not raw.strip():
            return []
        try:
            req = requests.parse(raw, self.lineno, vocab_size=self.cfg.vocab_size, max_tokens=self.max_tokens,
                                 tokenizer=self.tokenizer, seen_ids=self.seen, arrival=arrival)
        except requests.LineError as e:
            self.emit(requests.error_record(e))
            return []
        problem = self._refusal(req)
        if problem is not None:
            self.emit(request_error(req, f"line {req.line} ({req.id}): {problem}", self.config.ttft_slo_ms))
            return []
        return [req]

    def _refusal(self, req) -> str | None:
        """Why a parsed request is refused before any compute (its export exists; its step is predicted not to fit
        the memory budget), or None."""
        from slope_jax.kv import format as kvfmt

        if self.kv_store is not None:
            try:
                self.kv_store.check_new(req.id)
            except kvfmt.ExportExistsError as e:
                return str(e)
        try:
            return self.memory.refusal(int(req.tokens.size))
        except Exception as e:  # noqa: BLE001 - a failing prediction is this request's error, not the run's
            return f"memory admission failed: {type(e).__name__}: {e}"

    def expected_hit(self, req, usable: Sequence[str] | None = None) -> int:
        """Prompt tokens `req` will most likely take from the prefix cache (`serve.reuse.peek`): admission predicts
        its TTFT from the rest. 0 when reuse is off or the lookup fails. `usable`: its `prefix_hashes`."""
        from slope_jax.serve import reuse

        try:
            return reuse.peek(self.engine, req.tokens, req.cache_salt, self.config.kv_dir, usable)
        except Exception as e:  # noqa: BLE001 - a failed lookup only makes the prediction pessimistic
            logging.warning("prefix lookup for admission of %s failed: %s", req.id, e)
            return 0

    def prefix_hashes(self, req) -> list[str]:
        """`req`'s usable block hashes (`serve.reuse.usable_hashes`) where a prompt served before it can leave its
        prefix for it (the scheduler's `prefix_block`), else []."""
        from slope_jax.serve import reuse

        return reuse.usable_hashes(self.engine, req.tokens, req.cache_salt) if self.shares_prefixes else []

    @property
    def shares_prefixes(self) -> bool:
        """Whether a prompt's KV, once computed, can serve a later prompt's prefix in this run: reuse on and a place
        that keeps it (the host tier of a single process, or `--kv_dir`)."""
        return self.engine.reuse.enabled and (self.engine.host_tier is not None or self.kv_store is not None)

    def observe(self, lengths: list, busy_ms: float) -> None:
        """Online correction: the cost model learns the batch's measured busy time; the scheduler frees the engine."""
        self.predict_ms.observe(lengths, busy_ms)
        self.scheduler.finished(time.perf_counter())

    def wants_early(self, rid: str) -> bool:
        """Whether the source answers request `rid` before its export (`early_answers`) and so asks for its rows."""
        wants = getattr(self.source, "wants_early", None)
        return self.kv_store is not None and wants is not None and bool(wants(rid))

    def early_answers(self, pending: dict):
        """The engine's `on_computed` for a batch (None when the source answers only from records): each computed
        request's record, without its export (`kv_path` where it will be, `"export_pending": true`), goes to the
        source's `deliver_early` with its `engine.PendingExport` (manifest and rows), before the export is written.
        Not written to the results: the request's record follows once its export is."""
        deliver = getattr(self.source, "deliver_early", None)
        if deliver is None or self.kv_store is None:
            return None

        def on_computed(ids, results, exports) -> None:
            for rid, res, export in zip(ids, results, exports or [None] * len(ids)):
                item = pending.get(rid)
                if item is None or export is None or not export.local or not self.source.wants_early(rid):
                    continue  # nothing computed for a request that will not be answered early
                rec = result_record(item.request, res, self.engine, self.tokenizer, self.config.ttft_slo_ms, item)
                if "error" in rec:
                    continue  # its record says why
                rec.pop("export_ms", None)
                rec.update(kv_path=os.path.join(self.kv_store.kv_dir, rid), export_pending=True)
                deliver(rec, export)

        return on_computed

    def record_batch(self, ids: list[str], outcomes: list, pending: dict) -> None:
        """One record per request of a finished batch (and its logits file with --logits_dir)."""
        import numpy as np

        for rid, res in zip(ids, outcomes):
            item = pending[rid]
            req = item.request
            if isinstance(res, str):
                self.emit(request_error(req, res, self.config.ttft_slo_ms))
                continue
            if self.config.logits_dir:
                np.save(os.path.join(self.config.logits_dir, f"{rid}.npy"), res.logits)
            self.emit(result_record(req, res, self.engine, self.tokenizer, self.config.ttft_slo_ms, item))


def _scheduler(config: LaunchConfig, engine, predict_ms, prefix_block: int = 0):
    """The SLO scheduler of the run (`serve.scheduler.Scheduler`) over the cost model `predict_ms`; `prefix_block`:
    the prefix cache's block size where prompts served first leave prefixes for later ones (else 0)."""
    from slope_jax.serve.scheduler import Scheduler

    return Scheduler(predict_ms, batch_size=config.batch_size, batch_wait_ms=config.batch_wait_ms,
                     order=config.order, slo_policy=config.slo_policy, default_slo_ms=config.ttft_slo_ms,
                     bucket=engine.bucket, per_step=predict_ms.per_step, compile_ms=predict_ms.compile_ms,
                     hit_key=engine.step_key, prefix_block=prefix_block)


class Intake:
    """Process 0's side of the loop: lines from the reader thread → parsed requests (as `scheduler.Pending`) in the
    scheduler, bad lines and rejected requests → error records at once."""

    def __init__(self, reader, scheduler, parse_line, emit, default_slo_ms: float | None = None, peek=None,
                 hashes=None):
        from slope_jax.serve.scheduler import Pending  # numpy: not before main() has set up SIGTERM handling

        self.reader, self.scheduler, self.parse_line, self.emit = reader, scheduler, parse_line, emit
        self.peek = peek  # (request, its hashes) -> prompt tokens expected from the prefix cache
        self.hashes = hashes  # request -> its usable prefix block hashes (the scheduler matches queued prompts)
        self.default_slo_ms = default_slo_ms
        self.pending_type = Pending
        self.closed = False

    def _accept(self, item) -> None:
        if item is None:
            self.closed = True
            return
        for req in self.parse_line(*item):
            deadline = None if req.ttft_slo_ms is None else req.arrival + req.ttft_slo_ms / 1e3
            item = self.pending_type(req, req.id, int(req.tokens.size), req.arrival, deadline)
            item.prefix_hashes = tuple(self.hashes(req)) if self.hashes is not None else ()
            item.cache_tokens = self.peek(req, item.prefix_hashes or None) if self.peek is not None else 0
            item.cached_tokens = item.cache_tokens
            self.scheduler.add(item)

    def _drain(self) -> None:
        """Accept every line that has already arrived (without waiting)."""
        try:
            while not self.closed:
                self._accept(self.reader.get(0))
        except queue.Empty:
            pass

    def _cancel_left(self) -> None:
        """Queued requests whose client disconnected (an HTTP source's `clients_left`) leave the scheduler with a
        cancelled record: under overload, clients that give up would otherwise still cost their compute."""
        clients_left = getattr(self.reader, "clients_left", None)
        ids = clients_left() if clients_left is not None else None
        if not ids:
            return
        from slope_jax.serve import requests

        for item in self.scheduler.cancel(ids):
            req = item.request
            logging.info("request %s: its client left while it was queued; not computed", req.id)
            self.emit(requests.cancelled_record(req.id, req.line, item.num_tokens))

    def next_batch(self):
        """The next batch to run (a list of Request), a `compute.WarmUp` of step shapes to compile while idle, or
        None when the input is closed and everything is served (and warmed).

        Lines that arrived while the previous batch ran are accepted before the scheduler picks the next batch, so
        a request with an earlier deadline is ordered (EDF) and admitted against the queue as it is: picking from
        the queue alone started a long request whose deadline was seconds away ahead of a short one that had just
        arrived and could only wait behind it (benchmarks/slo_peer.py: 2-4 of 48 requests rejected at 0.7-1.0
        requests/s, each after the previous batch ended with it unread). The head of the queue's expected
        prefix-cache hits are looked up again first (`Scheduler.refresh_expected`): the batch that just ended may
        have exported the prefix they share."""
        if self.peek is not None:  # the batch just finished may have exported prefixes queued requests share
            self.scheduler.refresh_expected(lambda p: self.peek(p.request, p.prefix_hashes or None))
        while True:
            self._drain()
            self._cancel_left()
            batch, rejected, wait_s = self.scheduler.take_batch(time.perf_counter(), self.closed)
            for item, reason in rejected:
                req = item.request
                self.emit(request_error(req, f"line {req.line} ({req.id}): {reason}", self.default_slo_ms,
                                        rejected=True, num_tokens=item.num_tokens))
            if batch:
                return batch
            warm = self.scheduler.take_warm(time.perf_counter())  # idle: compile what admission refused for
            if warm:
                from slope_jax.serve.compute import WarmUp
                from slope_jax.serve.slo import engine_key

                return WarmUp([engine_key(s) for s in warm])
            if self.closed:
                return None
            try:
                self._accept(self.reader.get(wait_s))
            except queue.Empty:
                pass
