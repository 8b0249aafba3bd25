import os

from trapo import runtime

# Before torch is imported: bounded threads (on the 2-core CI machines unbounded OpenMP
# makes timings swing 40x) and the in-process vLLM engine; see trapo/runtime.py.
runtime.configure()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """A small toy task built once per session: 16 labeled, 48 unlabeled, 16 test questions."""
    from trapo.commands.toy import build_assets
    from trapo.config import ToyConfig

    d = tmp_path_factory.mktemp("toy")
    build_assets(ToyConfig(dir=str(d), labeled=16, unlabeled=48, test=16, sft_steps=150), log=lambda m: None)
    return str(d)


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


def pytest_collection_modifyitems(config, items):
    """`make test` runs two pytest-xdist workers (`--dist loadgroup`): the tests marked two_cores (two ranks
    or two runs at once, some on fixed ports) go to one xdist group, so they run one after another, each
    beside the other worker's single-process tests instead of beside each other."""
    for item in items:
        if item.get_closest_marker("two_cores"):
            item.add_marker(pytest.mark.xdist_group("two_cores"))
