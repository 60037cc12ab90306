"""What every command-line entry point shares (`slope-jax`, `slope-convert`, `slope-decode`, `slope-plan`,
`slope-pd-proxy`):

- `run(main, name=...)`: absl's `app.run`, except that `--help` / `--helpshort` / `--helpfull` / `--helpxml` exit with
  status 0 (absl exits 1 after printing the help, which scripts and CI read as a failure) and that a usage mistake is
  one error line `<name>: error: ...` (then a pointer to --help) with status 2. Console scripts show their tool's
  description and flags under --help, as `python -m` does.
- `quiet()`: drops known backend noise before JAX / transformers start: JAX's "Unable to initialize backend" notices
  for platforms that are not installed, and transformers' MXFP4 notices ("only supported on GPUs ...", "on CPU
  requires use_kernels=True ...", each saying it will dequantize the model): the decode engine dequantizes on purpose.
- `quiet(gloo=True)` (the launcher, multi-process runs): also the Gloo library's connection lines, which it writes to
  stdout from C++ ("[Gloo] Rank 0 is connected to 1 peer ranks ...", one per collective group, dozens per run):
  file descriptor 1 is passed through a thread that drops exactly those lines (`GLOO_LINE`) and forwards everything
  else unchanged and in order, line by line. `flush_stdout()` must precede an `os._exit`.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

_HELP = ("--help", "-help", "-?", "--?", "--helpshort", "-helpshort", "--helpfull", "-helpfull", "--helpxml",
         "-helpxml")
# One connection message. Gloo's threads (one per local device) write theirs in pieces that interleave mid-line
# ("[Gloo] Rank 2[Gloo] Rank 0 is connected ... : 3\n is connected ... : 3\n"): removing every whole message until
# none is left also removes the ones another was written into.
GLOO_LINE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks?\. Expected number of connected peer "
                       rb"ranks? is : \d+\n")
# The pieces Gloo writes a message in (`std::cout << "[Gloo] Rank " << rank << " is connected to " << …`). Threads
# also interleave piece by piece, splitting the numbers and the newline from their message (seen on the README's
# main job: "[Gloo] Rank [Gloo] Rank 5 is connected to 74 is connected to 7 peer ranks. … is :  peer ranks. … is :
# 7\n7\n"); `_GlooDebris` drops such lines.
GLOO_START = b"[Gloo] Rank "
GLOO_PIECES = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks?\. ?|Expected number of connected peer "
                         rb"ranks? is : ")
_DIGITS_ONLY = re.compile(rb"[\d\s]*")
_state = {"quiet": False}
# Taken (never released) by whichever path ends the process with an error line first — the main thread's own error
# or the peer watch's "process N stopped": a process prints one error line, never two.
EXITING = threading.Lock()


def _help_requested(argv) -> bool:
    for a in argv[1:]:
        if a == "--":
            return False
        if a.split("=", 1)[0] in _HELP and a.split("=", 1)[-1].lower() not in ("false", "0"):
            return True
    return False


def run(main, argv=None, name: str = "slope_jax") -> None:
    """`absl.app.run(main)`, with `quiet()` applied first, help exiting 0, and usage mistakes as one line
    `<name>: error: ...` with exit status 2 (a flag absl cannot parse, or an `app.UsageError` from `main`), where absl
    prints "FATAL Flags parsing error" or the whole help before the reason and exits 1, the status the launcher
    reserves for "no request was served"."""
    from absl import app

    quiet()
    argv = sys.argv if argv is None else argv
    _console_script_help(main)

    def parse(args):
        from absl import flags

        try:
            return flags.FLAGS(args)
        except flags.Error as e:
            usage_error(name, str(e))

    def guarded(args):
        try:
            return main(args)
        except app.UsageError as e:
            usage_error(name, str(e))

    try:
        app.run(guarded, argv=argv, flags_parser=parse)
    except SystemExit as e:
        if e.code == 1 and _help_requested(argv):  # absl printed the help and exited 1 before main ran
            raise SystemExit(0) from None
        raise


def _console_script_help(main) -> None:
    """Console scripts (`slope-plan`, ...): absl's --help prints the docstring and key flags of `__main__`, which
    for them is the generated wrapper with neither: give the wrapper the docstring and key flags of the module that
    defines `main`. `python -m` runs need nothing."""
    from absl import flags

    module = sys.modules.get(main.__module__)
    if module is None or main.__module__ == "__main__":
        return
    for flag in flags.FLAGS.get_key_flags_for_module(module.__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    wrapper = sys.modules.get("__main__")
    if wrapper is not None and not wrapper.__doc__ and module.__doc__:
        wrapper.__doc__ = module.__doc__


def usage_error(name: str, message: str):
    """Print `<name>: error: <message>` and a pointer to --help, and exit with status 2."""
    print(f"{name}: error: {message}\n(--help explains every flag)", file=sys.stderr, flush=True)
    sys.exit(2)


class _DropContaining(logging.Filter):
    """Drops the records whose message contains every one of `words`."""

    def __init__(self, *words: str):
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not all(w in msg for w in self.words)


class _NoBackendNotice(logging.Filter):
    """Drops JAX's 'Unable to initialize backend ...' notices for platforms not installed here (tpu, cuda on a CPU
    machine); a platform the user asked for (JAX_PLATFORMS) still fails loudly, as an exception."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to initialize backend")


