"""Our step beside TRL's GRPOTrainer on the same toy job, and on the real-model job: `make bench-peers`.

The job, on both sides: the toy's model and labeled questions, 16 questions x 8 answers per step forced to
each length (rollout.min_tokens on ours, min_new_tokens on TRL's), Dr.GRPO without KL or entropy terms,
one update per step, fp32 on CPU, OMP_NUM_THREADS=1. Each side runs in its own process (TRL in
.venv-peers, which `make bench-peers` builds from bench/peers/requirements.txt); the sides take turns in
alternating order, `--pairs` times per length, so a slow stretch of a shared machine falls on all of them.
Each process's first step is a warm-up and is left out. The real-model job (`--job real`, docs/real-model.md) is
the same on SmolLM2-135M-Instruct (`trapo get-model`) and configs/real_smollm2.yaml's 16 labeled word problems,
each with its stored chat (worked examples included; TRL gets it as a conversational prompt), 8 questions x 8
answers a step, at temperature 1.0 on both sides. Prints medians and ratios, saves them to
outputs/bench/peers.txt and writes the `bench-peers` block of docs/benchmarks.md and the README's
`peers-ratios` block.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
SIDES = ("ours-hf", "ours-vllm", "trl")


REAL_MODEL = ROOT / "models/SmolLM2-135M-Instruct"
REAL_QUESTIONS = 8


def run_side(side: str, tokens: int, steps: int, toy: Path | None, peers_python: str, real: Path | None = None) -> dict:
    """One side's process on the toy job (`toy`: its asset folder) or the real job (`real`: its rows' JSONL)."""
    from trapo import runtime

    env = runtime.subprocess_env(OMP_NUM_THREADS="1")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):  # each side is its own world
        env.pop(key, None)
    if side == "trl":
        cmd = [peers_python, str(ROOT / "bench/peers/trl_job.py"), "--out", str(ROOT / "outputs/bench/trl-run")]
        job = ["--toy", str(toy / "seed-0")] if real is None else ["--model", str(REAL_MODEL), "--train", str(real)]
        cmd += job
    else:
        cmd = [sys.executable, str(ROOT / "bench/peers/ours.py"), "--backend", side[5:]]
        cmd += ["--toy", str(toy)] if real is None else ["--real"]
    if real is not None:
        cmd += ["--questions", str(REAL_QUESTIONS)]
    cmd += ["--tokens", str(tokens), "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{") and '"side"' in line]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"bench-peers: {side} at {tokens} tokens failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1])
    if reason := not_comparable(side, tokens, result):
        raise SystemExit(f"bench-peers: {reason}")
    return result


def not_comparable(side: str, tokens: int, result: dict) -> str | None:
    """Why one side's measured steps (each process's first left out) cannot stand beside the others', or None."""
    lengths = result["mean_length"][1:]
    if lengths and min(lengths) != tokens:  # the comparison is only fair at equal lengths
        return f"{side} generated {lengths} tokens on average, not the forced {tokens}"
    if any(result.get("skipped", [])[1:]):  # a batch without signal skips our update, never TRL's
        return f"{side} at {tokens} tokens skipped an update (every reward equal): not comparable"
    return None


def summarize(runs: list[dict]) -> dict:
    """Medians over every measured step (each process's first left out) and the start-ups."""
    step = [s for r in runs for s in r["step"][1:]]
    generate = [g for r in runs for g in r["generate"][1:]]
    rest = [s - g for r in runs for s, g in zip(r["step"][1:], r["generate"][1:])]
    return {
        "step": statistics.median(step),
        "generate": statistics.median(generate),
        "rest": statistics.median(rest),
        "startup": statistics.median(r["startup"] for r in runs),
        "reward": statistics.mean(x for r in runs for x in r["reward"][1:]),
        "steps": len(step),
    }


def build_toy(toy_dir: Path) -> None:
    """The toy's model and data, built (or reused) before any side is timed: a start-up must not hold the build."""
    from trapo import runtime

    runtime.configure()  # before torch is imported
    from trapo.commands.toy import build_assets
    from trapo.config import load_config

    build_assets(load_config(str(ROOT / "configs" / "toy.yaml"), [f"toy.dir={toy_dir}"]).toy)


