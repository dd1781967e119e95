"""Training, one concern per module:

- `step.py`: the pure, jitted step functions (`train_step`, `eval_step` per pass count K) and the optimizer;
- `programs.py`: the run's static layout (mesh, shardings, abstract state) and the programs compiled
  ahead of time for every K, with their memory report (shared with the dry run);
- `loop.py`: the loop, which orders steps and calls hooks;
- `hooks.py`: logging and progress, checkpoints and preemption, evaluation, the profiler window;
- `goodput.py`: where each attempt's wall time went, and the run's goodput;
- `trainer.py`: `Trainer`, which puts a run together (data, programs, state, loop);
- `dry_run.py` and `cli.py`: the `fbt-train` command.
"""
