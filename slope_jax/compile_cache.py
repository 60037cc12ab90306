"""The persistent XLA compilation cache, on by default: compiled programs are kept on disk, so a later run (or another
process: launcher peers, tests and the subprocesses they spawn, benchmarks) loads a length bucket's program instead of
compiling it again.

    from slope_jax import compile_cache
    compile_cache.enable()              # idempotent; PrefillEngine and the launcher call it
    compile_cache.enable("off")         # or SLOPE_JAX_COMPILE_CACHE=off: no persistent cache

Where (first that applies): the `path` argument (launcher flag `--compile_cache_dir`), the environment variable
`SLOPE_JAX_COMPILE_CACHE` (a directory, or `off`), a directory the user already gave JAX (`JAX_COMPILATION_CACHE_DIR`
or `jax.config.update("jax_compilation_cache_dir", ...)`), else `$XDG_CACHE_HOME/slope_jax/xla` (default
`~/.cache/slope_jax/xla`).

This is JAX's own persistent cache (https://docs.jax.dev/en/latest/persistent_compilation_cache.html). Its key is a
hash of the lowered program (StableHLO: every shape, dtype, tile size, layout and model constant that shapes it),
the devices and their assignment, the compile options, the backend and its version, the jax/jaxlib version and the
XLA flags, so a changed option is a miss, never a stale program (`tests/test_compile_cache.py` checks it). Every
program is cached (minimum compile time 0 s: a warm test run loads even the small eager programs). Entries are kept
in JAX's file format (`<key>-cache`) by `DirectoryCache`, which replaces JAX's LRU file cache: an entry is written to
a temporary file and renamed into place, so a concurrent process never reads a half-written entry, and a hit marks
the entry used (its mtime). JAX's own LRU cache, when capped, lists and stats the whole directory under a file lock
on every write; with the thousands of entries of a test suite that cost more than compiling the small programs
(`benchmarks/compile_cache_writes.py`, 402 small programs into a directory of 1,500 entries: 44.4 s with JAX's
capped cache, 13.1 s with `DirectoryCache`, 12.2 s with no cache). Instead the directory
is trimmed once per process, when `enable` runs: least recently used entries go until it holds at most
`MAX_BYTES` · `TRIM_TO` (one process may overshoot `MAX_BYTES` by what it writes before the next start).

Multi-process runs: the key covers the topology as each process sees it, so on CPU every process has its own
entries; JAX writes entries from process 0 only (`jax._src.compiler._cache_write`), which would leave every other
process compiling on every run. `enable` therefore also writes them from the other processes (same checks, same
`put`; the wrapper steps aside if JAX's function changes shape). A process that loads a program while a peer still
compiles it would wait in the first collective longer than Gloo allows (30 s): the engine meets its peers at a
barrier before a new program's first run (`PrefillEngine._run`).
Cached entries are executable code: do not share the directory with users you do not trust (JAX's warning).

Which step shapes are in the cache: JAX's key is a hash of the lowered program, unknown before a step is traced and
lowered (seconds), so the serving loop could not tell a cached shape from a new one and took any older entry as
"this run's programs are cached". `record_steps` / `compiled_steps` keep an index beside the entries,
`<dir>/slope_jax_steps.json`: {program identity (a digest of the model config, layout, dtype, step options, parameter
shapes, devices and jax/jaxlib versions, as the caller forms it): {step key ("T,m" or "T,m,prefix_rows"): unix time
written}}. Writers merge under an exclusive `fcntl` lock on `<dir>/slope_jax_steps.lock` and replace the file
atomically, so concurrent processes never lose each other's keys and readers (no lock) never see a torn file; `trim`
drops the keys recorded before the newest entry it deleted (their programs may be gone), keeping the index
conservative (a step it lists was compiled, and probably still cached).
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

ENV = "SLOPE_JAX_COMPILE_CACHE"
MAX_BYTES = 4 << 30  # cap of the cache directory, enforced when a process starts using it (`trim`)
TRIM_TO = 0.8  # a trimmed directory holds at most this fraction of MAX_BYTES, so trimming is rare
SUFFIX = "-cache"  # JAX's entry file suffix (jax._src.lru_cache): directories written by JAX itself keep loading
_STALE_TEMP_S = 3600.0  # a temporary file this old was left by a killed writer
_OFF = ("off", "none", "0", "false", "no")
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
INDEX = "slope_jax_steps.json"  # the step-key index beside the entries (module docstring)
_INDEX_LOCK = "slope_jax_steps.lock"
INDEX_MAX_KEYS = 20000  # oldest keys dropped beyond this (a few MiB of JSON at most)

_lock = threading.Lock()
_state: dict = {"dir": None, "configured": False, "hits": 0, "listening": False}


def default_dir() -> str:
    """`$XDG_CACHE_HOME/slope_jax/xla`, or `~/.cache/slope_jax/xla` (per user)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "slope_jax", "xla")


