"""README.md and docs/: short README, every page on the map, no broken link, no stale path, key or name; the
names that trapo/'s docstrings and comments cite exist too."""

import ast
import dataclasses
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
MD_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG_SRC = re.compile(r"<img\b[^>]*?\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.I)
# A repository path that must exist wherever the text names it: trapo/..., bench/..., tests/..., configs/...
REPO_PATH = re.compile(r"(?<![\w/.<-])((?:trapo|bench|tests|configs)/[\w./-]*\.(?:py|yaml|json))(?![\w/<])")
MODULE = re.compile(r"`(trapo(?:\.\w+)+)")
METHOD = re.compile(r"`([A-Z]\w*)\.(\w+)")  # `Class.attribute` at a code span's start
# Bases that add no attribute a docstring would cite: a class with another outside base may inherit the name.
EMPTY_BASES = {"object", "Protocol", "Generic", "ABC", "NamedTuple", "TypedDict"}


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md")), ROOT / "data" / "benchmarks" / "README.md"]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans: what a renderer turns into links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Relative link targets of a Markdown text (`[..](path)`, `![..](path)`, `<img src=..>`), `#anchor`
    suffixes stripped; web links, mail links and pure anchors left out."""
    body = prose(text)
    out = []
    for target in MD_LINK.findall(body) + IMG_SRC.findall(body):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    text = path.read_text() if text is None else text
    return [t for t in links(text) if not (path.parent / t).exists() or t.startswith("/")]


def missing_paths(text: str) -> list[str]:
    return sorted({p for p in REPO_PATH.findall(text) if not (ROOT / p).exists()})


class Names:
    """What trapo/ defines, read from its source (nothing imported): each module's top-level names (a package's
    submodules among them) and each class's attributes (its body's names, attributes set on self or cls) and
    bases, by class name over every module."""

    def __init__(self, package: Path):
        self.modules: dict[str, set[str]] = {}
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            tree = ast.parse(path.read_text())
            self.modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = bound(tree.body)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    stored = {n.attr for n in ast.walk(node) if assigned_on_self(n)}
                    bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases]
                    self.classes.setdefault(node.name, []).append((bound(node.body) | stored, bases))
        for name in list(self.modules):
            if "." in name:
                package_name, child = name.rsplit(".", 1)
                self.modules.setdefault(package_name, set()).add(child)

    def has(self, cls: str, attribute: str, seen: frozenset = frozenset()) -> bool:
        """Whether some class named `cls` has `attribute`, itself or through a base."""
        for attributes, bases in self.classes.get(cls, []):
            if attribute in attributes:
                return True
            for base in bases:
                if base not in self.classes and base not in EMPTY_BASES:
                    return True  # inherited from outside trapo (a torch module, an exception): not ours to check
                if base in self.classes and base not in seen and self.has(base, attribute, seen | {cls}):
                    return True
        return False

    def resolves(self, dotted: str) -> bool:
        """A module, a module's top-level name, or an attribute of a class a module defines."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in self.modules:
                rest = parts[cut:]
                if not rest:
                    return True
                if rest[0] not in self.modules[module] or len(rest) > 2:
                    return False
                return len(rest) == 1 or (rest[0] in self.classes and self.has(*rest))
        return False


def assigned_on_self(node: ast.AST) -> bool:
    """`self.x = ...` or `cls.x = ...` (an attribute a method gives its instance or class)."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)):
        return False
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def bound(body: list[ast.stmt]) -> set[str]:
    """The names a block of statements binds at its own level (defs, classes, assignments, imports), looking
    into if/try/with blocks, not into functions."""
    out = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            out |= set().union(*(bound(block) for block in blocks))
    return out


@functools.cache
def names() -> Names:
    return Names(ROOT / "trapo")


def missing_modules(text: str) -> list[str]:
    """`trapo.a.b` names in code spans that are neither a module, a module's (or package's) top-level name,
    nor an attribute of a class a module defines."""
    return sorted({dotted for dotted in MODULE.findall(text) if not names().resolves(dotted)})


def missing_methods(text: str) -> list[str]:
    """`Class.attribute` names in code spans, `Class` one of trapo's classes, that no such class has."""
    known = names()
    return sorted({f"{c}.{a}" for c, a in METHOD.findall(text) if c in known.classes and not known.has(c, a)})


def code_prose(source: str) -> str:
    """A module's docstrings (module, classes, functions) and comments: where its text names other code."""
    chunks = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            chunks.append(ast.get_docstring(node, clean=False) or "")
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    chunks += [token.string for token in tokens if token.type == tokenize.COMMENT]
    return "\n".join(chunks)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_and_modules_exist(path):
    text = path.read_text()
    assert missing_paths(text) == [], "a path the text names does not exist"
    assert missing_modules(text) == [], "a module the text names does not exist"
    assert missing_methods(text) == [], "a class of trapo/ the text names lacks that attribute"


def test_names_in_trapo_docstrings_and_comments_resolve():
    """Every backticked `trapo....` and `Class.attribute` (one of our classes) a docstring or comment cites."""
    cited = {}
    for path in sorted((ROOT / "trapo").rglob("*.py")):
        prose_of_code = code_prose(path.read_text())
        if missing := missing_modules(prose_of_code) + missing_methods(prose_of_code):
            cited[str(path.relative_to(ROOT))] = missing
    assert cited == {}, "names that no longer exist (renamed or removed): fix the text"


