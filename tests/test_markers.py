"""Every test that starts a trainer carries the marker toy_run (`make test-fast` leaves those out; tests/README.md).

A test starts a trainer when it calls toyrun's `train` or `Ranks`, runs the scenario script (`SCENARIO`), or asks
for a fixture or calls a helper of its module that does, however deep. Read from the source, so a test that
would start one is caught before it runs."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STARTERS = {"train", "Ranks", "SCENARIO"}  # toyrun's names that start a trainer


def names_used(node: ast.AST) -> set[str]:
    """The names `node` reads that it does not bind itself (a local `train = ...` is not toyrun's)."""
    names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
    return {n.id for n in names if isinstance(n.ctx, ast.Load)} - {n.id for n in names if isinstance(n.ctx, ast.Store)}


def fixture_args(fn: ast.FunctionDef) -> set[str]:
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs}


def is_fixture(fn: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def marked(node: ast.AST, name: str) -> bool:
    return any(name in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def module_marked(tree: ast.Module, name: str) -> bool:
    return any(
        isinstance(s, ast.Assign)
        and any(getattr(t, "id", "") == "pytestmark" for t in s.targets)
        and name in ast.unparse(s)
        for s in tree.body
    )


def functions(tree: ast.Module):
    """(function, its class or None) for every function at module level or in a class."""
    for s in tree.body:
        if isinstance(s, ast.FunctionDef):
            yield s, None
        elif isinstance(s, ast.ClassDef):
            yield from ((f, s) for f in s.body if isinstance(f, ast.FunctionDef))


def trainer_fixtures(trees: dict[Path, ast.Module]) -> set[str]:
    """Fixtures (in any conftest or test module) that start a trainer, directly or through another such fixture."""
    fixtures = {f.name: f for tree in trees.values() for f, _ in functions(tree) if is_fixture(f)}
    found: set[str] = set()
    while True:
        more = {
            name
            for name, f in fixtures.items()
            if name not in found and (names_used(f) & STARTERS or fixture_args(f) & found)
        }
        if not more:
            return found
        found |= more


def unmarked_starters(trees: dict[Path, ast.Module]) -> list[str]:
    fixtures = trainer_fixtures(trees)
    found = []
    for path, tree in trees.items():
        if not path.name.startswith("test_"):
            continue
        helpers = {f.name: f for f, _ in functions(tree) if not f.name.startswith("test_") and not is_fixture(f)}
        starting = STARTERS | fixtures
        while True:  # this module's helpers that start one, however deep
            more = {n for n, f in helpers.items() if n not in starting and names_used(f) & starting}
            if not more:
                break
            starting |= more
        if module_marked(tree, "toy_run"):
            continue
        for f, cls in functions(tree):
            if not f.name.startswith("test_") or marked(f, "toy_run") or (cls and marked(cls, "toy_run")):
                continue
            if names_used(f) & starting or fixture_args(f) & fixtures:
                found.append(f"{path.relative_to(TESTS.parent)}::{f.name}")
    return found


def parse_suite() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for p in TESTS.rglob("*.py")}


def test_every_test_that_starts_a_trainer_is_marked_toy_run():
    assert unmarked_starters(parse_suite()) == []


def test_the_check_sees_a_direct_start_a_fixture_and_a_helper():
    conftest = ast.parse("@pytest.fixture\ndef shared(toy_dir):\n    return train([])\n")
    module = ast.parse(
        "def helper():\n    return Ranks([])\n\n"
        "def test_direct():\n    train([])\n\n"
        "def test_fixture(shared):\n    pass\n\n"
        "def test_helper():\n    helper()\n\n"
        "@pytest.mark.toy_run\ndef test_marked():\n    train([])\n\n"
        "def test_other():\n    run(['python', '-m', 'trapo', 'eval', '--help'])\n\n"
        "def test_local():\n    train = [1]\n    assert train\n"
    )
    trees = {TESTS / "conftest.py": conftest, TESTS / "test_x.py": module}
    assert unmarked_starters(trees) == [
        "tests/test_x.py::test_direct",
        "tests/test_x.py::test_fixture",
        "tests/test_x.py::test_helper",
    ]
    marked_module = ast.parse("pytestmark = pytest.mark.toy_run\n\ndef test_direct():\n    train([])\n")
    assert unmarked_starters({TESTS / "test_y.py": marked_module}) == []