def resolve(path: str | None = None) -> str | None:
    """The cache directory to use (absolute), or None when the cache is off. See the module docstring for the
    order; `path` / the env var may be `off` (also none, 0, false, no)."""
    import jax

    for value in (path, os.environ.get(ENV)):
        if value is not None and value.strip() != "":
            return None if value.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(value))
    given = jax.config.jax_compilation_cache_dir
    return os.path.abspath(given) if given else default_dir()


def enable(path: str | None = None) -> str | None:
    """Turn the persistent compilation cache on (or off) for this process; returns its directory or None.

    The first call decides; later calls without `path` keep that decision (PrefillEngine calls this on every
    construction). An explicit `path` that differs from the current directory re-points the cache. Safe to call
    after programs were compiled (JAX's cache state is reset so the new directory takes effect).

    Raises:
      OSError: the directory cannot be created.
    """
    import jax
    from jax._src import compilation_cache as jcc  # only to ask whether JAX already decided (below)
    from jax.experimental.compilation_cache import compilation_cache as public_cc

    with _lock:
        if _state["configured"] and path is None:
            return _state["dir"]
        directory = resolve(path)
        if _state["configured"] and directory == _state["dir"]:
            return directory
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", directory)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor, no override
            if _install_directory_cache():
                jax.config.update("jax_compilation_cache_max_size", -1)  # JAX's own eviction off: `trim` instead
                trim(directory)
            elif jax.config.jax_compilation_cache_max_size == -1:
                jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)  # JAX's LRU cache and file lock
            jax.config.update("jax_enable_compilation_cache", True)
        else:
            jax.config.update("jax_enable_compilation_cache", False)
        if getattr(jcc, "_cache_checked", True) or getattr(jcc, "_cache_initialized", True):
            public_cc.reset_cache()  # JAX decided "cache used?" at an earlier compile (once a process): again
        if not _state["listening"]:
            jax.monitoring.register_event_listener(_on_event)
            _write_from_every_process()
            _state["listening"] = True
        _state.update(dir=directory, configured=True)
    log.info("XLA compilation cache: %s", directory or f"off ({ENV}=off or --compile_cache_dir=off)")
    return directory


def directory() -> str | None:
    """The directory `enable` chose (None: off, or `enable` not called yet)."""
    return _state["dir"]


def hits() -> int:
    """Programs this process has loaded from the persistent cache so far (JAX's monitoring event)."""
    return _state["hits"]


def _on_event(event: str, **kwargs) -> None:
    if event == _HIT_EVENT:
        with _lock:
            _state["hits"] += 1


_WRITE_ARGS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks")


def _write_from_every_process() -> None:
    """Wrap JAX's cache writer so that processes other than 0 write their own entries too (see the module
    docstring); JAX's own checks (host callbacks, minimum compile time) and its `put` are kept."""
    import inspect
    import warnings

    import jax
    from jax._src import compilation_cache as jcc
    from jax._src import compiler, distributed

    original = getattr(compiler, "_cache_write", None)
    if original is None or tuple(inspect.signature(original).parameters) != _WRITE_ARGS:
        log.warning("compilation cache: this JAX version's cache writer is not the one wrapped; processes other "
                    "than 0 of a multi-process run will compile every run")
        return

    def _cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0 or host_callbacks:
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return None
        try:
            jcc.put_executable_and_time(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - as JAX: a failed write costs a compile next time, never the run
            warnings.warn(f"Error writing persistent compilation cache entry for {module_name!r}: "
                          f"{type(e).__name__}: {e}", stacklevel=2)
        return None

    compiler._cache_write = _cache_write


class DirectoryCache:
    """JAX's cache interface (`get`, `put`, `clear`) over one directory of `<key>-cache` files.

    `put` writes a temporary file and renames it into place (atomic on POSIX file systems, also when processes write
    the same key at once: the last rename wins and both wrote the same program); `get` reads the file whole and sets
    its mtime to now, which `trim` reads as the last use. No lock and no directory scan per call.
    """

    def __init__(self, path: str):
        import pathlib

        self._path = pathlib.Path(path)
        self._path.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str):
        if not key:
            raise ValueError("cache key must not be empty")
        return self._path / f"{key}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            value = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            os.utime(path)
        except OSError:  # read-only directory: still a hit
            pass
        return value

    def put(self, key: str, value: bytes) -> None:
        path = self._file(key)
        if path.exists():
            return
        temp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            temp.write_bytes(value)
            os.replace(temp, path)
        finally:
            if temp.exists():
                temp.unlink()

    def clear(self) -> None:
        for path in self._path.glob(f"*{SUFFIX}"):
            path.unlink(missing_ok=True)


