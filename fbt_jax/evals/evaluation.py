"""`fbt-eval --tasks`: one checkpoint, its tasks decoded in each mode, scored and tabulated."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from fbt_jax.evals import report, runner


def evaluate_tasks(
    checkpoint: str,
    output: str,
    settings: runner.EvalSettings,
    batch_size: int,
    progress: bool = True,
    shard: tuple[int, int] = (0, 1),
) -> dict[str, Any]:
    """Generate, score and tabulate (continuing the generations already in `output`). `shard`
    (index, count): only every count-th problem of each task, from the index-th (one process's
    share; a problem's generations do not depend on which problems share its batches)."""
    from fbt_jax.data.plan import plan_data
    from fbt_jax.run_services import use_run_cache
    from fbt_jax.trained import load_model_at

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    model, config, step = load_model_at(checkpoint, log)
    runner.check_modes(config, step, settings.modes)
    data = plan_data(config, read_data=False)  # the run's tokenizer; its data is not read
    tokenizer = data.tokenizer if data.source != "task" else None
    tasks = runner.load_tasks(settings, config, tokenizer)
    if shard != (0, 1):
        tasks = [dataclasses.replace(t, problems=t.problems[shard[0] :: shard[1]]) for t in tasks]
    identity = {"checkpoint": checkpoint, "step": step, **dataclasses.asdict(settings)}
    identity = json.loads(json.dumps(identity))  # tuples as lists, as read back
    done = runner.open_output(output, identity)
    total = sum(len(t.problems) for t in tasks) * len(settings.modes) * settings.samples
    if done:
        log(f"continuing {output}: {len(done)} of {total} generations already written")
    use_run_cache(config, checkpoint, log)
    from fbt_jax.evals.generation import Generator

    generator = Generator(model)
    timing = runner.generate_all(generator, tasks, settings, tokenizer, output, batch_size, done, progress)
    if generator.timing.tokens:
        log(f"compiled in {generator.timing.compile_s:.1f}s; generated {generator.timing.tokens:,} tokens in "
            f"{generator.timing.decode_s:.1f}s")  # fmt: skip
    order = {(t.name, p.id): i for i, t in enumerate(tasks) for p in t.problems}
    records = sorted(
        (r for r in done.values() if (r["task"], r["id"]) in order),
        key=lambda r: (order[(r["task"], r["id"])], settings.modes.index(r["mode"]), r["sample"]),
    )
    scores = report.write(output, records, settings, timing)
    print(report.markdown(scores, settings.pass_at, settings.samples), end="")
    print(f"wrote {os.path.join(output, runner.GENERATIONS)}, scores.json, scores.md and scores.png")
    return scores
