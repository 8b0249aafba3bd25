"""The GPU kit's manifest and the GPU check's dry run (GPU_CHECK_DRY_RUN=1: the same script on CPU, toy and tiny
shapes), so the check a lent GPU machine runs keeps working without one."""

import hashlib
import json
import re
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
    assert names == [
        "kit",
        "shape step (tiny shape, dry run)",
        "pytest -m gpu",
        "doctor (rollout.backend=hf)",
        "bench_update_gpu (tiny shape)",
        "toy kill and resume (hf, float32, launcher)",
        "shape step with LoRA (tiny shape, dry run)",
    ]
    # the update is measured at its full size: random weights' zero advantages and unlabeled answers trained too
    assert all("128 of 128 answers trained" in line for line in lines if "shape step" in line), lines
    # the adapters' count, under the one-GPU LoRA recipe's ZeRO-2 (configs/trapo_1k_3k_lora_1gpu.yaml)
    assert "trainable, ZeRO-2)" in next(line for line in lines if "with LoRA" in line)
    assert "max |loss diff| vs straight 0.00e+00" in out.stdout  # fp32 on CPU: the resume is exact
    # one device call planned from the GPU estimates, what tells most first, within 480 s
    *_, summary, planned = out.stdout.strip().splitlines()
    match = re.fullmatch(r"one call: kit, shape_step, (.*) planned in (\d+) s \(limit 480\)", planned)
    assert match and int(match[2]) <= 480, planned
    text = (Path(ROOT) / summary.split("report ")[-1]).read_text()
    assert "## Environment" in text and "| toy kill and resume (hf, float32, launcher) | pass |" in text
    assert re.search(r"\| shape step \(tiny shape, dry run\) \| pass \| \d+ \(\d+\) \|", text)  # CPU s (GPU estimate)


def test_one_call_plan_takes_checks_in_order_while_the_estimates_fit():
    from trapo.commands.gpu_check import plan

    order = list(plan.ESTIMATES)
    names, total = plan.one_call(order)
    assert names == order[: len(names)] and total <= plan.LIMIT_S
    assert total + plan.ESTIMATES[order[len(names)]] > plan.LIMIT_S  # the next one would not fit
    assert plan.one_call(order, limit=plan.ESTIMATES["kit"]) == (["kit"], plan.ESTIMATES["kit"])
    # the cost model by hand: 2 rounds of 256 rows x 512 decode steps x 28 layers x 1.75 ms
    assert plan.generation_s(plan.R1_1P5B) == pytest.approx(2 * 512 * 28 * 1.75e-3)
    # the toy built once, then 3 processes of (15 + 10) s start and 8 steps x 1.5 s
    assert plan.toy_runs_s(3, 8) == pytest.approx(20 + 3 * (15 + 10 + 8 * 1.5))
    # the one call leaves the kill and resume to a second: the H100's first call ran out of time on it
    assert "kill_resume" not in names
    # (fwd 2 + recompute 2 + bwd 4) x 1.78e9 x 512 x 576 tokens / 300 TFLOP/s; LoRA: no weight gradients (6)
    assert plan.update_s(plan.R1_1P5B) == pytest.approx(8 * 1.78e9 * 512 * 576 / 300e12)
    assert plan.update_s(plan.MATH_7B, 0.0) == pytest.approx(6 * 7.6e9 * 512 * 576 / 300e12)
