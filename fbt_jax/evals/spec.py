"""Generative tasks as local files: a JSON-lines file of problems and a small spec.

A spec (JSON) says how a problem becomes a prompt and how a generation is scored:

    {"name": "gsm8k",
     "fields": {"prompt": "question", "answer": "answer"},    # record keys → our names (default: same)
     "reference": {"kind": "after_marker", "marker": "####"}, # the gold answer inside `answer`
     "header": "", "fewshot": [{"prompt": "...", "answer": "..."}],
     "example_template": "Question: {prompt}\\nAnswer: {answer}\\n\\n",
     "prompt_template": "Question: {prompt}\\nAnswer:",
     "stop": ["\\n\\nQuestion:"], "max_new_tokens": 256,
     "extract": {"kind": "last_number"},                      # or regex / after_marker / last_boxed / text
     "compare": "numeric"}                                     # or exact / tests

For `compare: tests` a problem carries `tests` (a string, or a list of lines) and the spec's
`program_template` joins prompt, completion and tests into the program run in the sandbox, e.g.
HumanEval's "{prompt}{completion}\\n\\n{tests}\\n\\ncheck({entry_point})\\n". Templates may name any
key of the problem's record. Specs for GSM8K-, MATH-, MBPP- and HumanEval-style files ship in
`fbt_jax/evals/specs/` (named by their file stem); the problems are the user's: nothing is
downloaded. A task is given as `SPEC[@PROBLEMS]`; without `@PROBLEMS` the spec's own `problems`
(relative to the spec file) is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import string
from typing import Any

from fbt_jax.errors import ConfigError

SPECS_DIR = os.path.join(os.path.dirname(__file__), "specs")
EXTRACT_KINDS = ("text", "last_number", "regex", "after_marker", "last_boxed")
COMPARE_KINDS = ("exact", "numeric", "tests")
SPEC_KEYS = {
    "name", "description", "problems", "fields", "reference", "header", "fewshot", "example_template",
    "prompt_template", "stop", "max_new_tokens", "extract", "compare", "program_template",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # the rendered prompt: header, few-shot examples and this problem
    answer: str = ""  # the gold answer (compare exact/numeric)
    program: str = ""  # the program template with everything but {completion} filled (compare tests)
    prompt_ids: tuple[int, ...] = ()  # the prompt's tokens (filled by the tokenizer, or given)
    forced: tuple[int, ...] = ()  # tokens fed after the prompt before generating (built-in tasks)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    compare: str
    extract: dict[str, Any]
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 256
    prompt_template: str = "{prompt}"
    program_template: str = "{prompt}{completion}\n\n{tests}\n"
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    reference: dict[str, Any] = dataclasses.field(default_factory=lambda: {"kind": "text"})
    header: str = ""
    fewshot: tuple[dict[str, str], ...] = ()
    example_template: str = "{prompt}{answer}\n\n"
    problems: str = ""
    source: str = ""  # the spec file

    def check(self) -> None:
        where = f"task spec {self.source}"
        if self.compare not in COMPARE_KINDS:
            raise ConfigError(f"{where}: compare={self.compare!r} is unknown; use one of {COMPARE_KINDS}")
        for what, rule in (("extract", self.extract), ("reference", self.reference)):
            check_rule(rule, f"{where}: {what}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"{where}: max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"{where}: stop must be a list of non-empty strings")
        templates = [("prompt_template", self.prompt_template), ("example_template", self.example_template)]
        for name, template in templates + [("program_template", self.program_template)]:
            try:
                list(string.Formatter().parse(template))
            except ValueError as err:
                raise ConfigError(f"{where}: {name} is not a format string ({err})") from None
        if self.compare == "tests" and "{completion}" not in self.program_template:
            raise ConfigError(f"{where}: program_template must contain {{completion}}, where the generation goes")


def check_rule(rule: Any, where: str) -> None:
    """One-line errors for an extraction rule, including a regex that does not compile."""
    if not isinstance(rule, dict) or rule.get("kind") not in EXTRACT_KINDS:
        raise ConfigError(f"{where}: {rule!r} needs a kind, one of {EXTRACT_KINDS}")
    if rule["kind"] == "regex":
        try:
            pattern = re.compile(rule.get("pattern", ""))
        except re.error as err:
            raise ConfigError(f"{where}: the regex {rule.get('pattern')!r} does not compile ({err})") from None
        if not rule.get("pattern") or pattern.groups > 1:
            raise ConfigError(f"{where}: the regex needs a pattern with at most one group (the answer)")
    if rule["kind"] == "after_marker" and not rule.get("marker"):
        raise ConfigError(f"{where}: after_marker needs a non-empty marker")


def load_spec(name_or_path: str) -> TaskSpec:
    """The spec of a shipped name (`gsm8k`) or a spec file."""
    path = name_or_path
    shipped = os.path.join(SPECS_DIR, f"{name_or_path}.json")
    if not os.path.exists(path) and os.path.exists(shipped):
        path = shipped
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        names = sorted(p[:-5] for p in os.listdir(SPECS_DIR) if p.endswith(".json"))
        raise ConfigError(
            f"task {name_or_path!r} is neither a built-in task, a shipped spec ({', '.join(names)}) nor a spec file"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"task spec {path} is not readable JSON ({err}); fix or replace the file") from None
    if not isinstance(raw, dict) or set(raw) - SPEC_KEYS or "compare" not in raw:
        unknown = sorted(set(raw) - SPEC_KEYS) if isinstance(raw, dict) else raw
        raise ConfigError(f"task spec {path}: unknown keys {unknown} or no 'compare'; its keys are {sorted(SPEC_KEYS)}")
    raw = {k: v for k, v in raw.items() if k != "description"}
    raw.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    raw.setdefault("extract", {"kind": "text"})
    for key in ("stop", "fewshot"):
        raw[key] = tuple(raw.get(key, ()))
    if raw.get("problems"):
        raw["problems"] = os.path.join(os.path.dirname(os.path.abspath(path)), raw["problems"])
    spec = TaskSpec(**raw, source=path)
    spec.check()
    return spec


def _field(record: dict[str, Any], spec: TaskSpec, name: str, where: str, required: bool = True) -> Any:
    key = spec.fields.get(name, name)
    if key not in record:
        if required:
            raise ConfigError(f"{where} has no {key!r} field (the problem's {name}); fix the file or the spec's fields")
        return None
    return record[key]


def render(template: str, values: dict[str, Any], where: str) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError) as err:
        raise ConfigError(f"{where}: the template names {err}, which the problem does not have") from None


def read_problems(spec: TaskSpec, path: str, limit: int = 0) -> list[Problem]:
    """The problems of a JSON-lines file, rendered for `spec` (one-line errors for bad lines)."""
    from fbt_jax.evals.scoring import extract

    if not path:
        raise ConfigError(
            f"task {spec.name} needs its problems: --tasks={spec.name}@PATH.jsonl (a JSON-lines file; "
            "nothing is downloaded)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"the problems of task {spec.name}, {path}, cannot be read ({err})") from None
    fewshot = "".join(
        render(spec.example_template, example, f"task spec {spec.source}, fewshot") for example in spec.fewshot
    )
    problems, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where} is not JSON ({err.msg}); the problems must be JSON lines") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where} is not a JSON object; each line must be one problem")
        values = {str(k): v for k, v in record.items()}
        prompt = _field(record, spec, "prompt", where)
        values["prompt"] = prompt
        tests = _field(record, spec, "tests", where, required=spec.compare == "tests")
        values["tests"] = "\n".join(tests) if isinstance(tests, list) else tests
        problem_id = str(_field(record, spec, "id", where, required=False) or f"line{number}")
        if problem_id in seen:
            raise ConfigError(f"{where}: id {problem_id!r} is used twice; ids must be unique")
        seen.add(problem_id)
        text = spec.header + fewshot + render(spec.prompt_template, values, where)
        if spec.compare == "tests":
            program = render(spec.program_template.replace("{completion}", "\0"), values, where)
            problems.append(Problem(problem_id, text, program=program))
        else:
            gold = extract(str(_field(record, spec, "answer", where)), spec.reference)
            if gold is None:
                raise ConfigError(f"{where}: its answer does not match the spec's reference rule {spec.reference}")
            problems.append(Problem(problem_id, text, answer=gold))
        if limit and len(problems) == limit:
            break
    if not problems:
        raise ConfigError(f"{path} holds no problems; give a JSON-lines file with one problem per line")
    return problems
