"""`make gpu-bench`'s dry run (the same script on CPU, toy and tiny shapes), its profiler summary, and TRL's step
beside ours: the ratios, the row, the estimate, the command it runs, the choice of variants."""

import argparse
import contextlib
import importlib.util
import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from toyrun import ROOT, run

from trapo import runtime
from trapo.commands import gpu_check
from trapo.commands.gpu_check import bench, bench_table, plan
from trapo.commands.gpu_check.profile import profiled, summarize
from trapo.commands.gpu_check.report import Check

shape_step = importlib.import_module(
    "trapo.commands.gpu_check.shape_step"
)  # the module: the package has a check so named


def event(key, device_us=0.0, cpu_us=0.0, count=1):
    return SimpleNamespace(key=key, self_device_time_total=device_us, self_cpu_time_total=cpu_us, count=count)


def test_summary_names_the_longest_kernels_and_the_time_outside_them():
    events = [
        event("gemm_bf16", device_us=6000, cpu_us=50, count=28),
        event("flash_fwd", device_us=3000, count=28),
        event("aten::mm", cpu_us=900),  # an operator: its kernel is counted, not its own CPU time
        event("elementwise", device_us=1000, count=100),
    ]
    summary = summarize(events, wall_s=0.02, device="cuda", top=2)
    # kernels 6 + 3 + 1 ms of 20 ms wall: half of the stretch outside kernels
    assert summary["kernel_s"] == 0.01 and summary["outside_share"] == 0.5
    assert summary["top"] == [
        {"name": "gemm_bf16", "s": 0.006, "share": 0.6, "calls": 28},
        {"name": "flash_fwd", "s": 0.003, "share": 0.3, "calls": 28},
    ]
    on_cpu = summarize(events, wall_s=0.0005, device="cpu")  # CPU: operators are the kernels; share clipped at 0
    assert [r["name"] for r in on_cpu["top"]] == ["aten::mm"] and on_cpu["outside_share"] == 0.0


def test_a_real_profile_of_a_matmul_stretch_is_summarized():
    import torch

    into = {}
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    with profiled("mm", into, "cpu"):  # matmuls alone: no other operator's time can outrank them on a busy machine
        for _ in range(20):
            torch.mm(a, b)
    summary = into["mm"]
    assert summary["top"][0]["name"] == "aten::mm" and summary["top"][0]["calls"] == 20
    assert 0 < summary["kernel_s"] and 0 <= summary["outside_share"] <= 1
    assert sum(r["share"] for r in summary["top"]) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.toy_run
