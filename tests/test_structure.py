"""Package structure: the intra-package import graph of `slope_jax` is acyclic, lower packages never import higher
ones, and the jax-free modules import without jax.

Both checks run in fresh `python -c` subprocesses, so nothing this test session has imported (conftest imports jax)
can hide a dependency.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every slope_jax module -> the slope_jax modules it imports (any `import`/`from … import`, at any depth: a lazy
# import inside a function is still a dependency). `from pkg import name` counts as importing `pkg.name` when that
# is a module, else `pkg`. Relative imports are resolved against the importing module.
_GRAPH = r"""
import ast, json, os, pkgutil, sys
root = sys.argv[1]
pkg_dir = os.path.join(root, "slope_jax")
mods = {"slope_jax": os.path.join(pkg_dir, "__init__.py")}
for info in pkgutil.walk_packages([pkg_dir], prefix="slope_jax."):
    rel = info.name.split(".")[1:]
    base = os.path.join(pkg_dir, *rel)
    mods[info.name] = os.path.join(base, "__init__.py") if info.ispkg else base + ".py"
graph = {}
for name, path in mods.items():
    is_pkg = path.endswith("__init__.py")
    tree = ast.parse(open(path).read(), path)
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                deps.add(base + "." + a.name if base + "." + a.name in mods else base)
    graph[name] = sorted(d for d in deps if d in mods and d != name)
print(json.dumps(graph))
"""


def _graph() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", _GRAPH, REPO], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle (as a path a -> … -> a), or None. Package __init__ -> own submodule edges are the normal
    way a package exposes its modules and are not edges back up, so they are kept."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in graph[n]:
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in graph:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


# package -> packages it must never import (lower layers never reach up)
FORBIDDEN = {
    "model": ("parallel", "serve", "checkpoints", "kv", "plan"),
    "parallel": ("serve", "checkpoints"),
    "checkpoints": ("serve",),
    "kv": ("serve", "checkpoints"),
    "plan": ("serve", "checkpoints"),
}


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


# the step module: only the engine may import it; the stage plan and the sharding table live in `parallel.stages`
# (numpy only) and `parallel.sharding` for everyone else
STEP_MODULES = ("slope_jax.parallel.pipeline",)
STEP_IMPORTERS = ("slope_jax.serve.engine",) + STEP_MODULES


def test_import_graph_is_acyclic_and_layered():
    graph = _graph()
    # the graph really covers the tree (a walker that found nothing would pass everything)
    for must in ("slope_jax.model.gpt_oss", "slope_jax.parallel.pipeline", "slope_jax.serve.engine",
                 "slope_jax.checkpoints.hf", "slope_jax.kv.format", "slope_jax.plan.flops"):
        assert must in graph, sorted(graph)
    assert "slope_jax.model.config" in graph["slope_jax.parallel.config"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    bad = [f"{m} imports {d}" for m, deps in graph.items() for d in deps
           if _package(m) in FORBIDDEN and _package(d) in FORBIDDEN[_package(m)]]
    assert not bad, bad
    bad = [f"{m} imports the step module {d}" for m, deps in graph.items() for d in deps
           if d in STEP_MODULES and m not in STEP_IMPORTERS]
    assert not bad, bad
    # the numpy-only stage plan is what parallel/, plan/ and checkpoints/ share
    for user in ("slope_jax.parallel.pipeline", "slope_jax.plan.flops", "slope_jax.checkpoints.orbax_store"):
        assert "slope_jax.parallel.stages" in graph[user] or "slope_jax.parallel.sharding" in graph[user], user


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a planted cycle is reported, a DAG is not."""
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


# `import jax` (and jaxlib/flax/orbax) raise inside the child; the modules below must still import.
_NO_JAX = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "orbax"):
            raise ImportError(f"blocked for this test: {name}")
        return None
sys.meta_path.insert(0, Block())
import importlib
for m in sys.argv[1:]:
    importlib.import_module(m)
try:
    import jax  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the jax block did not work")
assert not any(k.split(".")[0] == "jax" for k in sys.modules), "jax got imported"
print("ok")
"""

JAX_FREE = ["slope_jax", "slope_jax.kv", "slope_jax.kv.format", "slope_jax.kv.exporter", "slope_jax.kv.vllm_plan",
            "slope_jax.plan", "slope_jax.plan.flops", "slope_jax.plan.traffic", "slope_jax.parallel.config",
            "slope_jax.parallel.stages", "slope_jax.model.config", "slope_jax.model.options", "slope_jax.atomic",
            "slope_jax.xla_env", "slope_jax.serve.http", "slope_jax.serve.pd_proxy", "slope_jax.serve.distributed",
            "slope_jax.serve.launcher", "slope_jax.kv.nixl_transport"]


def test_jax_free_modules_import_without_jax():
    out = subprocess.run([sys.executable, "-c", _NO_JAX, *JAX_FREE], capture_output=True, text=True, timeout=60,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    # and the block is real: a jax-using module fails under it
    out = subprocess.run([sys.executable, "-c", _NO_JAX, "slope_jax.model.gpt_oss"], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode != 0 and "blocked for this test" in out.stderr


# No function (or method) anywhere in slope_jax/ may be longer than this many lines (ast: end_lineno - lineno + 1, the
# decorators and docstring included): a longer one is split into named steps.
MAX_FUNCTION_LINES = 60


def _long_functions(path: str, limit: int) -> list[str]:
    import ast

    tree = ast.parse(open(path).read(), path)
    return [f"{os.path.relpath(path, REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def test_no_long_functions_in_slope_jax():
    files = [os.path.join(root, f) for root, _, names in sorted(os.walk(os.path.join(REPO, "slope_jax")))
             for f in sorted(names) if f.endswith(".py")]
    packages = {os.path.relpath(os.path.dirname(f), REPO) for f in files}
    assert len(files) > 50 and {"slope_jax/serve", "slope_jax/plan", "slope_jax/model"} <= packages, packages
    long = [line for path in files for line in _long_functions(path, MAX_FUNCTION_LINES)]
    assert not long, long


def test_long_function_check_finds_a_long_function(tmp_path):
    """The checker itself: a planted 61-line function is reported, a 60-line one is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))  # def line + 59 = 60 lines
    longer = "\n".join(f"        y{i} = {i}" for i in range(60))  # def line + 60 = 61 lines
    (tmp_path / "m.py").write_text(f"def ok():\n{body}\n\n\nclass C:\n    def long(self):\n{longer}\n")
    found = _long_functions(str(tmp_path / "m.py"), MAX_FUNCTION_LINES)
    assert len(found) == 1 and " long (61 lines)" in found[0], found


