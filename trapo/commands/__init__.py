"""What a user runs: `python -m trapo <command>` (trapo/__main__.py), each command's `main(argv)` here.

- train.py       one training run (also `deepspeed trapo_train.py --config ...`)
- eval.py        benchmarks -> the paper's Table 1 (avg@k, pass@k), resumable
- prepare/       training files from the public datasets (local copies or hub ids), decontaminated
- doctor.py      preflight: versions, devices, collectives, a two-step trial run, the memory plan
- report/        plots and report.md of a run directory
- reproduce/     the paper's claims on the toy task (`make reproduce-toy`)
- toy.py         the embedded default task: a tiny Qwen2 and synthetic arithmetic, built here
- readme.py      the generated blocks of README.md and docs/, rewritten from the outputs
- gpu_kit.py     an offline wheel kit for a new GPU node with no package index (`make gpu-kit`)
- gpu_check/     a new GPU node's acceptance check in a time box, with a report (`make gpu-check`; a dry run on CPU)

The top layer: may import every other one (trapo.training, trapo.engine, trapo.algorithm, the shared
vocabulary); nothing below imports a command.
"""
