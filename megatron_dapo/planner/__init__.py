"""Per-GPU memory plan of a layout, from the architecture alone (no model, no GPU): `--dry-run`.

One concept per module, each importing only those before it (and distributed/, models/, ops/ below the package):
  - activations.py: what one decoder layer and one micro-batch save for backward (`ActivationSpec`, Korthikanti et
    al. 2022 generalised), the logits of the last stage and the MoE block's terms;
  - stages.py: what one GPU of each pipeline stage holds in training (weights, grads, Adam state, activations in
    flight under 1F1B, logits, buffers): `PlanInputs`, `plan_stages`;
  - colocated.py: --colocate's SGLang share of every GPU and the phases (generation, start-up, save);
  - report.py: the plan printed (`print_plan`), the single flag changes that lower a peak, the planner's own flags;
  - __main__.py: `python -m megatron_dapo.planner <train.py flags>`, the trainer's --dry-run (startup.dry_run_main).
"""
