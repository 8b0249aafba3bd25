"""The package's layers (docs/architecture.md): imports only go downward, no import cycle, small modules.

Imports are read from the source (every `import` and `from ... import`, inside functions too), so a lazy
import that crosses a layer counts like a top-level one."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trapo"
# Lowest first: a module may import its own layer and the ones before it.
LAYERS = ["vocabulary", "algorithm", "engine", "training", "commands", "entry"]
SHARED_FLAT = {"config", "data", "console", "runtime", "hub", "faults", "resources"}
MAX_LINES = 500
# The math layer starts no process: grading's processes are trapo/engine/grading/, handed to it as a judge.
PROCESS_MODULES = {"subprocess", "socket", "signal", "multiprocessing", "select", "selectors", "concurrent"}
OS_PROCESS = {"fork", "forkpty", "kill", "killpg", "waitpid", "pidfd_open", "system", "popen", "posix_spawn"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> str:
    parts = name.split(".")
    if name == "trapo.__main__":
        return "entry"
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    if name == "trapo" or parts[1] in SHARED_FLAT:
        return "vocabulary"
    raise AssertionError(f"{name}: in no layer; a module goes into trapo/<layer>/ or is shared vocabulary")


def imported(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules `source` (module `name`) imports: `from a import b` counts as a.b when that is a
    module, else as a; relative imports are resolved against the module's package."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.split(".")[0] == "trapo"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "trapo":
                continue
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return out


def process_use(source: str) -> list[str]:
    """What `source` uses to start, signal or wait on processes: the process modules it imports (inside functions
    too) and `os.fork`, `os.kill` and the like, as attributes of os or imported from it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.split(".")[0] in PROCESS_MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in PROCESS_MODULES:
                out.add(node.module)
            elif node.module == "os":
                out |= {f"os.{alias.name}" for alias in node.names if alias.name in OS_PROCESS}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in OS_PROCESS:
                out.add(f"os.{node.attr}")
    return sorted(out)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: imported(path.read_text(), name, path.name == "__init__.py", set(files)) - {name}
        for name, path in files.items()
    }


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if LAYERS.index(layer_of(b)) > LAYERS.index(layer_of(a))
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_goes_up_a_layer():
    graph = import_graph()
    assert "trapo.training.trainer" in graph and graph["trapo.training.trainer"]  # the reader sees imports
    assert upward(graph) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_see_a_lazy_upward_import_and_a_cycle():
    modules = {"trapo.engine.policy", "trapo.commands.eval", "trapo.commands", "trapo.data"}
    lazy = "def f():\n    from trapo.commands import eval\n"
    graph = {"trapo.engine.policy": imported(lazy, "trapo.engine.policy", False, modules)}
    assert graph["trapo.engine.policy"] == {"trapo.commands.eval"}
    assert upward(graph) == ["trapo.engine.policy (engine) imports trapo.commands.eval (commands)"]
    relative = imported("from ..data import x\nfrom . import eval\n", "trapo.commands", True, modules)
    assert relative == {"trapo.data", "trapo.commands.eval"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_math_layer_starts_no_process():
    found = {
        str(p.relative_to(ROOT)): used
        for p in sorted((PACKAGE / "algorithm").rglob("*.py"))
        if (used := process_use(p.read_text()))
    }
    assert found == {}, "processes, pipes and signals belong to the engine (trapo/engine/grading/ for grading)"


def test_the_process_check_sees_lazy_imports_and_os_calls():
    source = (
        "import os, select\nfrom os import fork\nfrom trapo.algorithm.selection import select as s\n"
        "def f(pid):\n    import signal\n    from multiprocessing import Pool\n    os.kill(pid, 9)\n"
        "    return os.getpid(), os.path.join('a', 'b')\n"
    )
    assert process_use(source) == ["multiprocessing", "os.fork", "os.kill", "select", "signal"]


def test_every_module_under_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these along their seams: {long}"


def test_modules_are_formatted_not_squeezed():
    """The line limit is met by formatted code: no formatter escapes, and `ruff format` would change nothing;
    the tests and benchmarks are formatted the same way."""
    import subprocess
    import sys

    folders = [PACKAGE, ROOT / "tests", ROOT / "bench"]
    sources = [p for folder in folders for p in folder.rglob("*.py")] + [ROOT / "trapo_train.py"]
    escapes = [str(p.relative_to(ROOT)) for p in sources if "fmt: " + "skip" in p.read_text()]
    assert escapes == []
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *map(str, folders), str(ROOT / "trapo_train.py")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("layer", ["algorithm", "engine", "training", "commands"])
def test_each_layer_says_what_it_holds_and_may_import(layer):
    doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
    assert doc and "import" in doc.lower(), f"trapo/{layer}/__init__.py: open with what it holds and may import"


def test_the_shared_vocabulary_stays_small():
    flat = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert set(flat) <= SHARED_FLAT and len(flat) <= 6, flat


# The memory plan sizes the whole run (every section's bytes), so it alone below training reads the whole Config.
PLANS_THE_RUN = {"memory_plan.py", "memory_terms.py", "memory_plan_separate.py"}


def annotation_names(annotation: ast.expr) -> set[str]:
    """The type names an annotation mentions: `Config | None`, `"Config"` and `config.Config` all name Config."""
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names |= annotation_names(ast.parse(node.value, mode="eval").body)
    return names


def whole_config_uses(source: str) -> list[str]:
    """Where `source` takes the whole run's Config: an import of `Config` from trapo.config, or a function
    parameter whose annotation names `Config`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trapo.config"):
            found += [f"imports {a.name}" for a in node.names if a.name == "Config"]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg and arg.annotation and "Config" in annotation_names(arg.annotation):
                    found.append(f"{node.name}({arg.arg}: Config)")
    return found


def test_the_engine_and_the_math_take_the_parts_they_run():
    """No function under trapo/engine or trapo/algorithm takes the whole Config (the memory plan aside): the
    training layer hands them the sections or settings they run (trapo/training/settings.py)."""
    found = {
        str(p.relative_to(ROOT)): uses
        for layer in ("engine", "algorithm")
        for p in sorted((PACKAGE / layer).rglob("*.py"))
        if p.name not in PLANS_THE_RUN and (uses := whole_config_uses(p.read_text()))
    }
    assert found == {}, f"pass these the config sections they read: {found}"
    assert whole_config_uses((PACKAGE / "engine" / "memory_plan.py").read_text())  # the check sees a real one


def test_the_config_check_sees_every_form():
    source = (
        "from trapo.config import Config, LossConfig\n"
        "def a(cfg: Config): ...\n"
        "def b(x, *, cfg: 'Config'): ...\n"
        "def c(lo: LossConfig, cfg: config.Config | None = None): ...\n"
        "class K:\n    def m(self, c: 'trapo.config.Config'): ...\n"
    )
    assert whole_config_uses(source) == [
        "imports Config",
        "a(cfg: Config)",
        "b(cfg: Config)",
        "c(cfg: Config)",
        "m(c: Config)",
    ]
    assert whole_config_uses("from trapo.config import ModelConfig\ndef f(model: ModelConfig): ...\n") == []
