"""`make gpu-kit`: an offline wheel kit for a new GPU node that reaches no package index (`make gpu-check` there).

    python -m trapo gpu-kit [--python 3.12] [--torch 2.11.0+cu130] [--out .gpukit] [--no-trl]

The node is taken to have its own Python and torch (the CUDA build that matches its driver) and the usual
scientific stack; what the trainer imports beyond that is carried here, at the versions this checkout is
tested with (read from the environment that runs this command, i.e. `make setup`'s pins), as wheels for
the node's Python on linux x86_64:

- DeepSpeed, built here from its source release with DS_BUILD_OPS=0 (no prebuilt CUDA ops: the trainer
  uses torch's own AdamW, so no DeepSpeed op is ever compiled), and its pydantic;
- Math-Verify, its LaTeX parser and the ANTLR runtime that parser pins;
- transformers and tokenizers at our pins, and regex and typing-extensions, which they and pydantic need
  newer than a node's may be;
- peft, for model.lora;
- for `make gpu-bench`'s trl_step, TRL and what it needs that such a node lacks (datasets, and datasets' dill
  and multiprocess), at bench/peers/requirements.txt's pins (`make bench-peers` runs the same TRL on CPU);
  a pin there that differs from ours for a wheel both need stops the build (the kit holds one version of
  each). `--no-trl` (`make gpu-kit KIT_TRL=0`) leaves them out: trl_step then says so on the node.

Left out, as a node with torch usually has them at a version we accept: accelerate, psutil, einops, msgpack,
ninja, py-cpuinfo, pyarrow, huggingface-hub, safetensors, pytest, and for TRL and datasets pandas, fsspec,
xxhash, jinja2 and pyyaml (`make gpu-check`'s first lines print the node's versions; docs/gpus.md). On the
node, `make gpu-check` installs only the wheels whose exact version it lacks (`needed`).

`--python` and `--torch` name the node's; their defaults are the ones the GPU check last ran on, read from
the newest report in docs/gpu/ (`last_checked`). The wheels' own torch requirements are checked against
`--torch`. vLLM is not carried (a large wheel that pins its own torch): the GPU check trains with
rollout.backend=hf. `manifest.json` lists the node's Python and torch and each wheel's name, version,
sha256 and bytes.
"""

from __future__ import annotations

import argparse
import email
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from trapo import runtime