def trim(directory: str, max_bytes: int = MAX_BYTES) -> int:
    """Delete least recently used entries (oldest mtime first) until `directory` holds ≤ `max_bytes` · `TRIM_TO`,
    when it holds more than `max_bytes`; also temporary files older than an hour (a killed writer's). Entries a
    concurrent process deletes first are skipped. Returns the bytes deleted.

    Raises:
      OSError: the directory cannot be listed.
    """
    entries, total, freed, now = [], 0, 0, time.time()
    with os.scandir(directory) as it:
        for e in it:
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            if e.name.endswith(".tmp") and e.name.startswith("."):
                if now - st.st_mtime > _STALE_TEMP_S:
                    _unlink(e.path)
            elif e.name.endswith(SUFFIX):
                entries.append((st.st_mtime, st.st_size, e.path))
                total += st.st_size
    if total <= max_bytes:
        return 0
    for _, size, path in sorted(entries):
        if total - freed <= max_bytes * TRIM_TO:
            break
        if _unlink(path):
            freed += size
        _unlink(path[: -len(SUFFIX)] + "-atime")  # JAX's LRU cache writes one beside each entry
    _forget_steps_before(directory, max((m for m, _, p in entries if not os.path.exists(p)), default=0.0))
    log.info("XLA compilation cache: trimmed %.1f MiB of least recently used entries from %s (cap %.2f GiB)",
             freed / 2**20, directory, max_bytes / 2**30)
    return freed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _install_directory_cache() -> bool:
    """Make JAX build `DirectoryCache` where it would build its LRU file cache (`jax._src.compilation_cache.
    get_file_cache(path)`); False (JAX's own cache stays) if that function changed shape in this JAX version."""
    import inspect

    from jax._src import compilation_cache as jcc

    original = getattr(jcc, "get_file_cache", None)
    if getattr(original, "_slope_jax", False):
        return True
    if original is None or tuple(inspect.signature(original).parameters) != ("path",):
        log.warning("compilation cache: this JAX version's get_file_cache is not the one replaced; JAX's LRU file "
                    "cache is used (it scans the directory on every write)")
        return False

    def get_file_cache(path: str):
        import jax

        cache = DirectoryCache(path)
        if jax.config.jax_compilation_cache_check_contents:
            return jcc.VerificationCache(cache), path
        return cache, path

    get_file_cache._slope_jax = True
    jcc.get_file_cache = get_file_cache
    return True


def step_key(key: tuple) -> str:
    """The index's text form of an engine step key `(T, m)` or `(T, m, prefix_rows)`: "T,m[,prefix_rows]"."""
    return ",".join(str(int(x)) for x in key)


def _read_index(directory: str) -> dict:
    import json

    try:
        with open(os.path.join(directory, INDEX)) as f:
            index = json.load(f)
        return index if isinstance(index, dict) and isinstance(index.get("steps"), dict) else {"steps": {}}
    except (OSError, ValueError):
        return {"steps": {}}


def _update_index(directory: str, change) -> None:
    """Apply `change(index)` to the index under its exclusive lock and write it back atomically."""
    import fcntl

    from slope_jax.atomic import atomic_json

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, _INDEX_LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            index = _read_index(directory)
            change(index)
            atomic_json(os.path.join(directory, INDEX), index)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record_steps(identity: str, keys, directory: str | None = None) -> None:
    """Add step keys (engine keys, `step_key`) compiled for program `identity` to the index of `directory` (default
    the enabled cache's; nothing when the cache is off). Concurrent writers merge (module docstring). An index that
    cannot be written is logged and skipped: it only sharpens compile estimates."""
    directory = directory or _state["dir"]
    keys = [step_key(k) if not isinstance(k, str) else k for k in keys]
    if not directory or not keys:
        return
    now = time.time()

    def change(index):
        steps = index["steps"].setdefault(identity, {})
        steps.update({k: now for k in keys})
        every = [(t, ident, k) for ident, ks in index["steps"].items() for k, t in ks.items()]
        for _, ident, k in sorted(every)[:max(0, len(every) - INDEX_MAX_KEYS)]:
            del index["steps"][ident][k]

    try:
        _update_index(directory, change)
    except OSError as e:
        log.warning("compilation cache: step index of %s not written: %s", directory, e)


def compiled_steps(identity: str, directory: str | None = None) -> set[str]:
    """Step keys (`step_key` form) the index of `directory` (default the enabled cache's) lists for program
    `identity`: shapes compiled into this cache before. Empty when the cache is off or the index is absent."""
    directory = directory or _state["dir"]
    if not directory:
        return set()
    return set(_read_index(directory)["steps"].get(identity, {}))


def _forget_steps_before(directory: str, deleted_mtime: float) -> None:
    """Drop the index keys recorded before `deleted_mtime` (the newest entry `trim` deleted was last used then)."""
    if deleted_mtime <= 0 or not os.path.exists(os.path.join(directory, INDEX)):
        return

    def change(index):
        for ident in list(index["steps"]):
            index["steps"][ident] = {k: t for k, t in index["steps"][ident].items() if t > deleted_mtime}

    try:
        _update_index(directory, change)
    except OSError as e:
        log.warning("compilation cache: step index of %s not trimmed: %s", directory, e)