def _undefined_names(path: str) -> list[tuple[str, int, str]]:
    """(scope, line, name) for each global name a module's code reads that the module never binds (no assignment,
    import, def or class at top level) and that is not a builtin: a NameError waiting for that code path to run.
    Python's own symbol tables decide what is local, enclosing or global."""
    import builtins
    import symtable

    with open(path) as f:
        top = symtable.symtable(f.read(), path, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    bound |= set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__builtins__"}
    found = []

    def walk(table):
        for s in table.get_symbols():
            reads_global = s.is_referenced() and (table.get_type() == "module" or s.is_global())
            if reads_global and s.get_name() not in bound:
                found.append((table.get_name(), table.get_lineno(), s.get_name()))
        for child in table.get_children():
            walk(child)

    walk(top)
    return found


def test_every_global_name_read_is_defined():
    """No module of the package, benchmarks, launch scripts or tests reads a name it never defines (a benchmark once
    lost its `best_seconds` import in a refactor and failed only when run)."""
    import glob

    paths = [p for pattern in ("slope_jax/**/*.py", "benchmarks/*.py", "launch/*.py", "tests/*.py")
             for p in glob.glob(os.path.join(REPO, pattern), recursive=True)]
    assert len(paths) > 50
    found = {os.path.relpath(p, REPO): bad for p in paths if (bad := _undefined_names(p))}
    assert not found, found


def test_undefined_name_check_finds_a_missing_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f(x):\n    y = os.sep\n    return best_seconds(lambda: x + y)\n")
    assert _undefined_names(str(path)) == [("f", 3, "best_seconds")]


# absl flags are read in at most this many functions per module of slope_jax/ (issue 33): a command builds one frozen
# config from the parsed flags at its entry point (`LaunchConfig.from_flags(FLAGS)`, `PlanConfig.from_flags(FLAGS)`)
# and passes it down; nothing below reads FLAGS. Module-level flag definitions are outside every function.
MAX_FLAGS_READERS = 2


def _flags_readers(path: str) -> list[str]:
    """`name:line` of each function (def / async def, methods and nested functions included) whose own body reads
    an attribute or item of a name `FLAGS` (`FLAGS.x`, `FLAGS[...]`); an access inside a nested function counts for
    the innermost function only."""
    import ast

    def reads_flags(node) -> bool:
        return (isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.value, ast.Name)
                and node.value.id == "FLAGS")

    found = []

    def visit(node, function):
        if function is not None and reads_flags(node) and f"{function.name}:{function.lineno}" not in found:
            found.append(f"{function.name}:{function.lineno}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # decorators, defaults: the enclosing scope
            for outer in (*node.decorator_list, node.args, node.returns):
                if outer is not None:
                    visit(outer, function)
            for stmt in node.body:
                visit(stmt, node)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(open(path).read(), path), None)
    return found


def test_flags_read_in_at_most_two_functions_per_module():
    files = [os.path.join(root, f) for root, _, names in sorted(os.walk(os.path.join(REPO, "slope_jax")))
             for f in sorted(names) if f.endswith(".py")]
    assert len(files) > 50
    offenders = {os.path.relpath(path, REPO): readers for path in files
                 if len(readers := _flags_readers(path)) > MAX_FLAGS_READERS}
    assert not offenders, (f"absl FLAGS read in more than {MAX_FLAGS_READERS} functions of a module (build a frozen "
                           f"config once with from_flags and pass it down): {offenders}")


def test_flags_reader_check_counts_functions(tmp_path):
    """The checker itself: module-level reads (and a default argument's) do not count, a nested function counts on
    its own (not its parent), FLAGS[...] counts, a function reading twice counts once, another name's attributes and
    FLAGS passed as a value do not count."""
    (tmp_path / "m.py").write_text(
        "FLAGS = flags.FLAGS\nflags.DEFINE_string('x', None, 'x')\nV = FLAGS.x\n\n"
        "def a():\n    return FLAGS.x + FLAGS.y\n\n"
        "def outer():\n    def inner():\n        return FLAGS['x'].value\n    return inner\n\n"
        "class C:\n    async def m(self):\n        return FLAGS.z\n\n"
        "def b(fv=FLAGS, n=FLAGS.n):\n    return fv.x, other.FLAGS, FLAGS\n")
    assert _flags_readers(str(tmp_path / "m.py")) == ["a:5", "inner:9", "m:14"]
