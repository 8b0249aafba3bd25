"""The house rules a maintainer relies on, read from the source: the user's entry point is the command and nothing
else, test-speed machinery lives under tests/, the trainer is composed of parts, and the package speaks of a
user's node (an output folder is an argument, never a variable of some lending arrangement)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trapo"


def imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_the_launchers_script_imports_the_train_command_and_the_console_only():
    tree = ast.parse((ROOT / "trapo_train.py").read_text())
    assert imports(tree) == {"trapo.console", "trapo.commands.train.main"}
    main_block = [n for n in tree.body if isinstance(n, ast.If)]
    assert len(main_block) == 1 and ast.unparse(main_block[0].body) == "console.exit_now(main())"


def test_no_fork_server_or_zygote_in_the_package():
    names = [p.relative_to(ROOT) for p in PACKAGE.rglob("*") if re.search("fork_server|zygote", p.name)]
    assert names == []


def test_the_trainer_has_no_bases_and_no_function_past_60_lines():
    tree = ast.parse((PACKAGE / "training" / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.bases == []
    long = {
        n.name: n.end_lineno - n.lineno + 1
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 60
    }
    assert long == {}, "a step reads as its phases; the work goes to named parts"


def test_the_package_reads_no_OUT_variable_and_speaks_of_no_lent_machine():
    found = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if re.search(r"""environ(\.get)?\(?\[?["']OUT["']|getenv\(["']OUT["']""", text):
            found.append(f"{path.relative_to(ROOT)}: reads OUT")
        if re.search(r"\blent\b|\blending\b", text, re.IGNORECASE):
            found.append(f"{path.relative_to(ROOT)}: speaks of a lent machine")
    assert found == []
