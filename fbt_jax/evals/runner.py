"""A generative evaluation: every problem of every task decoded in every mode, scored, written as it
goes (`generations.jsonl`, one line per generation), and continued where it stopped when started
again with the same flags (the settings are kept in `eval.json`; a directory holding another
evaluation is refused)."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Any

from fbt_jax import decode
from fbt_jax import progress as shown_progress
from fbt_jax.data import store
from fbt_jax.errors import ConfigError
from fbt_jax.evals import builtin, scoring
from fbt_jax.evals.generation import Generator, Request, Sampling, cut_at_stop
from fbt_jax.evals.spec import Problem, TaskSpec, load_spec, read_problems
from fbt_jax.schedule import PassSchedule

SETTINGS_FILE, GENERATIONS, TIMING = "eval.json", "generations.jsonl", "timing.json"


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...]
    modes: tuple[str, ...] = decode.MODES
    samples: int = 1  # generations per problem and mode
    pass_at: tuple[int, ...] = (1,)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 0  # 0: each task's own
    num_problems: int = 0  # 0: all of a file's, 256 of a built-in task
    prefill_passes: int = 2
    context_len: int = 0  # 0: the run's data.seq_len
    sandbox: bool = True  # contain the programs of test-scored tasks (sandbox.py)
    sandbox_timeout_s: float = 10.0
    chat: bool = False  # prompts as a user turn rendered by the run's chat template (a tuned model's)

    def check(self) -> None:
        """One-line errors for settings that cannot work, before anything is read."""
        unknown = [m for m in self.modes if m not in decode.MODES]
        if unknown or not self.modes:
            raise ConfigError(f"--modes={','.join(self.modes)!r}: use some of {','.join(decode.MODES)}")
        if not self.tasks:
            raise ConfigError("--tasks is empty; name a built-in task or a spec file")
        if self.samples < 1 or min(self.pass_at) < 1:
            raise ConfigError("--samples and every --pass-at k must be at least 1")
        if max(self.pass_at) > self.samples:
            raise ConfigError(
                f"pass@{max(self.pass_at)} needs at least {max(self.pass_at)} samples per problem; "
                f"raise --samples (now {self.samples}) or lower --pass-at"
            )
        if self.samples > 1 and self.temperature == 0:
            raise ConfigError(
                f"--samples={self.samples} with greedy decoding repeats one generation; set --temperature > 0"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
        for name in ("max_new_tokens", "num_problems", "context_len"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} is negative; use 0 for the default")
        if self.prefill_passes < 1 or self.sandbox_timeout_s <= 0:
            raise ConfigError("--prefill-passes must be at least 1 and --sandbox-timeout positive")


@dataclasses.dataclass
class Task:
    name: str
    spec: TaskSpec
    problems: list[Problem]
    stop_ids: tuple[int, ...] = ()  # besides the end of document: the chat template's end-of-turn


def row_seed(seed: int, task: str, problem: str, sample: int) -> int:
    """A row's sampling seed: its problem and sample number, the same in every mode and batch."""
    return zlib.crc32(f"{seed}/{task}/{problem}/{sample}".encode())


def check_modes(config: Any, step: int, modes: tuple[str, ...]) -> None:
    """A run that never trained a feedback pass has an untrained fusion: refuse soft and fused."""
    if config.get("hf_config") or config.get("init_from") or set(modes) <= {"standard"}:
        return  # imported or initialised elsewhere: the fusion came with the weights
    schedule = PassSchedule.parse(config.passes.schedule, config.train.steps, config.seed)
    # Only steps of phases that can draw K >= 2 are looked at, and the first such draw settles it.
    first = min((ph.start_step for ph in schedule.phases if any(k >= 2 for k, _ in ph.mixture)), default=step)
    if not any(schedule.num_passes(s) >= 2 for s in range(first, step)):
        raise ConfigError(
            f"this checkpoint (step {step}) never trained a feedback pass (passes.schedule drew K=1 only), so its "
            "fusion is untrained and cannot decode in soft or fused mode; use --modes=standard"
        )


def check_task_files(settings: EvalSettings) -> None:
    """Each task's spec and problems read once, for their one-line errors before anything is loaded."""
    for arg in settings.tasks:
        name_or_spec, _, problems_path = arg.partition("@")
        if not builtin.is_builtin(name_or_spec):
            spec = load_spec(name_or_spec)
            read_problems(spec, problems_path or spec.problems, settings.num_problems)


