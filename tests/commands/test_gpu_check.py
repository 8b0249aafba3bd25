"""The GPU kit's manifest and the node it is made for, and the GPU check's dry run (GPU_CHECK_DRY_RUN=1: the
same script on CPU, toy and tiny shapes), so the check a new GPU node runs keeps working without one; where
its report goes and how its time box plans."""

import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest
from toyrun import ROOT, run

from trapo.commands import gpu_check, gpu_kit
from trapo.commands.gpu_check import plan
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
def test_gpu_check_dry_run_passes_every_check_and_writes_its_report(tmp_path):
    out = run([sys.executable, "-m", "trapo", "gpu-check", "--dry-run", "--report-dir", str(tmp_path)], timeout=900)
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
    # the default time box planned from the GPU estimates, what tells most first, within 480 s
    *_, summary, planned = out.stdout.strip().splitlines()
    match = re.fullmatch(r"time box: kit, shape_step, (.*) planned in (\d+) s \(budget 480\)", planned)
    assert match and int(match[2]) <= 480, planned
    path = Path(ROOT) / summary.split("report ")[-1]
    assert path.parent.resolve() == tmp_path.resolve() and path.name.endswith("-cpu-dry-run.md"), (
        summary
    )  # into --report-dir
    text = path.read_text()
    assert "## Environment" in text and "| toy kill and resume (hf, float32, launcher) | pass |" in text
    assert re.search(r"\| shape step \(tiny shape, dry run\) \| pass \| \d+ \(\d+\) \|", text)  # CPU s (GPU estimate)


def test_time_box_plan_takes_checks_in_order_while_the_estimates_fit():
    order = list(plan.ESTIMATES)
    names, total = plan.within_budget(order)
    assert plan.BUDGET_S == 480 and names == order[: len(names)] and total <= plan.BUDGET_S
    assert total + plan.ESTIMATES[order[len(names)]] > plan.BUDGET_S  # the next one would not fit
    assert plan.within_budget(order, budget=plan.ESTIMATES["kit"]) == (["kit"], plan.ESTIMATES["kit"])
    # the cost model by hand: 2 rounds of 256 rows x 512 decode steps x 28 layers x 1.75 ms
    assert plan.generation_s(plan.R1_1P5B) == pytest.approx(2 * 512 * 28 * 1.75e-3)
    # the toy built once, then 3 processes of (15 + 10) s start and 8 steps x 1.5 s
    assert plan.toy_runs_s(3, 8) == pytest.approx(20 + 3 * (15 + 10 + 8 * 1.5))
    # the default time box leaves the kill and resume to a later run: on an H100 it ran out of time there
    assert "kill_resume" not in names
    # (fwd 2 + recompute 2 + bwd 4) x 1.78e9 x 512 x 576 tokens / 300 TFLOP/s; LoRA: no weight gradients (6)
    assert plan.update_s(plan.R1_1P5B) == pytest.approx(8 * 1.78e9 * 512 * 576 / 300e12)
    assert plan.update_s(plan.MATH_7B, 0.0) == pytest.approx(6 * 7.6e9 * 512 * 576 / 300e12)


def test_report_dir_defaults_to_docs_gpu_in_a_clone_and_gpu_reports_elsewhere(tmp_path, monkeypatch):
    clone, elsewhere = tmp_path / "clone", tmp_path / "elsewhere"
    (clone / ".git").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(gpu_check, "ROOT", clone)
    assert gpu_check.default_report_dir(dry_run=False) == clone / "docs" / "gpu"
    assert gpu_check.default_report_dir(dry_run=True) == gpu_check.WORK / "reports"  # CPU figures stay out of docs/
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path / "installed")  # a package with no clone around it
    assert gpu_check.default_report_dir(dry_run=False) == elsewhere / "gpu-reports"
    assert gpu_check.default_report_dir(dry_run=False) == Path("gpu-reports").resolve()


