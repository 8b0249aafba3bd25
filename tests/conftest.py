"""Fixtures for the whole suite. The tests mirror the package's layers: tests/algorithm, tests/engine,
tests/training and tests/commands test the modules of that layer; the project-wide checks (config, data,
layers, docs, wiring) sit here at the top. Toy-run helpers: tests/toyrun.py; shared toy runs:
tests/training/conftest.py. `make test-fast` leaves out the tests marked toy_run (they start trainers)."""

import fcntl
import os
import tempfile

from trapo import runtime

# Before torch is imported: bounded threads (on the 2-core CI machines unbounded OpenMP
# makes timings swing 40x) and the in-process vLLM engine; see trapo/runtime.py.
runtime.configure()
# The suite never reaches the Hugging Face hub: hub ids resolve from a cache the test builds (`hub_cache`),
# and a run that would download fails in one line instead of waiting on the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = os.path.join(tempfile.gettempdir(), "trapo-tests-empty-hub-cache")

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, whose group names this checks
def pytest_collection_modifyitems(config, items):
    """The tests that start trainers first, the rest after them in their order: under `make test`'s two workers
    the many short tests then fill the end, instead of one worker starting a minute-long run while the other
    has nothing left (the same order on every worker, as pytest-xdist requires)."""
    _xdist_groups(config, items)
    items.sort(key=lambda item: item.get_closest_marker("toy_run") is None)


def _xdist_groups(config, items):
    """Each `xdist_group` test's group on the node id pytest reads, as `--dist loadgroup` needs it (`<id>@<group>`).
    pytest-xdist 3.8 writes it to `item._nodeid`, which pytest 9.2 no longer reads (its node ids are structured,
    `item._id`): every group was silently ignored, and a shared toy run (training/conftest.py) ran once on each
    worker that drew one of its tests (pytest-dev/pytest-xdist#1386). Where xdist's suffix took, nothing changes."""
    if not getattr(config.option, "loadgroup", False):  # set in an xdist worker under --dist loadgroup
        return
    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            item._id = type(item._id).parse(item.nodeid + suffix)


@pytest.fixture(scope="session", autouse=True)
def grader_parent():
    """This worker's grader parent (tests/forking/graders.py): every Math-Verify verifier of the session in this
    process (and in a trainer it starts that calls `graders.install()`) forks its supervisor from it instead of
    paying sympy's imports and Math-Verify's warm-up (~1 s of CPU) each time. None with TRAPO_TESTS_FORK=0 (as
    tests/toyrun.py)."""
    from forking import graders

    if os.environ.get("TRAPO_TESTS_FORK", "1") == "0":
        yield None
        return
    parent = graders.GraderParent()
    os.environ[graders.ENV] = parent.name
    graders.install()
    yield parent
    graders.uninstall()
    del os.environ[graders.ENV]
    parent.close()


def _session_root(tmp_path_factory, worker_id):
    """The session's temporary directory, shared by the pytest-xdist workers (each has its own below it)."""
    root = tmp_path_factory.getbasetemp()
    return root if worker_id == "master" else root.parent


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory, worker_id):
    """A small toy task built once per session (tests/toyrun.py `TOY`): 16 labeled, 48 unlabeled, 16 test
    questions. The pytest-xdist workers share it: the first to take the lock builds it, the others then find
    it built (`build_assets` reuses a directory whose manifest matches)."""
    from toyrun import TOY, start_server

    from trapo.commands.toy import build_assets
    from trapo.config import load_config

    start_server()  # the toy runs' parent imports while the toy is built, or while another worker builds it
    root = _session_root(tmp_path_factory, worker_id)
    # the toy the runs' overrides name (configs/toy.yaml under TOY), so that every run finds it built
    toy = load_config(os.path.join(runtime.ROOT, "configs", "toy.yaml"), [f"toy.dir={root / 'toy-shared'}", *TOY]).toy
    with open(root / "toy-shared.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build_assets(toy, log=lambda m: None)
    return str(root / "toy-shared")


@pytest.fixture(scope="session")
def benchmarks_dir():
    from trapo.data import benchmarks_dir as configured

    path = os.path.abspath(configured())
    if not os.path.isfile(os.path.join(path, "math.parquet")):
        pytest.fail(f"benchmark files not found at {path}; they ship in data/benchmarks (TRAPO_BENCHMARKS overrides)")
    return path


@pytest.fixture
def small_disk(tmp_path, request):
    """A real small filesystem (tmpfs; mounting needs root, which CI has), else None. Its size comes from
    `@pytest.mark.parametrize("small_disk", ["2m"], indirect=True)`; default 64m."""
    import subprocess

    size = getattr(request, "param", "64m")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        yield None
        return
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture
def tty(monkeypatch):
    """The user's terminal replaced by a stand-in that is a tty and keeps what is written (`tty.text`):
    what a progress bar shows (trapo.console.progress_bar draws only on a tty)."""
    from trapo import console

    class Tty:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return True

    stand_in = Tty()
    monkeypatch.setattr(console, "_terminal", stand_in)
    return stand_in


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face hub cache in a temp dir, laid out as huggingface_hub writes one
    (`models--org--name/snapshots/<commit>/...`, `refs/<branch>` holding the commit), with HF_HUB_CACHE
    pointing at it and HF_HUB_OFFLINE=1 set (in this process and in subprocesses started with os.environ).

    `hub_cache.add(repo_id, files_dir, commit, ref="main", repo_type="model")` copies a directory in as a
    snapshot and points `ref` at it; it returns the snapshot directory."""
    import shutil

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    class Cache:
        path = root

        @staticmethod
        def add(repo_id, files_dir, commit, ref="main", repo_type="model"):
            repo = root / f"{repo_type}s--{repo_id.replace('/', '--')}"
            snapshot = repo / "snapshots" / commit
            shutil.copytree(files_dir, snapshot)
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            if ref:
                (repo / "refs" / ref).write_text(commit)
            return snapshot

    return Cache