def test_the_checks_catch_what_they_should(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "there.md").write_text("")
    (tmp_path / "img.png").write_text("")
    text = (
        "[ok](there.md#a-section) ![ok](../img.png) [web](https://example.org/x) [anchor](#top) [mail](mailto:a@b)\n"
        '[gone](missing.md) <img src="../gone.png" width=3> ![gone](sub/fig.png#x)\n'
        "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page, text) == ["missing.md", "sub/fig.png", "../gone.png"]
    assert missing_paths("`trapo/engine/policy.py`, trapo/commands/report/, `trapo/config.py` and vllm/trapo/x.py") == [
        "trapo/config.py"
    ]
    assert missing_paths("configs/<exp>.yaml, `tests/test_docs.py`, bench/nothing_here.py") == ["bench/nothing_here.py"]
    assert missing_modules("`trapo.algorithm.loss`, `trapo.algorithm.loss.policy_loss`, `trapo.commands.report`") == []
    assert missing_modules("`trapo.algorithm.no_such`, `trapo.algorithm.loss.no_such_function`") == [
        "trapo.algorithm.loss.no_such_function",
        "trapo.algorithm.no_such",
    ]
    tracker = "trapo.algorithm.passrate.PassRateTracker"
    assert missing_modules(f"`{tracker}.record`, `{tracker}.ranking`, `{tracker}.no_such`, `{tracker}.record.x`") == [
        f"{tracker}.no_such",
        f"{tracker}.record.x",
    ]
    cited = (
        "`PassRateTracker.load_state_dict()`, `PassRateTracker.ranking`, `Optimizer.load_state_dict`, `Trainer._gone`"
    )
    assert missing_methods(cited) == ["Trainer._gone"]  # torch's Optimizer is not ours: not checked
    source = '"""Module: `Trainer._a`."""\nx = "`Trainer._b`"  # `Trainer._c`\ndef f():\n    """`Trainer._d`"""\n'
    assert missing_methods(code_prose(source)) == ["Trainer._a", "Trainer._c", "Trainer._d"]  # a string is no prose


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move the detail into a page of docs/"


def map_pages() -> list[Path]:
    """The pages the README's documentation map lists, one line each."""
    text = README.read_text()
    start = text.index("<!-- docs-map")
    block = text[start:].split("\n\n", 1)[0]
    return [README.parent / t for t in re.findall(r"^- \[[^\]]+\]\((docs/[^)#]+\.md)\)", block, flags=re.M)]


def test_docs_map_lists_every_page_and_each_exists():
    pages = map_pages()
    assert len(pages) >= 10 and len(set(pages)) == len(pages)
    assert [p for p in pages if not p.is_file()] == []
    assert set(pages) == set(DOCS.glob("*.md")), "every page of docs/ is on the README's map, and only those"
    for required in ("architecture", "configuration", "data", "outputs", "gpus", "memory-plan", "evaluation"):
        assert DOCS / f"{required}.md" in pages
    for required in ("reproduce-toy", "library", "benchmarks"):
        assert DOCS / f"{required}.md" in pages


def test_readme_config_table_lists_every_shipped_config():
    text = README.read_text()
    listed = set(re.findall(r"^\| `([\w.-]+\.yaml)` \|", text, flags=re.M))
    assert listed == {p.name for p in (ROOT / "configs").glob("*.yaml")}


def leaf_keys(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def test_configuration_page_lists_every_key_with_its_default():
    from trapo.config import Config

    text = (DOCS / "configuration.md").read_text()
    tables = text[text.index("<!-- every-key") :]
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", tables, flags=re.M))
    keys = dict(leaf_keys(Config()))
    assert sorted(set(keys) - set(rows)) == [], "keys of trapo/config missing from docs/configuration.md"
    assert sorted(set(rows) - set(keys)) == [], "docs/configuration.md names keys trapo/config does not have"
    wrong = {k: (rows[k], v) for k, v in keys.items() if yaml.safe_load(rows[k]) != v}
    assert wrong == {}, "defaults in docs/configuration.md that differ from trapo/config"


def test_commands_named_in_the_docs_exist():
    from trapo.__main__ import COMMANDS, MAINTAINER

    named = set()
    for path in markdown_files():
        named |= set(re.findall(r"python -m trapo (\w[\w-]*)", path.read_text()))
    assert named <= set(COMMANDS) | set(MAINTAINER), sorted(named - set(COMMANDS) - set(MAINTAINER))
    old_style = [str(p.relative_to(ROOT)) for p in markdown_files() if re.search(r"python -m trapo\.", p.read_text())]
    assert old_style == [], "commands are `python -m trapo <command>` now"


def test_every_trapo_variable_the_package_names_is_documented_as_a_setting():
    named = {}
    for path in sorted((ROOT / "trapo").rglob("*.py")):
        for name in re.findall(r"(?<![A-Z_])TRAPO_[A-Z_]+", path.read_text()):
            named.setdefault(name, str(path.relative_to(ROOT)))
    text = (DOCS / "configuration.md").read_text()
    section = text[text.index("## Environment variables") : text.index("## Every key")]
    documented = set(re.findall(r"`(TRAPO_[A-Z_]+)", section))
    missing = {name: path for name, path in named.items() if name not in documented}
    assert missing == {}, "document each in docs/configuration.md, 'Environment variables', or drop it"
    assert documented <= set(named), "docs/configuration.md documents variables trapo/ no longer reads"


def test_library_example_prints_what_its_comments_say(capsys):
    """The Python example of docs/library.md runs, and each `print(...)  # x` line prints x."""
    text = (DOCS / "library.md").read_text()
    code = re.search(r"^```python\n(.*?)^```", text, flags=re.S | re.M).group(1)
    expected = [line.split("  # ", 1)[1] for line in code.splitlines() if line.startswith("print(")]
    exec(compile(code, "docs/library.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == expected