def load_tasks(settings: EvalSettings, config: Any, tokenizer: Any) -> list[Task]:
    """Each task's problems, tokenised and checked against the context, before any decoding."""
    context = settings.context_len or config.data.seq_len
    template = chat_prompts(config, tokenizer) if settings.chat else None
    tasks = []
    for arg in settings.tasks:
        name_or_spec, _, problems_path = arg.partition("@")
        if builtin.is_builtin(name_or_spec):
            spec = builtin.builtin_spec(name_or_spec)
            problems = builtin.builtin_problems(name_or_spec, config, settings.num_problems)
        else:
            spec = load_spec(name_or_spec)
            if config.data.source == "task":
                raise ConfigError(
                    f"task {arg} is text, and this run trained on the built-in task {config.data.task}; "
                    f"use --tasks={config.data.task}, or a checkpoint trained on text"
                )
            problems = read_problems(spec, problems_path or spec.problems, settings.num_problems)
            encode = tokenizer.encode_prompt if template is None else lambda text: template.encode([user(text)])
            problems = [dataclasses.replace(p, prompt_ids=tuple(encode(p.prompt))) for p in problems]
        # A built-in task's answer labels its last input: only its inputs take context.
        new = 0 if builtin.is_builtin(name_or_spec) else settings.max_new_tokens or spec.max_new_tokens
        for p in problems:
            if len(p.prompt_ids) + len(p.forced) + new > context:
                raise ConfigError(
                    f"task {spec.name}, problem {p.id}: its prompt of {len(p.prompt_ids) + len(p.forced)} tokens + "
                    f"{new} new tokens exceeds the context of {context}; shorten the prompt (fewer few-shot examples), "
                    "lower --max-new-tokens or raise --context-len"
                )
        if any(t.name == spec.name for t in tasks):
            raise ConfigError(f"task {spec.name} is named twice in --tasks")
        tasks.append(Task(spec.name, spec, problems, template.end_of_turn_ids if template else ()))
    return tasks


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def chat_prompts(config: Any, tokenizer: Any) -> Any:
    """`--chat`: the template the run was tuned with (`plan.run_chat_template`), or one line saying there is none."""
    from fbt_jax.data.chat import ChatTemplate
    from fbt_jax.data.plan import run_chat_template

    source = run_chat_template(config, tokenizer) if tokenizer is not None else None
    if source is None:
        raise ConfigError(
            "--chat: this run has no chat template (its data was not chat data, its tokenizer carries none); "
            "evaluate without --chat"
        )
    return ChatTemplate(source, tokenizer)


def claim_output(output: str, identity: dict[str, Any]) -> None:
    """`output` for the evaluation `identity` (its settings): a new or empty directory is claimed
    (the settings written), one holding the same evaluation is continued, another is refused."""
    settings_path = os.path.join(output, SETTINGS_FILE)
    recorded = store.read_json(settings_path)
    if recorded is not None:
        changed = sorted(k for k in set(recorded) | set(identity) if recorded.get(k) != identity.get(k))
        if changed:
            raise ConfigError(
                f"--output={output} holds another evaluation (it differs in {', '.join(changed)}); give a new "
                "directory, or the same flags to continue that one"
            )
    elif os.path.isdir(output) and os.listdir(output):
        raise ConfigError(
            f"--output={output} is not empty and holds no evaluation ({SETTINGS_FILE}); give a new directory"
        )
    else:
        store.write_json(settings_path, identity, staging=output)


