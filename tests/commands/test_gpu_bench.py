"""`make gpu-bench`'s dry run (the same script on CPU, toy and tiny shapes) and its profiler summary."""

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from toyrun import ROOT, run

from trapo.commands.gpu_check import bench_table
from trapo.commands.gpu_check.profile import profiled, summarize


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
    out = run([sys.executable, "-m", "trapo", "gpu-bench", "--dry-run", "--report-dir", str(tmp_path)], timeout=900)
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
        "update, gradient checkpointing (tiny shape, dry run)",
        "update, no gradient checkpointing (tiny shape, dry run)",
        "update, gradient checkpointing, fused kernels (tiny shape, dry run)",
        "update, gradient checkpointing, parameters persistent (tiny shape, dry run)",
        "decode",  # compile
    ]
    assert "profile: a decode stretch" in out.stdout and "tokens/s" in rows[3]
    decode = [line.split("]", 1)[1].strip() for line in rows if "] decode:" in line]
    assert [line.split(" (")[0] for line in decode] == [
        f"decode: {p}" for p in ("eager", "static", "cuda_graph", "compile")
    ]
    assert "x eager; first call" in decode[1] and "log-prob gap to a plain forward" in decode[1]
    assert all("refused on CPU, as it must be" in line for line in decode[2:])
    *_, summary, planned = out.stdout.strip().splitlines()
    match = re.fullmatch(
        r"one call: kit, step_profiled, update_checkpointing, update_no_checkpointing planned in (\d+) s "
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
