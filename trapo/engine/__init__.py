"""What runs models on devices: the policy under DeepSpeed ZeRO-3, the rollout engines, and the state
they share with disk and with other ranks; and the processes that grade answers.

- policy.py        the policy: built from a Hugging Face directory, forwarded in token-budget micro-batches,
                   updated, its full weights gathered block by block
- lora.py          LoRA adapters on a frozen base (model.lora): attached, merged per layer for the push and
                   hf/, and the base's identity a checkpoint keeps
- rollout.py       what both rollout backends share: the Rollout record, per-request seeds, one decode per call
- vllm_rollout.py  rollout.backend vllm: one vLLM engine per rank (or tensor-parallel group): generate, push, sleep
- hf_rollout.py    rollout.backend hf: the policy's own model generates (ZeRO-3 gathered once per turn)
- rollout_engine.py  the RolloutEngine interface both backends implement, and the factory that opens either
- remote_engine.py  rollout.placement separate: the training ranks' RolloutEngine, answered by the rollout ranks
- rollout_link.py  the link to the rollout ranks: its own gloo group, versioned weights, timeouts, one-line errors
- batch.py         graded rollouts -> training sequences, micro-batches, collation
- packing.py       padding-free packing, token-balanced ranks, the update's efficiency
- attention.py     the packed rows' attention: the kernel chosen once (checked), the registered implementation
- dist.py          the process group, small collectives, ZeRO-3 parameter gathering
- checkpoint.py    atomic checkpoint directories (with checksums.py: verified before loading)
- reshard.py       a checkpoint saved on N ranks loaded on M (DeepSpeed's universal form)
- memory_plan.py   per-GPU bytes of a run from its config alone (memory_plan_separate.py: separate rollout GPUs),
                   and whether its update needs gradient checkpointing
- model_shapes.py  a model's shapes for the plan: its config.json, or the built-in table of the paper's models
- grading/         Math-Verify (or a task verifier) in supervised worker processes with hard deadlines: the
                   judge the reward functions are given

May import: trapo.algorithm and the shared vocabulary (trapo.config, trapo.data, trapo.console,
trapo.runtime, trapo.hub, trapo.faults); never trapo.training or trapo.commands.
"""