KIT_DIR = ".gpukit"
REPORTS = runtime.ROOT / "docs" / "gpu"  # the GPU check's reports, where the defaults are read
# The kit is a few tens of MiB; a wheel or a kit far larger is one the node has itself (a torch, a vLLM)
MAX_FILE = 60 * 2**20
MAX_KIT = 40 * 2**20
# Carried as wheels from the package index (pure Python, or built for the node's CPython).
WHEELS = [
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "hjson",
    "math-verify",
    "latex2sympy2_extended",
    "antlr4-python3-runtime",
    "transformers",
    "tokenizers",
    "regex",
    "peft",  # model.lora
]
BUILT = ["deepspeed"]  # a source release only: built into a wheel here
PEERS = runtime.ROOT / "bench" / "peers" / "requirements.txt"  # TRL's pins, shared with make bench-peers
# gpu-bench's trl_step: TRL and what it needs beyond the node's stack and the wheels above (about 2 MiB)
TRL_WHEELS = ["trl", "datasets", "dill", "multiprocess"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


# A report's Environment block (gpu_check.environment): the Python line, and torch's with the CUDA it was built for
PYTHON_LINE = re.compile(r"^python: Python (\d+\.\d+)\.\d+", re.M)
TORCH_LINE = re.compile(r"^torch (\S+) CUDA \d", re.M)


class KitError(Exception):
    pass


def last_checked(reports: Path = REPORTS) -> tuple[str, str] | None:
    """(Python major.minor, torch version) of the newest report under `reports` (by its dated name) that names
    both, a CUDA torch among them; None when there is none (an installed package carries no reports)."""
    for path in sorted(reports.glob("*.md"), reverse=True):
        text = path.read_text()
        python, torch = PYTHON_LINE.search(text), TORCH_LINE.search(text)
        if python and torch:
            return python[1], torch[1]
    return None


def pinned(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise KitError(f"{name} is not installed here; run `make setup` first (the kit takes its versions)") from None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def trl_specs(path: Path = PEERS) -> list[str]:
    """TRL_WHEELS as `name==version` at `path`'s pins (bench/peers/requirements.txt); KitError where one is not
    pinned there, or where a wheel the kit already carries (WHEELS) is pinned there at another version than ours."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        raise KitError(f"{path} is not here (TRL's pins: a clone of the repository has it); or --no-trl") from None
    pins = dict(
        (canonical(name), version.strip())
        for name, _, version in (line.split("#")[0].partition("==") for line in lines)
        if version.strip()
    )
    if missing := [name for name in TRL_WHEELS if canonical(name) not in pins]:
        raise KitError(f"{path} pins no {', '.join(missing)}")
    differ = [
        f"{name} {pins[canonical(name)]} there, {pinned(name)} here"
        for name in WHEELS
        if canonical(name) in pins and pins[canonical(name)] != pinned(name)
    ]
    if differ:
        raise KitError(f"{path} and this environment pin differently (the kit holds one of each): {'; '.join(differ)}")
    return [f"{name}=={pins[canonical(name)]}" for name in TRL_WHEELS]


def _pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise KitError(f"{' '.join(cmd[2:6])} ...: {(out.stderr or out.stdout).strip().splitlines()[-1]}")


def download(out: Path, python: str, trl: bool = True) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    specs = [f"{name}=={pinned(name)}" for name in WHEELS] + (trl_specs() if trl else [])
    _pip(
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        "cp" + python.replace(".", ""),
        *platforms,
        "-d",
        str(out),
        *specs,
    )
    for name in BUILT:
        with tempfile.TemporaryDirectory() as tmp:
            _pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp, f"{name}=={pinned(name)}")
            (sdist,) = Path(tmp).iterdir()
            env = {**os.environ, "DS_BUILD_OPS": "0"}
            _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(sdist), env=env)


def manifest(out: Path) -> list[dict]:
    rows = []
    for wheel in sorted(out.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        data = wheel.read_bytes()
        rows.append(
            {
                "name": name,
                "version": version,
                "file": wheel.name,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    return rows


def verify(out: Path) -> list[dict]:
    """The manifest, checked against the files (a truncated copy, a wheel left from another kit)."""
    listed = json.loads((out / "manifest.json").read_text())["wheels"]
    found = {r["file"]: r for r in manifest(out)}
    for row in listed:
        if found.get(row["file"]) != row:
            raise KitError(f"{out / row['file']}: missing or not the file the manifest lists; run `make gpu-kit`")
    if set(found) - {r["file"] for r in listed}:
        raise KitError(f"{out}: holds wheels the manifest does not list; run `make gpu-kit` again")
    return listed


def built_for(out: Path) -> dict:
    """The node the kit at `out` was made for: {"python": ..., "torch": ...} (None where its manifest predates them)."""
    listed = json.loads((out / "manifest.json").read_text())
    return {"python": listed.get("python"), "torch": listed.get("torch")}


def torch_conflicts(out: Path, python: str, torch: str) -> list[str]:
    """The kit's wheels whose own torch requirement (their METADATA, extras aside) `torch` does not meet."""
    from packaging.requirements import Requirement

    found = []
    for wheel in sorted(out.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            metadata = email.message_from_string(archive.read(names[0]).decode() if names else "")
        marker = {"extra": "", "python_version": python, "python_full_version": python + ".0"}
        for line in metadata.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.name.lower() != "torch" or (req.marker and not req.marker.evaluate(marker)):
                continue
            if not req.specifier.contains(torch, prereleases=True):
                found.append(f"{wheel.name} requires {req}")
    return found


def needed(rows: list[dict]) -> list[dict]:
    """The kit's wheels whose exact version this Python does not already have (installed or not, the node's
    own copy of the same version is as good, and replacing it would shadow nothing)."""
    missing = []
    for row in rows:
        try:
            have = importlib.metadata.version(row["name"])
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != row["version"]:
            missing.append(row)
    return missing


def build(out: Path, python: str, torch: str, trl: bool = True) -> list[dict]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    download(out, python, trl)
    rows = manifest(out)
    names = {canonical(r["name"]) for r in rows}
    missing = [n for n in WHEELS + BUILT + (TRL_WHEELS if trl else []) if canonical(n) not in names]
    if missing:
        raise KitError(f"the kit lacks {', '.join(missing)}")
    big = [r for r in rows if r["bytes"] > MAX_FILE]
    if big:
        size = big[0]["bytes"] / 2**20
        raise KitError(f"{big[0]['file']}: {size:.1f} MiB, over the {MAX_FILE // 2**20} MiB allowed per file")
    total = sum(r["bytes"] for r in rows)
    if total > MAX_KIT:
        raise KitError(f"the kit is {total / 2**20:.1f} MiB, over the {MAX_KIT // 2**20} MiB expected")
    if conflicts := torch_conflicts(out, python, torch):
        raise KitError(f"the node's torch {torch} does not meet: {'; '.join(conflicts)}")
    node = {"python": python, "torch": torch, "platform": "linux x86_64"}
    (out / "manifest.json").write_text(json.dumps({**node, "wheels": rows}, indent=2) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trapo gpu-kit", description=__doc__.split("\n\n")[0])
    last = last_checked()
    python, torch = last or ("none", "none")
    seen = "the last GPU check's, from docs/gpu/" if last else "no report in docs/gpu/ names one"
    parser.add_argument("--python", help=f"the node's Python, major.minor (default: {python}, {seen})")
    parser.add_argument("--torch", help=f"the node's torch version (default: {torch}, {seen})")
    parser.add_argument("--out", default=KIT_DIR, help="the kit's folder (git-ignored), default .gpukit")
    parser.add_argument("--no-trl", action="store_true", help="without TRL and its needs (gpu-bench's trl_step)")
    args = parser.parse_args(argv)
    python, torch = args.python or (last and last[0]), args.torch or (last and last[1])
    if not python or not torch:
        parser.error("no report in docs/gpu/ names the node's Python and torch: give --python and --torch")
    if not re.fullmatch(r"3\.\d+", python):
        parser.error(f"--python {python}: give major.minor, such as 3.12")
    try:
        rows = build(Path(args.out), python, torch, trl=not args.no_trl)
    except KitError as err:
        print(f"trapo gpu-kit: {err}", file=sys.stderr)
        return 2
    for r in rows:
        print(f"  {r['file']:<70} {r['bytes'] / 2**20:6.2f} MiB")
    total = sum(r["bytes"] for r in rows)
    print(
        f"gpu kit for Python {python}, torch {torch}: {len(rows)} wheels, {total / 2**20:.1f} MiB in {args.out}/ "
        "(manifest.json: sha256 and bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
