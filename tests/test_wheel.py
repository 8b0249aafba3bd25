"""The wheel as users get it: built from this checkout, installed with --no-deps into a scratch virtual environment
that sees the project's installed dependencies (not this checkout), and run from an empty directory: `trapo
train` (the toy, 2 steps), `trapo eval` on a shipped benchmark, `trapo doctor` and `trapo configs`.

The scratch environment is the issue's new user: torch and the rest installed, vLLM not (an `import vllm`
fails there), so `rollout.backend: auto` runs the hf backend; the vLLM path is the rest of the suite's. Every
file any of its processes opens is checked by an audit hook: one under this checkout (outside its virtual
environment, whose packages it borrows) fails the test, so a resource read from the clone cannot pass unseen.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest
import toyrun

from trapo import runtime

ROOT = runtime.ROOT
pytestmark = [pytest.mark.toy_run, pytest.mark.xdist_group("wheel")]  # one build per session

# What a build reads: the package, the files setup.py ships into it, the build's own files.
SOURCES = ["trapo", "configs", "data/benchmarks", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md"]
# Small toy (tests/toyrun.py TOY) and batches: two steps in seconds.
TOY = [*toyrun.TOY, "progress_bar=false"]
BATCH = ["train.rollout_batch_size=16", "train.update_batch_size=16", "rollout.n=4"]

# Loaded by a .pth line at every interpreter start in the scratch environment.
GUARD = textwrap.dedent(
    """\
    import os
    import sys

    sys.modules.setdefault("vllm", None)  # a machine without vLLM: `import vllm` raises ImportError
    _CLONE = [p for p in os.environ.get("TRAPO_GUARD_CLONE", "").split(os.pathsep) if p]
    _ALLOWED = [p for p in os.environ.get("TRAPO_GUARD_ALLOWED", "").split(os.pathsep) if p]
    _LOG = os.environ.get("TRAPO_GUARD_LOG")
    _inside = False


    def _under(path, roots):
        return any(path == r or path.startswith(r + os.sep) for r in roots)


    def _hook(event, args):
        global _inside
        if event != "open" or _inside or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.abspath(os.fsdecode(args[0]))
        if _under(path, _CLONE) and not _under(path, _ALLOWED):
            _inside = True
            try:
                if _LOG:
                    with open(_LOG, "a") as f:
                        f.write(path + "\\n")
            finally:
                _inside = False
            raise PermissionError(f"read from the clone: {path}")


    if _CLONE:
        sys.addaudithook(_hook)
    """
)


def both(path) -> list[str]:
    return sorted({os.path.abspath(path), os.path.realpath(path)})


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of this checkout's sources (the build writes build/ and *.egg-info beside them)."""
    src = tmp / "src"
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, src / name)
    try:
        import setuptools  # noqa: F401 - present: build with it, offline

        isolation = ["--no-build-isolation"]
    except ImportError:  # a venv without setuptools (Python 3.12's): pip fetches the build backend
        isolation = []
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(tmp / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp / "dist").glob("trapo-*.whl")
    return wheel