def real_rows(dest: Path) -> Path:
    """The real job's labeled questions with their stored chats, as TRL's side reads them (JSONL), from the
    training file configs/real_smollm2.yaml names (make word-problems writes it)."""
    import yaml

    from trapo.data import load_questions

    cfg = yaml.safe_load((ROOT / "configs/real_smollm2.yaml").read_text())
    questions = [q for q in load_questions([str(ROOT / f) for f in cfg["data"]["train_files"]]) if q.labeled]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w") as f:
        for q in questions:
            messages = [{"role": r, "content": c} for r, c in q.messages]
            f.write(
                json.dumps({"question": q.question, "messages": messages, "answer": q.answer, "labeled": True}) + "\n"
            )
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--job", choices=("toy", "real"), default="toy", help="real: SmolLM2-135M-Instruct (make train-real's)"
    )
    ap.add_argument("--tokens", help="forced response lengths, comma-separated (toy: 64,256; real: 48)")
    ap.add_argument("--pairs", type=int, default=2, help="rounds per length; each round runs every side once")
    ap.add_argument("--steps", type=int, default=4, help="steps per process (the first is a warm-up)")
    ap.add_argument("--peers-python", default=str(ROOT / ".venv-peers/bin/python"))
    ap.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    args = ap.parse_args()
    real = args.job == "real"
    toy_dir = None if real else ROOT / "outputs/toy-assets"  # shared by every side
    rows = real_rows(ROOT / "outputs/bench/peers-real/train.jsonl") if real else None
    if not real:
        build_toy(toy_dir)
    job = (
        f"real-model job (SmolLM2-135M-Instruct, word problems with their worked examples): {REAL_QUESTIONS} "
        "questions x 8 answers forced to N tokens, temperature 1.0"
        if real
        else "toy job: 16 questions x 8 answers forced to N tokens"
    )
    lines = [
        f"{job}, Dr.GRPO, one update per step, fp32, "
        "OMP_NUM_THREADS=1; medians of measured steps (each process's first left out), their mean reward",
        f"{'tokens':>6}  {'side':<10} {'step s':>7} {'generate s':>11} {'rest s':>7} {'start-up s':>11} {'steps':>6} "
        f"{'reward':>7}",
    ]
    for tokens in (int(t) for t in (args.tokens or ("48" if real else "64,256")).split(",")):
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for pair in range(args.pairs):
            order = SIDES if pair % 2 == 0 else SIDES[::-1]  # alternating, so no side always goes first
            for side in order:
                runs[side].append(run_side(side, tokens, args.steps, toy_dir, args.peers_python, rows))
                print(f"  {tokens} tokens, round {pair + 1}: {side} done", flush=True)
        med = {side: summarize(r) for side, r in runs.items()}
        for side, m in med.items():
            lines.append(
                f"{tokens:>6}  {side:<10} {m['step']:>7.2f} {m['generate']:>11.2f} {m['rest']:>7.2f} "
                f"{m['startup']:>11.1f} {m['steps']:>6} {m['reward']:>7.2f}"
            )
        trl = med["trl"]
        for side in ("ours-hf", "ours-vllm"):
            m = med[side]
            lines.append(
                f"{tokens:>6}  {side} / trl: step {m['step'] / trl['step']:.2f}x, generate "
                f"{m['generate'] / trl['generate']:.2f}x, rest {m['rest'] / trl['rest']:.2f}x, "
                f"start-up {m['startup'] / trl['startup']:.2f}x"
            )
        vllm, hf = med["ours-vllm"], med["ours-hf"]
        lines.append(f"{tokens:>6}  ours-vllm / ours-hf: generate {vllm['generate'] / hf['generate']:.2f}x")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "outputs/bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / ("peers-real.txt" if real else "peers.txt")).write_text(text + "\n")
    if not args.no_docs:
        from trapo.commands import readme

        for name in ["bench-peers-real"] if real else ["bench-peers", "peers-ratios"]:
            body = readme.peers_ratios_block(out) if name == "peers-ratios" else readme.fenced_block(name, out)
            path = readme.BLOCKS[name]
            path.write_text(readme.replace_block(path.read_text(), name, body))
            print(f"bench-peers: wrote the {name} block of {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