def test_report_lands_in_report_dir_and_the_budget_plans_the_time_box(tmp_path, monkeypatch, capsys):
    """The command in-process, its checks stood in for: the report goes to --report-dir (never to $OUT), and
    --budget-s decides which checks the time box plans."""

    def fake(check, env, dry_run):
        check.add("fake", True, "ran")

    def kit(check, env, dry_run):
        check.add("kit", True, "stood in")

    monkeypatch.setattr(gpu_check, "WORK", tmp_path / "work")
    monkeypatch.setattr(gpu_check, "environment", lambda dry_run, env: ["nvidia-smi: NVIDIA Test GPU, 1 MiB, 1"])
    monkeypatch.setattr(gpu_check, "install_kit", kit)
    monkeypatch.setattr(gpu_check, "ORDER", [fake])
    monkeypatch.setattr(gpu_check, "CHECKS", {"fake": fake})
    monkeypatch.setattr(plan, "ESTIMATES", {"kit": 15.0, "fake": 100.0})
    monkeypatch.setenv("OUT", str(tmp_path / "out"))  # a variable the command must not read
    (tmp_path / "out").mkdir()
    reports = tmp_path / "reports"

    assert gpu_check.main(["--report-dir", str(reports), "--budget-s", "120"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "time box: kit, fake planned in 115 s (budget 120)" and "[PASS] fake: ran" in lines
    (report,) = reports.glob("*-nvidia-test-gpu.md")
    assert "`make gpu-check BUDGET_S=120`" in report.read_text() and "| fake | pass |" in report.read_text()
    assert list((tmp_path / "out").iterdir()) == []

    assert gpu_check.main(["--report-dir", str(reports), "--budget-s", "50"]) == 0  # fake's 100 s does not fit
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2:] == [
        "time box: kit planned in 15 s (budget 50)",
        "not run or failed here: make gpu-check ONLY=fake",
    ]
    assert "[PASS] fake: ran" not in lines
    with pytest.raises(SystemExit):
        gpu_check.main(["--budget-s", "0"])


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_kit_defaults_to_the_last_checked_node_and_checks_the_wheels_torch_requirements(tmp_path, monkeypatch):
    reports = tmp_path / "gpu"
    reports.mkdir()
    assert gpu_kit.last_checked(reports) is None
    env = "```\npython: Python {}\ntorch {} CUDA {} GPUs 1\n```\n"
    (reports / "2026-01-01-a-gpu.md").write_text(env.format("3.11.9", "2.9.0+cu128", "12.8"))
    (reports / "2026-02-01-a-gpu.md").write_text(env.format("3.12.3", "2.11.0+cu130", "13.0"))
    (reports / "2026-03-01-cpu-dry-run.md").write_text(env.format("3.13.1", "2.11.0+cpu", "None"))  # no GPU: skipped
    assert gpu_kit.last_checked(reports) == ("3.12", "2.11.0+cu130")
    # the shipped reports give the make target's defaults
    assert gpu_kit.last_checked() is not None and re.fullmatch(r"3\.\d+", gpu_kit.last_checked()[0])

    wheels = tmp_path / "kit"
    wheels.mkdir()
    _wheel(wheels, "peft", "1.0", ["torch>=1.13.0", "numpy"])
    _wheel(wheels, "transformers", "5.0", ["torch>=2.4; extra == 'torch'"])  # an extra: not the node's concern
    _wheel(wheels, "old", "1.0", ["torch<2; python_version < '3.8'"])  # not for this Python
    assert gpu_kit.torch_conflicts(wheels, "3.12", "2.11.0+cu130") == []
    assert gpu_kit.torch_conflicts(wheels, "3.12", "1.12.1") == ["peft-1.0-py3-none-any.whl requires torch>=1.13.0"]

    def download(out, python, trl):  # what the index would give, without it
        for name in gpu_kit.WHEELS + gpu_kit.BUILT + (gpu_kit.TRL_WHEELS if trl else []):
            _wheel(out, name.replace("-", "_"), "1.0", ["torch>=2.0"] if name == "deepspeed" else [])

    monkeypatch.setattr(gpu_kit, "download", download)
    rows = gpu_kit.build(tmp_path / "built", "3.11", "2.9.0+cu128")
    assert gpu_kit.built_for(tmp_path / "built") == {"python": "3.11", "torch": "2.9.0+cu128"}
    assert gpu_kit.verify(tmp_path / "built") == rows
    with pytest.raises(KitError, match=r"the node's torch 1.13.1 does not meet: deepspeed-1.0.* requires torch>=2.0"):
        gpu_kit.build(tmp_path / "built", "3.11", "1.13.1")


def test_kit_carries_trl_at_bench_peers_pins_and_can_leave_it_out(tmp_path, monkeypatch):
    # the shipped pins: every wheel TRL needs pinned, and no pin that differs from ours for a wheel both carry
    specs = gpu_kit.trl_specs()
    assert [s.split("==")[0] for s in specs] == ["trl", "datasets", "dill", "multiprocess"]
    assert "trl==1.16.0" in specs
    pins = tmp_path / "requirements.txt"
    pins.write_text("# a comment\ntrl==9.9  # pinned\nDatasets==1.0\ndill==2\nmultiprocess==3\ntorch==2.13.0\n")
    assert gpu_kit.trl_specs(pins) == ["trl==9.9", "datasets==1.0", "dill==2", "multiprocess==3"]
    pins.write_text("trl==9.9\n")
    with pytest.raises(KitError, match="pins no datasets, dill, multiprocess"):
        gpu_kit.trl_specs(pins)
    theirs = gpu_kit.pinned("transformers") + ".1"
    pins.write_text(f"trl==1\ndatasets==1\ndill==1\nmultiprocess==1\ntransformers=={theirs}\n")
    with pytest.raises(KitError, match=f"pin differently .*transformers {theirs} there"):
        gpu_kit.trl_specs(pins)
    with pytest.raises(KitError, match="is not here"):
        gpu_kit.trl_specs(tmp_path / "missing.txt")

    asked = []

    def download(out, python, trl):
        asked.append(trl)
        for name in gpu_kit.WHEELS + gpu_kit.BUILT + (gpu_kit.TRL_WHEELS if trl else []):
            _wheel(out, name.replace("-", "_"), "1.0", [])

    monkeypatch.setattr(gpu_kit, "download", download)
    names = {r["name"] for r in gpu_kit.build(tmp_path / "kit", "3.12", "2.11.0+cu130")}
    assert {"trl", "datasets", "dill", "multiprocess", "deepspeed", "transformers"} <= names
    names = {r["name"] for r in gpu_kit.build(tmp_path / "kit", "3.12", "2.11.0+cu130", trl=False)}
    assert "deepspeed" in names and not names & {"trl", "datasets", "dill", "multiprocess"} and asked == [True, False]

    def no_trl(out, python, trl):  # the index gave no TRL wheel: the kit is refused, not short
        download(out, python, False)

    monkeypatch.setattr(gpu_kit, "download", no_trl)
    with pytest.raises(KitError, match="the kit lacks trl, datasets, dill, multiprocess"):
        gpu_kit.build(tmp_path / "kit", "3.12", "2.11.0+cu130")


def test_gpu_check_refuses_a_kit_made_for_another_python(tmp_path, monkeypatch):
    _wheel(tmp_path, "peft", "1.0", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"python": "2.7", "torch": "1.0", "wheels": manifest(tmp_path)}))
    monkeypatch.setattr(gpu_check, "KIT", tmp_path)
    check = gpu_check.Check()
    gpu_check.install_kit(check, {}, dry_run=False)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert check.rows == [
        (
            "kit",
            False,
            f"made for Python 2.7, torch 1.0, this node runs Python {python}: make gpu-kit KIT_PYTHON={python}",
        )
    ]
    check = gpu_check.Check()
    gpu_check.install_kit(check, {}, dry_run=True)  # the dry run checks the files only
    assert check.rows[0][1] and "made for Python 2.7, torch 1.0, checksums verified" in check.rows[0][2]
