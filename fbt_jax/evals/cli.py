"""`fbt-eval`: evaluate a trained run.

    fbt-eval --checkpoint=runs/tiny --output=runs/tiny/eval                     # depth, modes, probes
    fbt-eval --checkpoint=runs/tiny --tasks=word_problem --output=runs/tiny/gen # generative, 3 modes
    fbt-eval --checkpoint=runs/text --tasks=gsm8k@gsm8k_test.jsonl,mbpp@mbpp.jsonl --output=gen \\
        --samples=10 --temperature=0.8 --pass-at=1,10
    fbt-eval --checkpoint=runs/text --harness=hellaswag,lambada_openai --output=runs/text/harness

Without --tasks it measures depth stability, sequential feedback, per-position accuracy per mode and
probes (`evaluate.py`); with --tasks it decodes every problem of each task in each mode and scores
the generations (`evals/`); with --harness it runs lm-evaluation-harness tasks in each mode
(`evals/harness_run.py`).
"""

from __future__ import annotations

import argparse
import os

from fbt_jax import contraction, paths
from fbt_jax.errors import ArgumentParser, ConfigError, divert_library_noise, reported

DEPTH_FLAGS = ("max_depth", "seq_len", "probe_examples", "data_path")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="fbt-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a run's workdir or checkpoint directory")
    p.add_argument("--output", required=True, help="directory for the report, generations, tables and plots")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per batch (depth sweep, or generations)")
    depth = p.add_argument_group("depth evaluation (without --tasks)")
    depth.add_argument("--max-depth", type=int, default=None, help="largest number of passes k (default: length + 1)")
    depth.add_argument("--seq-len", type=int, default=0, help="evaluation length for built-in tasks (default: trained)")
    depth.add_argument("--probe-examples", type=int, default=512, help="sequences per split for the probes")
    depth.add_argument("--data-path", default="", help="text to evaluate on instead of the run's own")
    gen = p.add_argument_group("generative evaluation")
    gen.add_argument(
        "--tasks", default="", help="built-in task names or spec files (SPEC[@PROBLEMS.jsonl]), comma-separated"
    )
    gen.add_argument("--modes", default="standard,soft,fused", help="decoding modes, comma-separated")
    gen.add_argument(
        "--chat", action="store_true", help="prompt as a user turn of the run's chat template (tuned runs)"
    )
    gen.add_argument("--samples", type=int, default=1, help="generations per problem and mode (n of pass@k)")
    gen.add_argument("--pass-at", type=_ints, default=(1,), help="the k of pass@k, comma-separated (each <= --samples)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (each generation's key derives from it)")
    gen.add_argument("--max-new-tokens", type=int, default=0, help="override each task's own limit")
    gen.add_argument("--num-problems", type=int, default=0, help="first N problems per task (0: all; built-in 256)")
    gen.add_argument("--prefill-passes", type=int, default=2, help="passes of the fused prefill")
    gen.add_argument("--context-len", type=int, default=0, help="prompt + new tokens at most (default: data.seq_len)")
    gen.add_argument("--sandbox-timeout", type=float, default=10.0, help="seconds per program of a test-scored task")
    gen.add_argument(
        "--no-sandbox", action="store_true", help="run generated programs without containment (trusted code only)"
    )
    harness = p.add_argument_group("lm-evaluation-harness (also --modes, --batch-size, --prefill-passes, --seed)")
    harness.add_argument("--harness", default=None, help="the harness's task names, comma-separated")
    harness.add_argument("--harness-include", default="", help="a directory of task YAMLs (the harness's include path)")
    harness.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    harness.add_argument("--limit", type=int, default=0, help="first N documents per task (0: all)")
    return p


def main(argv: list[str] | None = None) -> None:
    """`fbt-eval`: see the module docstring."""
    with reported("fbt-eval"):
        cli = parser()
        args = cli.parse_args(argv)
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size={args.batch_size} must be at least 1")
        output = paths.resolve(args.output, "--output")
        if paths.is_url(output) and args.tasks:
            raise ConfigError("--output for --tasks must be a local directory (generations are appended as they come)")
        paths.check_output_dir(output, "--output")
        checkpoint_path = paths.resolve(args.checkpoint, "--checkpoint")
        if args.harness is not None:  # also when empty: refused there, never the depth evaluation instead
            harness_evaluation(cli, args, checkpoint_path, output)
            return
        if args.tasks:
            given = [f"--{k.replace('_', '-')}" for k in DEPTH_FLAGS if getattr(args, k) != cli.get_default(k)]
            if given:
                raise ConfigError(f"{', '.join(given)} belong(s) to the depth evaluation; drop them with --tasks")
            settings = generative_settings(args)
            from fbt_jax.evals.runner import check_task_files

            check_task_files(settings)  # before the output is made or the checkpoint read
            if not paths.is_url(output):
                os.makedirs(output, exist_ok=True)
                divert_library_noise(os.path.join(output, "fbt-eval.log"))
            from fbt_jax.evals.evaluation import evaluate_tasks

            evaluate_tasks(checkpoint_path, output, settings, args.batch_size)
            return
        check_depth_args(args)
        if not paths.is_url(output):
            # The storage libraries' tracebacks from their threads when a checkpoint does not
            # restore go to this log; the failure itself is reported as one line.
            divert_library_noise(os.path.join(output, "fbt-eval.log"))
        from fbt_jax.evaluate import evaluate

        report = evaluate(
            checkpoint_path,
            output,
            args.max_depth or 0,
            args.seq_len,
            args.batch_size,
            args.probe_examples,
            data_path=paths.resolve(args.data_path, "--data-path"),
        )
    print_report(report, output)