def quiet(gloo: bool = False) -> None:
    """Apply the noise filters listed in the module docstring (idempotent)."""
    if not _state["quiet"]:
        _state["quiet"] = True
        logging.getLogger("jax._src.xla_bridge").addFilter(_NoBackendNotice())
        # every variant ("only supported on GPUs", "requires Triton", "on CPU requires use_kernels=True") says that
        # the experts are dequantized, which is what the decode engine wants
        logging.getLogger("transformers.quantizers.quantizer_mxfp4").addFilter(_DropContaining("MXFP4", "dequantiz"))
    if gloo and "pump" not in _state:
        _filter_gloo_stdout()


def flush_stdout() -> None:
    """Flush Python's stdout and let the Gloo filter (if on) forward everything written so far: call before
    `os._exit`, which skips the exit handlers that would do it."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    _drain()


def _filter_gloo_stdout() -> None:
    """Pass file descriptor 1 through a thread that drops Gloo's connection lines. Done at the descriptor level
    because Gloo writes from C++, past Python's sys.stdout. Skipped when stdout is not a real file descriptor."""
    try:
        sys.stdout.flush()
        real = os.dup(1)
    except (OSError, ValueError, AttributeError):
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    debris = _GlooDebris()

    def pump():
        buf = b""
        with os.fdopen(read_end, "rb", buffering=0) as src:
            while chunk := src.read(65536):
                buf = _drop_gloo(buf + chunk)
                end = buf.rfind(b"\n") + 1  # whole lines go on; a partial one waits for the rest (it may be a piece)
                if end:
                    os.write(real, debris(buf[:end]))
                    buf = buf[end:]
            if buf:
                os.write(real, buf)

    t = threading.Thread(target=pump, name="slope_jax-stdout-filter", daemon=True)
    t.start()
    _state["pump"], _state["real_stdout"] = t, real

    import atexit

    atexit.register(_drain)


def _drop_gloo(data: bytes) -> bytes:
    n = 1
    while n:
        data, n = GLOO_LINE.subn(b"", data)
    return data


class _GlooDebris:
    """Drops whole lines made of interleaved Gloo pieces (what `_drop_gloo` left behind): a line holding a message
    start whose remainder, once every Gloo piece is removed, is digits and spaces only; and then, for each message
    start beyond the line's own newline (every message ends with exactly one), one following line of digits only
    (its number and newline, written after another thread's). Any other line passes unchanged."""

    def __init__(self):
        self.owed = 0  # newlines of messages started but not yet seen

    def __call__(self, lines: bytes) -> bytes:
        out = []
        for line in lines.splitlines(keepends=True):
            starts = line.count(GLOO_START)
            if starts and _DIGITS_ONLY.fullmatch(GLOO_PIECES.sub(b"", line)):
                self.owed += starts - line.endswith(b"\n")
            elif self.owed > 0 and _DIGITS_ONLY.fullmatch(line):
                self.owed -= line.endswith(b"\n")
            else:
                out.append(line)
        return b"".join(out)


def _drain() -> None:
    """Close our end of the pipe so the filter thread forwards what is left and ends, then wait for it; later
    writes go straight to the real stdout."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    real = _state.pop("real_stdout", None)
    if real is None:
        return
    os.dup2(real, 1)  # the pipe's last write end closes here: the thread sees EOF
    _state["pump"].join(timeout=5)