def test_gpu_bench_dry_run_runs_every_variant_and_plans_one_call(tmp_path):
    env = {k: v for k, v in runtime.subprocess_env().items() if k != "GPU_BENCH_TRL"}
    cmd = [sys.executable, "-m", "trapo", "gpu-bench", "--dry-run", "--report-dir", str(tmp_path)]
    out = run(cmd, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert all(line.startswith("[PASS]") for line in rows), rows
    names = [line.split("]", 1)[1].split(":", 1)[0].strip() for line in rows]
    assert names == [
        "kit",
        "shape step (tiny shape, dry run)",
        "profile",
        "profile",
        *["decode"] * 3,  # eager, static, cuda_graph
        "update, no gradient checkpointing (tiny shape, dry run)",
        "update, gradient checkpointing, parameters persistent (tiny shape, dry run)",
        "decode",  # the captured path's GPU tests, skipped on CPU
        "update, gradient checkpointing (tiny shape, dry run)",
        "TRL step (tiny shape, dry run)",
        "update, gradient checkpointing, fused kernels (tiny shape, dry run)",
        "update, gradient checkpointing, micro-batches of 32,768 tokens (tiny shape, dry run)",
        "decode",  # compile
    ]
    assert "profile: a decode stretch" in out.stdout and "tokens/s" in rows[3]
    decode = [line.split("]", 1)[1].strip() for line in rows if "] decode:" in line]
    assert [line.split(" (")[0].split(":")[1].strip() for line in decode] == [
        "eager",
        "static",
        "cuda_graph",
        "captured path's GPU tests",
        "compile",
    ]
    assert "x eager; first call" in decode[1] and "log-prob gap to a plain forward" in decode[1]
    assert all("refused on CPU, as it must be" in line for line in (decode[2], decode[4]))
    assert "skipped" in decode[3]
    assert "not run: GPU_BENCH_TRL=1 runs it" in rows[-4]  # TRL lives outside the suite's environment
    *_, summary, planned = out.stdout.strip().splitlines()
    match = re.fullmatch(
        r"one call: kit, step_profiled, update_no_checkpointing, update_persistent, decode_captured planned in (\d+) s "
        r"\(limit 480\)",
        planned,
    )
    assert match and int(match[1]) <= 480, planned
    report = Path(ROOT) / summary.split("report ")[-1]
    assert report.name.endswith("-cpu-dry-run-bench.md") and report.parent.resolve() == tmp_path.resolve()
    text = report.read_text()
    assert text.startswith("# GPU bench") and "`make gpu-bench` (GPU_CHECK_DRY_RUN=1" in text
    assert "### profile: a decode stretch" in text and "outside kernels" in text
    # the figures as data beside the report, and the GPU table rendered from them
    figures = json.loads(report.with_suffix(".json").read_text())
    assert figures["dry_run"] and figures["step"]["decoding"] == "eager"
    assert set(figures["decode"]) == {"eager", "static", "cuda_graph", "compile"}
    assert set(figures["update"]) == {
        "update_checkpointing",
        "update_no_checkpointing",
        "update_fused",
        "update_persistent",
        "update_micro_32k",
    }
    table = bench_table.render(figures)
    static = figures["decode"]["static"]
    assert f"| decode stretch, static | {static['tokens_per_s']:,.0f} |" in table
    assert f"{static['tokens_per_s'] / figures['decode']['eager']['tokens_per_s']:.2f}x eager" in table
    fused = figures["update"]["update_fused"]
    assert f"| update, gradient checkpointing, fused kernels | {fused['tokens_per_s']:,.0f} |" in table
    assert f"| end to end: one training step | {figures['step']['step_tokens_per_s']:,.0f} per GPU |" in table
    assert table.endswith(bench_table.NEMO_RL)


def test_the_docs_gpu_table_is_the_newest_gpu_figures_file_rendered():
    """docs/benchmarks.md's block is what bench_table writes from the newest GPU run's figures in docs/gpu/ (or
    says that none has run): a figure typed in, or a stale table, fails here."""
    from trapo.commands.readme import replace_block

    newest = bench_table.newest()
    source = str(newest.resolve().relative_to(Path(ROOT).resolve())) if newest else ""
    rendered = bench_table.render(json.loads(newest.read_text()) if newest else None, source)
    page = bench_table.PAGE.read_text()
    assert replace_block(page, bench_table.BLOCK, rendered) == page


def test_update_figures_parse_bench_update_gpus_row_and_plan_line():
    from trapo.commands.gpu_check.bench import update_figures

    row = "ours (chunked head)          17883  19.3%     35.80     1.234"
    plan = "memory plan, update phase: 39.99 GiB planned, 35.80 GiB measured (measured/planned 0.90)"
    assert update_figures(row, plan) == {
        "tokens_per_s": 17883.0,
        "mfu": 0.193,
        "peak_gib": 35.8,
        "plan_gib": 39.99,
        "update_s": 1.234,
    }
    assert update_figures(row.replace("35.80", "nan"), "memory plan: (GPU only)")["plan_gib"] is None


OURS = {  # step_profiled's JSON line (shape_step's second step), the figures trl_step compares with
    "timing_s": {"rollout": 30.0, "grading": 0.1, "update": 12.0, "weight_push": 0.0, "step": 45.0},
    "mean_response_tokens": 511.6,
    "model_dir": "m",
    "train_file": "t.jsonl",
}
TRL = {  # trl_job.py's JSON line: two steps, the first a warm-up
    "side": "trl",
    "version": "1.16.0",
    "generate": [41.0, 20.0],
    "generate_score": [42.0, 20.5],
    "step": [70.0, 36.0],
    "update": [28.0, 15.5],
    "peak_gib": [50.0, 48.25],
    "mean_length": [512.0, 512.0],
    "answers": 512,
}


def test_ours_over_trl_per_phase_from_the_two_rows():
    assert bench.trl_phases(TRL) == {"rollout": 20.0, "update": 15.5, "step": 36.0, "scoring": 0.5}
    assert bench.our_phases(OURS) == {"step": 45.0, "rollout": 30.0, "update": 12.0}
    ratios = bench.ratios(bench.our_phases(OURS), bench.trl_phases(TRL))
    assert ratios == pytest.approx({"step": 45 / 36, "rollout": 1.5, "update": 12 / 15.5})
    assert bench.ratios({"step": 1.0}, {"step": 0.0, "rollout": 2.0}) == {}  # only phases both measured


def test_trl_row_gives_its_phases_and_ours_over_trl_or_why_not():
    figure = bench.trl_figure(TRL, OURS)
    assert figure.startswith(
        "TRL 1.16.0: rollout 20.00 s (13,107 response tokens/s), update 15.50 s, step 36.00 s (scoring 0.50 s), "
        "mean answer 512 tokens, peak 48.2 GiB; "
    )
    assert figure.endswith(
        "ours/TRL: step 1.25x, rollout 1.50x, update 0.77x (below 1: ours faster; ours' mean answer 512 tokens)"
    )
    alone = bench.trl_figure({**TRL, "peak_gib": []}, None, "step_profiled did not run in this call")
    assert alone.endswith("512 tokens; ours/TRL: none, step_profiled did not run in this call")


def test_trl_estimate_one_generation_round_no_recompute_and_the_model_read():
    r1 = plan.R1_1P5B
    read = 2 * r1.params / plan.DISK_BYTES_S
    # every answer decoded in one round of 512 rows (ours: two of 256), the update as ours, two steps
    steps = 2 * (512 * 28 * plan.LAYER_STEP_S + plan.update_s(r1))
    assert plan.trl_step_s(r1) == pytest.approx(plan.PROCESS_S + plan.TRL_START_S + read + steps)
    assert plan.BENCH_ESTIMATES["trl_step"] == plan.trl_step_s(r1)
    built = plan.trl_step_s(r1, build_model=True) - plan.trl_step_s(r1)  # alone: it builds the model first
    assert built == pytest.approx(plan.PROCESS_S + plan.PARAM_S * r1.params + read)
    # the default call holds our step, the update without checkpointing and with persistent parameters, and the
    # captured path's GPU tests; TRL beside our step fits a second call
    names, total = plan.within_budget(list(plan.BENCH_ESTIMATES), plan.BUDGET_S, plan.BENCH_ESTIMATES)
    assert names == ["kit", "step_profiled", "update_no_checkpointing", "update_persistent", "decode_captured"]
    assert total <= plan.BUDGET_S < total + plan.BENCH_ESTIMATES["update_checkpointing"]
    assert [fn.__name__ for fn in bench.ORDER] == list(plan.BENCH_ESTIMATES)[1:]  # the plan's order is the run's
    second = plan.BENCH_ESTIMATES["kit"] + plan.BENCH_ESTIMATES["step_profiled"] + plan.trl_step_s(r1, True)
    assert second <= plan.BUDGET_S


def test_variants_are_chosen_by_name_and_a_second_call_takes_step_profiled_with_trl():
    assert bench._variant_names("trl_step, step_profiled") == ["trl_step", "step_profiled"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant \\['trl'\\]; the variants: step_profiled"):
        bench._variant_names("trl,step_profiled")
    assert bench.rerun({"trl_step"}, set()) == ["step_profiled", "trl_step"]  # its ratios need both in one call
    assert bench.rerun(set(), {"update_no_checkpointing"}) == ["update_no_checkpointing"]
    assert bench.rerun(set(), set()) == []


def test_only_runs_the_named_variants_in_order_and_the_plan_names_the_second_call(tmp_path, monkeypatch, capsys):
    """The command in-process, its variants stood in for."""
    ran = []

    def variant(name, ok=True):
        def fn(check, env, dry_run):
            ran.append(name)
            check.add(name, ok, "ran")

        fn.__name__ = name
        return fn

    order = [variant(n) for n in ("step_profiled", "update_checkpointing", "update_no_checkpointing", "trl_step")]
    monkeypatch.setattr(bench, "ORDER", order)
    monkeypatch.setattr(bench, "VARIANTS", {fn.__name__: fn for fn in order})
    monkeypatch.setattr(gpu_check, "WORK", tmp_path / "work")
    monkeypatch.setattr(gpu_check, "environment", lambda dry_run, env: ["nvidia-smi: NVIDIA Test GPU, 1 MiB, 1"])
    monkeypatch.setattr(gpu_check, "install_kit", lambda check, env, dry_run: check.add("kit", True, "stood in"))
    reports = tmp_path / "reports"

    assert bench.main(["--only", "trl_step,step_profiled", "--report-dir", str(reports)]) == 0
    assert ran == ["step_profiled", "trl_step"]  # ORDER's: trl_step compares with the step before it
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("gpu-bench: 3 passed, 0 failed")  # no plan line: the call was named
    (report,) = reports.glob("*-nvidia-test-gpu-bench-only-step_profiled-trl_step.md")
    assert "`make gpu-bench ONLY=trl_step,step_profiled`" in report.read_text()

    ran.clear()  # a smaller time box: the plan's prefix runs, the last line names the second call
    assert bench.main(["--budget-s", "400", "--report-dir", str(reports)]) == 0
    assert ran == ["step_profiled", "update_checkpointing"]
    lines = capsys.readouterr().out.strip().splitlines()
    kit, step, update = (plan.BENCH_ESTIMATES[n] for n in ("kit", "step_profiled", "update_checkpointing"))
    assert lines[-2:] == [
        f"one call: kit, step_profiled, update_checkpointing planned in {kit + step + update:.0f} s (limit 400)",
        "not run or failed here: make gpu-bench ONLY=step_profiled,update_no_checkpointing,trl_step",
    ]
    with pytest.raises(SystemExit):
        bench.main(["--only", "nothing"])


def _shell(calls, trl_out=None, has_trl=True):
    """gpu-bench's `shell`, stood in for: the TRL probe answered, shape_step --model-only run in-process (the
    real model, tiny), TRL's job answered with `trl_out`."""

    def shell(cmd, env, timeout):
        calls.append(cmd)
        if cmd[1] == "-c":
            return (0 if has_trl else 1), ""
        if cmd[1:3] == ["-m", "trapo.commands.gpu_check.shape_step"]:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                code = shape_step.main(cmd[3:])
            return code, printed.getvalue()
        return 0, "{'loss': 0.0}\n" + json.dumps(trl_out) + "\n"

    return shell


def test_trl_step_on_a_node_runs_trl_at_the_1p5b_shape_and_compares(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "shell", _shell(calls, TRL))
    monkeypatch.setattr(gpu_check, "WORK", tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    ours = {**OURS, "model_dir": str(model), "train_file": str(tmp_path / "t.jsonl")}
    check = Check()
    check.results["step_profiled"] = ours
    bench.trl_step(check, {}, dry_run=False)
    job = calls[-1]  # step_profiled's model, no build
    assert bench.ANSWERS == shape_step.ANSWERS
    assert len(calls) == 2 and job[1] == bench.TRL_JOB and job[job.index("--model") + 1] == str(model)
    for flag, value in (("--tokens", "512"), ("--questions", "64"), ("--n", "8"), ("--steps", "2")):
        assert job[job.index(flag) + 1] == value
    assert job[job.index("--micro-batch") + 1] == "32" and {"--bf16", "--gradient-checkpointing", "--all-rows"} < set(
        job
    )
    ((name, ok, figure),) = check.rows
    assert name == "TRL GRPOTrainer step (1.5B shape, transformers generation)" and ok
    assert "ours/TRL: step 1.25x, rollout 1.50x, update 0.77x" in figure

    check = Check()  # step_profiled failed before it: the same model, but no step to compare with
    check.results["step_profiled"], check.failed_checks = ours, {"step_profiled"}
    bench.trl_step(check, {}, dry_run=False)
    assert check.rows[0][1] and check.rows[0][2].endswith(
        "ours/TRL: none, step_profiled failed in this call (make gpu-bench ONLY=step_profiled,trl_step)"
    )

    check = Check()  # no TRL in the kit
    monkeypatch.setattr(bench, "shell", _shell(calls, TRL, has_trl=False))
    bench.trl_step(check, {}, dry_run=False)
    assert check.rows == [(name, False, "TRL is not importable here: make gpu-kit without KIT_TRL=0")]

    check = Check()  # TRL's answers not at the forced length: no comparison
    check.results["step_profiled"] = ours
    monkeypatch.setattr(bench, "shell", _shell(calls, {**TRL, "mean_length": [512.0, 500.5]}))
    bench.trl_step(check, {}, dry_run=False)
    assert check.rows[0][1:] == (False, "TRL's answers averaged 500.5 tokens, not 512")


def test_trl_step_alone_builds_the_same_model_and_says_there_is_no_comparison(tmp_path, monkeypatch):
    calls = []
    tiny = {**TRL, "mean_length": [32.0, 32.0], "answers": 128}
    monkeypatch.setattr(bench, "shell", _shell(calls, tiny))
    monkeypatch.setattr(gpu_check, "WORK", tmp_path)
    check = Check()
    bench.trl_step(check, {}, dry_run=True)  # the dry run without GPU_BENCH_TRL: not run
    assert check.rows == [("TRL step (tiny shape, dry run)", True, bench.NOT_RUN)] and calls == []
    check = Check()
    bench.trl_step(check, {"GPU_BENCH_TRL": "1"}, dry_run=True)
    build, job = calls[-2:]
    assert build[3:] == ["--work", str(tmp_path / "bench-trl"), "--model-only", "--dry-run"]
    assert job[job.index("--model") + 1] == str(tmp_path / "bench-trl" / "model") and "--bf16" not in job
    assert (
        Path(job[job.index("--train") + 1]).is_file() and (tmp_path / "bench-trl" / "model" / "config.json").is_file()
    )
    ((_, ok, figure),) = check.rows
    assert ok and figure.endswith(
        "ours/TRL: none, step_profiled did not run in this call (make gpu-bench ONLY=step_profiled,trl_step)"
    )


def _has_trl() -> bool:
    return importlib.util.find_spec("trl") is not None or bench.PEERS_PYTHON.exists()


@pytest.mark.toy_run
@pytest.mark.skipif(not _has_trl(), reason="TRL is neither here nor in .venv-peers (make bench-peers)")
def test_gpu_bench_dry_run_runs_trl_beside_our_step_when_asked(tmp_path):
    env = runtime.subprocess_env(GPU_BENCH_TRL="1")
    cmd = [sys.executable, "-m", "trapo", "gpu-bench", "--dry-run", "--only", "step_profiled,trl_step"]
    out = run([*cmd, "--report-dir", str(tmp_path)], timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("[PASS] TRL step (tiny shape, dry run)"))
    assert re.search(r"mean answer 32 tokens; ours/TRL: step [\d.]+x, rollout [\d.]+x, update [\d.]+x", row), row
