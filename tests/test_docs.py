"""README.md and docs/: short README, every page on the map, no broken link, no stale path or key."""

import dataclasses
import re
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


def missing_modules(text: str) -> list[str]:
    """`trapo.a.b` names in code spans that are neither a module nor a module's (or package's) attribute."""
    out = []
    for dotted in set(MODULE.findall(text)):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:cut])
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if source.is_file():
                rest = parts[cut:]
                # one attribute may follow a module (a function, class or constant it defines or imports)
                if len(rest) > 1 or (rest and not re.search(rf"\b{rest[0]}\b", source.read_text())):
                    out.append(dotted)
                break
        else:
            out.append(dotted)
    return sorted(out)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_and_modules_exist(path):
    text = path.read_text()
    assert missing_paths(text) == [], "a path the text names does not exist"
    assert missing_modules(text) == [], "a module the text names does not exist"


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
        named |= set(re.findall(r"python -m trapo (\w+)", path.read_text()))
    assert named <= set(COMMANDS) | set(MAINTAINER), sorted(named - set(COMMANDS) - set(MAINTAINER))
    old_style = [str(p.relative_to(ROOT)) for p in markdown_files() if re.search(r"python -m trapo\.", p.read_text())]
    assert old_style == [], "commands are `python -m trapo <command>` now"


def test_library_example_prints_what_its_comments_say(capsys):
    """The Python example of docs/library.md runs, and each `print(...)  # x` line prints x."""
    text = (DOCS / "library.md").read_text()
    code = re.search(r"^```python\n(.*?)^```", text, flags=re.S | re.M).group(1)
    expected = [line.split("  # ", 1)[1] for line in code.splitlines() if line.startswith("print(")]
    exec(compile(code, "docs/library.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == expected