EVAL_FLAGS = {"tasks": "--harness", "modes": "--modes", "batch_size": "--batch-size", "limit": "--limit",
              "num_fewshot": "--num-fewshot", "prefill_passes": "--prefill-passes", "include": "--harness-include"}  # fmt: skip


def harness_evaluation(cli: ArgumentParser, args: argparse.Namespace, checkpoint: str, output: str) -> None:
    """`--harness`: its flags checked (one line each) before anything loads, then every task in every mode."""
    own = ("harness", "harness_include", "num_fewshot", "limit", "modes", "batch_size", "prefill_passes", "seed",
           "checkpoint", "output", "chat")  # fmt: skip
    given = [f"--{k.replace('_', '-')}" for k in vars(args) if k not in own and getattr(args, k) != cli.get_default(k)]
    if given:
        raise ConfigError(f"{', '.join(given)} do(es) not apply to --harness; drop them")
    if paths.is_url(output):
        raise ConfigError("--output for --harness must be a local directory (its cache is written as it goes)")
    from fbt_jax.evals.harness_tasks import HarnessSettings, names, require_harness

    include = paths.resolve(args.harness_include, "--harness-include") if args.harness_include else ""
    settings = HarnessSettings(names(args.harness), names(args.modes), include, args.num_fewshot, args.limit,
                               args.batch_size, args.prefill_passes, args.seed, args.chat)  # fmt: skip
    settings.check(EVAL_FLAGS)
    require_harness("fbt-eval --harness")
    from fbt_jax.evals.harness_run import TABLE, evaluate_harness

    evaluate_harness(checkpoint, output, settings)
    with open(os.path.join(output, TABLE), encoding="utf-8") as f:
        print(f.read(), end="")
    print(f"wrote {os.path.join(output, TABLE)} and harness.json")


def generative_settings(args: argparse.Namespace):
    """The evaluation's settings from the flags, checked (one line each, before anything loads)."""
    from fbt_jax.evals.builtin import is_builtin
    from fbt_jax.evals.runner import EvalSettings

    tasks = []
    for task in (t.strip() for t in args.tasks.split(",") if t.strip()):
        name, at, problems = task.partition("@")
        if not is_builtin(name) and os.path.exists(name):  # a spec file, not a shipped spec's name
            name = paths.resolve(name, "--tasks")
        tasks.append(name + (at + paths.resolve(problems, "--tasks") if problems else ""))
    settings = EvalSettings(
        tasks=tuple(tasks),
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        samples=args.samples,
        pass_at=tuple(args.pass_at) or (1,),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        num_problems=args.num_problems,
        prefill_passes=args.prefill_passes,
        context_len=args.context_len,
        sandbox=not args.no_sandbox,
        sandbox_timeout_s=args.sandbox_timeout,
        chat=args.chat,
    )
    settings.check()
    return settings


def check_depth_args(args: argparse.Namespace) -> None:
    if args.probe_examples < 16:
        raise ConfigError(f"--probe-examples={args.probe_examples} is too few to fit a probe; use at least 16")
    if args.max_depth is not None and args.max_depth < 1:
        raise ConfigError(
            f"--max-depth={args.max_depth} must be at least 1 (leave it out for the evaluation length + 1)"
        )
    if args.seq_len < 0 or 0 < args.seq_len < 4:
        raise ConfigError(f"--seq-len={args.seq_len} is too short; use at least 4, or 0 for the trained length")


def print_report(report: dict, output: str) -> None:
    depth = report["depth"]
    print(f"loss at depth 1 / {len(depth['loss'])}: {depth['loss'][0]:.4f} / {depth['loss'][-1]:.4f}")
    if "contraction" in report:
        print(f"contraction monitor, {contraction.describe(report['contraction'])}")
    if "modes" in report:
        print(
            "per decoding mode: "
            + ", ".join(f"{m} accuracy {r['accuracy']:.3f} loss {r['loss']:.3f}" for m, r in report["modes"].items())
        )
    if "probes" in report:
        p, by_position = report["probes"], report["probes_by_position"]
        print(f"layer-0 probe, all positions: K=1 {p['K1'][0]:.3f}, K=2 {p['K2'][0]:.3f} (chance {p['chance']:.3f})")
        last = by_position["positions"][-1]
        print(
            f"layer-0 probe at the last position t={last}: K=1 {by_position['K1'][-1]:.3f}, "
            f"K=2 {by_position['K2'][-1]:.3f}, exact recurrence {by_position['exact'][-1]:.3f} "
            f"(chance {by_position['chance'][-1]:.3f})"
        )
    for sample in report.get("samples", []):
        print(f"{sample['mode']:>8} | …{sample['prompt'][-40:]!r} → {sample['text'][:60]!r}")
    print(f"wrote {os.path.join(output, 'report.json')} and {len(report['plots'])} plots")


if __name__ == "__main__":
    main()
