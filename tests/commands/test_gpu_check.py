"""The GPU kit's manifest and the GPU check's dry run (GPU_CHECK_DRY_RUN=1: the same script on CPU, toy and tiny
shapes), so the check a lent GPU machine runs keeps working without one."""

import hashlib
import json
import sys
from pathlib import Path

import pytest
from toyrun import ROOT, run

from trapo.commands.gpu_kit import KitError, manifest, verify


def test_kit_manifest_lists_checksums_and_catches_a_changed_or_stray_wheel(tmp_path):
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"first wheel")
    (tmp_path / "b_c-2.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"second")
    rows = manifest(tmp_path)
    assert [(r["name"], r["version"], r["bytes"]) for r in rows] == [("a", "1.0", 11), ("b_c", "2.0", 6)]
    assert rows[0]["sha256"] == hashlib.sha256(b"first wheel").hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps({"wheels": rows}))
    assert verify(tmp_path) == rows
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"first whee")  # truncated in transfer
    with pytest.raises(KitError, match="a-1.0-py3-none-any.whl: missing or not the file"):
        verify(tmp_path)
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"first wheel")
    (tmp_path / "z-9-py3-none-any.whl").write_bytes(b"stray")
    with pytest.raises(KitError, match="holds wheels the manifest does not list"):
        verify(tmp_path)


@pytest.mark.toy_run
def test_gpu_check_dry_run_passes_every_check_and_writes_its_report():
    out = run([sys.executable, "-m", "trapo", "gpu-check", "--dry-run"], timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("[")]
    names = [line.split("]", 1)[1].split(":", 1)[0].strip() for line in lines]
    assert all(line.startswith("[PASS]") for line in lines), lines
    assert names == ["kit", "doctor (rollout.backend=hf)", "pytest -m gpu", "bench_update_gpu (tiny shape)",
                     "toy kill and resume (hf, float32, launcher)", "shape step (tiny shape, dry run)",
                     "shape step with LoRA (tiny shape, dry run)"]  # fmt: skip
    assert "trainable)" in next(line for line in lines if "with LoRA" in line)  # the adapters' count
    assert "max |loss diff| vs straight 0.00e+00" in out.stdout  # fp32 on CPU: the resume is exact
    report = out.stdout.strip().splitlines()[-1].split("report ")[-1]
    text = (Path(ROOT) / report).read_text()
    assert "## Environment" in text and "| toy kill and resume (hf, float32, launcher) | pass |" in text