def scratch_venv(tmp: Path, wheel: Path) -> Path:
    """A virtual environment with the wheel alone installed, seeing this environment's packages through a .pth
    path line (a plain path: the editable install's own .pth files there are not processed)."""
    env = tmp / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    python = env / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "_trapo_wheel_test_guard.py").write_text(GUARD)
    (site / "zz_trapo_wheel_test.pth").write_text("import _trapo_wheel_test_guard\n" + "\n".join(ours) + "\n")
    out = subprocess.run(
        # --ignore-installed: the borrowed site-packages hold this checkout's editable trapo of the same version,
        # which pip would otherwise take as the wheel already installed
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and (env / "bin" / "trapo").is_file(), out.stdout + out.stderr  # pip says what it did
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    env = scratch_venv(tmp, build_wheel(tmp))
    work = tmp / "empty"
    work.mkdir()
    guard_log = tmp / "clone-reads.txt"
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    environ.update(
        runtime.settings(),
        PATH=f"{env / 'bin'}{os.pathsep}{environ.get('PATH', '')}",
        TRAPO_GUARD_CLONE=os.pathsep.join(both(ROOT)),
        TRAPO_GUARD_ALLOWED=os.pathsep.join(both(sys.prefix)),  # the packages it borrows may sit in the clone
        TRAPO_GUARD_LOG=str(guard_log),
    )

    def trapo(*args, timeout=600):
        out = subprocess.run(
            [env / "bin" / "trapo", *args], cwd=work, env=environ, capture_output=True, text=True, timeout=timeout
        )
        reads = guard_log.read_text() if guard_log.is_file() else ""
        assert not reads, f"trapo {' '.join(args)} read from the clone:\n{reads}"
        return out

    trapo.environ = environ
    return env, work, trapo


def test_the_guard_sees_a_read_from_the_clone(installed, tmp_path):
    """The check below is live: a process of the scratch environment that opens a file of this checkout fails
    (and is logged), and one that imports trapo from the checkout (PYTHONPATH, as `make test` sets it) too."""
    env, work, trapo = installed
    environ = {**trapo.environ, "TRAPO_GUARD_LOG": str(tmp_path / "log")}
    python = env / "bin" / "python"
    read = subprocess.run(
        [python, "-c", f"open({str(ROOT / 'pyproject.toml')!r})"], cwd=work, env=environ, capture_output=True, text=True
    )
    assert read.returncode != 0 and "read from the clone" in read.stderr
    imported = subprocess.run(
        [python, "-c", "import trapo.resources"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**environ, "PYTHONPATH": str(ROOT)},
    )
    assert imported.returncode != 0 and "read from the clone" in imported.stderr
    assert str(ROOT / "pyproject.toml") in (tmp_path / "log").read_text()


def test_the_installed_package_and_its_resources_are_the_wheels(installed):
    env, work, trapo = installed
    where = subprocess.run(
        [
            env / "bin" / "python",
            "-c",
            "import trapo, trapo.resources as r; print(trapo.__file__); "
            "print(r.shipped('configs')); print(r.shipped('benchmarks'))",
        ],
        cwd=work,
        env=trapo.environ,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr
    for line in where.stdout.split():
        assert Path(line).is_relative_to(env), line  # the package and its shipped files: inside the scratch venv
    out = trapo("configs")
    assert out.returncode == 0, out.stderr
    assert (
        str(env) in out.stdout.splitlines()[0] and "trapo_1k_3k " in out.stdout and "deepspeed_zero3.json" in out.stdout
    )
    shown = trapo("configs", "show", "trapo_1k_3k")
    assert shown.returncode == 0 and shown.stdout == (ROOT / "configs" / "trapo_1k_3k.yaml").read_text()
    helped = trapo("train", "--config", "trapo_1k_3k", "--help")
    assert helped.returncode == 0 and "trapo configs" in helped.stdout


def test_train_eval_and_doctor_run_from_an_empty_directory(installed):
    env, work, trapo = installed
    out = trapo("train", "max_steps=2", *TOY, *BATCH)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("rollout.backend auto: hf (vLLM is not installed") == 1  # said once
    config = (work / "outputs" / "toy" / "config.yaml").read_text()
    assert "backend: hf" in config  # recorded as what ran
    model = work / "outputs" / "toy-assets" / "seed-0" / "model"
    out = trapo(
        "eval",
        "--model",
        str(model),
        "--benchmarks",
        "math",
        "--limit",
        "2",
        "--n",
        "1",
        "--max-tokens",
        "8",
        "--out",
        str(work / "eval"),
        "--no-progress",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (work / "eval" / "samples.jsonl").is_file()
    out = trapo("doctor", *TOY)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 failed" in out.stdout and "hf: " in out.stdout
