"""`make gpu-kit`: the wheels a lent GPU machine lacks, for an offline install there (`make gpu-check`).

    python -m trapo gpu-kit [--out .gpukit]

The lent machines run Python 3.12 with torch 2.11 (CUDA 13), transformers 5.17 and much of the scientific
stack, but no DeepSpeed, Math-Verify or vLLM, and they reach no package index. The kit holds, for Python
3.12 on linux x86_64, what the trainer imports there beyond that image, at the versions this checkout
is tested with (read from the environment that runs this command, i.e. `make setup`'s pins):

- DeepSpeed, built here from its source release with DS_BUILD_OPS=0 (no prebuilt CUDA ops: the trainer
  uses torch's own AdamW, so no DeepSpeed op is ever compiled), and its pydantic;
- Math-Verify, its LaTeX parser and the ANTLR runtime that parser pins;
- transformers and tokenizers at our pins (the image's 5.17 and 0.23.2 are older), and regex and
  typing-extensions, which they and pydantic need newer than an image may have;
- peft, for model.lora (the image's version is not known ahead).

Left out, since the image has them within what we need (KINDS.md's package list, read 2026-11-17):
accelerate 1.15.0 (our pin), psutil, einops, msgpack, ninja, py-cpuinfo, pyarrow, huggingface-hub 1.33,
safetensors 0.8.0, pytest. On the machine, `make gpu-check` installs only the wheels whose exact version
the image lacks (`needed`).

vLLM is not carried (a 330 MB wheel that pins another torch): the GPU check trains with rollout.backend=hf.
Every file is checked against MAX_FILE and the kit against MAX_KIT, so kit plus repository fit one 64 MiB
call. `manifest.json` lists each wheel's name, version, sha256 and bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KIT_DIR = ".gpukit"
MAX_FILE = 60 * 2**20
MAX_KIT = 40 * 2**20  # leaves the repository 24 MiB of a call's 64
# Carried as wheels from the package index (pure Python, or built for CPython 3.12).
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
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


class KitError(Exception):
    pass


def pinned(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise KitError(f"{name} is not installed here; run `make setup` first (the kit takes its versions)") from None


def _pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise KitError(f"{' '.join(cmd[2:6])} ...: {(out.stderr or out.stdout).strip().splitlines()[-1]}")


def download(out: Path) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    specs = [f"{name}=={pinned(name)}" for name in WHEELS]
    _pip(
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
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


def needed(rows: list[dict]) -> list[dict]:
    """The kit's wheels whose exact version this Python does not already have (installed or not, the image's
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


def build(out: Path) -> list[dict]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    download(out)
    rows = manifest(out)
    names = {r["name"].lower().replace("_", "-") for r in rows}
    missing = [n for n in WHEELS + BUILT if n.lower().replace("_", "-") not in names]
    if missing:
        raise KitError(f"the kit lacks {', '.join(missing)}")
    big = [r for r in rows if r["bytes"] > MAX_FILE]
    if big:
        size = big[0]["bytes"] / 2**20
        raise KitError(f"{big[0]['file']}: {size:.1f} MiB, over the {MAX_FILE // 2**20} MiB allowed per file")
    total = sum(r["bytes"] for r in rows)
    if total > MAX_KIT:
        raise KitError(f"the kit is {total / 2**20:.1f} MiB, over {MAX_KIT // 2**20} MiB: it would not travel")
    (out / "manifest.json").write_text(
        json.dumps({"python": "3.12", "platform": "linux x86_64", "wheels": rows}, indent=2) + "\n"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trapo gpu-kit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=KIT_DIR, help="the kit's folder (git-ignored), default .gpukit")
    args = parser.parse_args(argv)
    try:
        rows = build(Path(args.out))
    except KitError as err:
        print(f"trapo gpu-kit: {err}", file=sys.stderr)
        return 2
    for r in rows:
        print(f"  {r['file']:<70} {r['bytes'] / 2**20:6.2f} MiB")
    total = sum(r["bytes"] for r in rows)
    print(f"gpu kit: {len(rows)} wheels, {total / 2**20:.1f} MiB in {args.out}/ (manifest.json: sha256 and bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