def open_output(output: str, identity: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """The generations already written by this same evaluation (a torn last line is dropped)."""
    claim_output(output, identity)
    generations_path = os.path.join(output, GENERATIONS)
    done: dict[tuple, dict[str, Any]] = {}
    if os.path.exists(generations_path):
        with open(generations_path, "rb") as f:
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a kill in the middle of a write leaves a partial line
        if len(whole) < len(data):
            with open(generations_path, "r+b") as f:
                f.truncate(len(whole))
        for line in whole.decode("utf-8").splitlines():
            record = json.loads(line)
            done[(record["task"], record["id"], record["mode"], record["sample"])] = record
    return done


def score(task: Task, problems: list[Problem], texts: list[str], limits: Any) -> list[dict[str, Any]]:
    """The verdict of each generation's text (test-scored tasks run their programs in the sandbox,
    with `sandbox.Limits`)."""
    if task.spec.compare == "tests":
        from fbt_jax.evals import sandbox

        outcomes = sandbox.run_programs([p.program.replace("\0", t) for p, t in zip(problems, texts)], limits)
        return [{"answer": None, "verdict": o.verdict, "correct": o.verdict == "passed", "detail": o.detail}
                for o in outcomes]  # fmt: skip
    verdicts = []
    for problem, text in zip(problems, texts):
        answer = scoring.extract(text, task.spec.extract)
        correct = scoring.same_answer(answer, problem.answer, task.spec.compare)
        verdicts.append({"answer": answer, "verdict": "correct" if correct else "wrong", "correct": correct})
    return verdicts


def generate_all(
    generator: Generator,
    tasks: list[Task],
    settings: EvalSettings,
    tokenizer: Any,
    output: str,
    batch_size: int,
    done: dict[tuple, dict[str, Any]],
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Decode and score every (task, problem, mode, sample) not yet in `done`, appending each batch;
    returns the generated tokens and run seconds per task/mode over every attempt (`timing.json`)."""
    timing_path = os.path.join(output, TIMING)
    timing = store.read_json(timing_path) or {}
    sampling = Sampling(settings.temperature, settings.top_p, settings.top_k, settings.prefill_passes)
    limits = None
    if any(task.spec.compare == "tests" for task in tasks):
        from fbt_jax.evals import sandbox

        limits = sandbox.Limits(timeout_s=settings.sandbox_timeout_s, isolate=settings.sandbox)
    todo = [
        (task, mode, problem, sample)
        for task in tasks
        for mode in settings.modes
        for problem in task.problems
        for sample in range(settings.samples)
        if (task.name, problem.id, mode, sample) not in done
    ]
    with (
        shown_progress.shown(len(todo), progress and bool(todo), unit="gen") as bar,
        open(os.path.join(output, GENERATIONS), "a", encoding="utf-8") as out,
    ):
        for start in range(0, len(todo), batch_size):
            rows = todo[start : start + batch_size]
            groups: dict[tuple, list] = {}
            for row in rows:  # a batch shares the task and mode (and the forced length)
                groups.setdefault((row[0].name, row[1], len(row[2].forced)), []).append(row)
            lines = []
            for group in groups.values():
                task, mode = group[0][0], group[0][1]
                before = dataclasses.replace(generator.timing)
                requests = [Request(p.prompt_ids, row_seed(settings.seed, task.name, p.id, s), p.forced)
                            for _, _, p, s in group]  # fmt: skip
                new = settings.max_new_tokens or task.spec.max_new_tokens
                stop_ids = () if builtin.is_builtin(task.name) else (tokenizer.eos_id, *task.stop_ids)
                detokenize = tokenizer.decode if tokenizer is not None else None
                ids = generator.generate(requests, mode, new, sampling, stop_ids, task.spec.stop, detokenize)
                texts = [render(task, tokenizer, i) for i in ids]
                verdicts = score(task, [p for _, _, p, _ in group], texts, limits)
                for (_, _, p, s), i, text, verdict in zip(group, ids, texts, verdicts):
                    lines.append({"task": task.name, "id": p.id, "mode": mode, "sample": s, "text": text,
                                  "tokens": len(i), **verdict})  # fmt: skip
                entry = timing.setdefault(f"{task.name}/{mode}", {"tokens": 0, "seconds": 0.0})
                entry["tokens"] += generator.timing.tokens - before.tokens
                entry["seconds"] += generator.timing.decode_s - before.decode_s
            out.write("".join(json.dumps(line) + "\n" for line in lines))
            out.flush()
            os.fsync(out.fileno())
            store.write_json(timing_path, timing, staging=output)
            for line in lines:
                done[(line["task"], line["id"], line["mode"], line["sample"])] = line
            bar.update(len(rows))
            seconds = sum(e["seconds"] for e in timing.values())
            bar.set_postfix(tokens_per_s=f"{sum(e['tokens'] for e in timing.values()) / max(seconds, 1e-9):,.0f}")
    return timing


def render(task: Task, tokenizer: Any, ids: list[int]) -> str:
    """A generation's text: the token id for a built-in task, else the text before a stop sequence."""
    if builtin.is_builtin(task.name):
        return " ".join(map(str, ids))
    if ids and ids[-1] in task.stop_ids:  # the end-of-turn a tuned model ends its reply with is not text
        ids = ids[:-1]
    return cut_at_stop(tokenizer.decode(ids), task.spec.stop)
