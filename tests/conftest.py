import os

from trapo import runtime

# Before torch is imported: bounded threads (on the 2-core CI machines unbounded OpenMP
# makes timings swing 40x) and the in-process vLLM engine; see trapo/runtime.py.
runtime.configure()

import pytest  # noqa: E402

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "benchmarks")


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """A small toy task built once per session: 16 labeled, 48 unlabeled, 16 test questions."""
    from trapo.config import ToyConfig
    from trapo.toy import build_assets

    d = tmp_path_factory.mktemp("toy")
    build_assets(ToyConfig(dir=str(d), labeled=16, unlabeled=48, test=16, sft_steps=150), log=lambda m: None)
    return str(d)


@pytest.fixture(scope="session")
def benchmarks_dir():
    path = os.path.abspath(os.environ.get("TRAPO_BENCHMARKS", SHARED_DATA))
    if not os.path.isdir(path):
        pytest.fail(f"benchmark files not found at {path}; set TRAPO_BENCHMARKS to the folder with math.parquet")
    return path
