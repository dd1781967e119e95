"""An lm-evaluation-harness backend (`model="fbt"`): a trained run scored and decoded in any of the
three modes of docs/method.md §8, on any of the harness's tasks (docs/evaluation.md).

    import lm_eval, fbt_jax.evals.harness  # importing registers the backend
    lm_eval.simple_evaluate(model="fbt", model_args="checkpoint=runs/text,mode=soft", tasks=[...])

The harness's three request types, per mode:

- `loglikelihood` (multiple choice, cloze): the continuation's log-probability after its context
  (`likelihood.py`: standard one plain pass; soft the context read plain, then the continuation
  fed with latent feedback; fused the context prefilled with the fused passes, then as soft).
- `loglikelihood_rolling` (perplexity): a document scored in windows of the model's context, each
  predicting its tokens once after as much earlier text as fits (the harness's own windows), each
  window as a loglikelihood request in the mode.
- `generate_until`: the batched generation of `generation.py`, stopped at the request's strings.

A context longer than the model's is cut from the left (as the harness expects; said once).
Results are handed to the harness's cache as each batch finishes, so an evaluation run with a cache
(`fbt-eval --harness` keeps one) continues where it was killed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from fbt_jax import decode, paths
from fbt_jax import progress as shown_progress
from fbt_jax.errors import ConfigError
from fbt_jax.evals import runner
from fbt_jax.evals.generation import Generator, Request, Sampling, cut_at_stop
from fbt_jax.evals.harness_tasks import DEFAULT_NEW_TOKENS
from fbt_jax.evals.likelihood import Scorer

DEFAULT_BATCH = 32
HARNESS_OPTIONS = ("max_batch_size", "device")  # what simple_evaluate hands every backend; JAX places the work


def _log(line: str) -> None:
    print(line, file=sys.stderr)


@dataclasses.dataclass
class Loaded:
    """A checkpoint read once, shared by the backends of every mode (and by the training hook)."""

    model: Any
    config: Any
    step: int
    tokenizer: Any
    generator: Generator  # the parameters on this host's devices: scoring and generation run there

    @classmethod
    def read(cls, checkpoint: str, log: Callable[[str], None] = _log) -> Loaded:
        from fbt_jax.trained import load_model_at

        model, config, step = load_model_at(checkpoint, log, flag="checkpoint")
        return cls.of(model, config, step)

    @classmethod
    def of(cls, model: Any, config: Any, step: int) -> Loaded:
        """A model in memory (a training run's, at `step`): refused where it cannot read text."""
        if config.data.source == "task":
            raise ConfigError(
                f"this run trained on the built-in task {config.data.task!r}, which has no text tokenizer; the harness "
                "scores text: use a run trained on text (data.source=text) or imported with fbt-import"
            )
        if jax.process_count() > 1:
            raise ConfigError("the harness backend runs in one process, on its host's devices; start it in one process")
        from fbt_jax.data.plan import plan_data

        tokenizer = plan_data(config, read_data=False).tokenizer  # the run's; its data is not read
        return cls(model, config, step, tokenizer, Generator(model))


def _batch_size(value: Any) -> int:
    """The harness's batch_size (an int, its text, None or "auto") as rows per batch."""
    if value in (None, "") or str(value).startswith("auto"):
        return DEFAULT_BATCH  # no memory probing: a fixed batch (set batch_size to change it)
    if not str(value).isdigit() or int(value) < 1:
        raise ConfigError(f"batch_size={value!r} must be a positive integer")
    return int(value)


@register_model("fbt")
class FBTLM(TemplateLM):
    """A run (`checkpoint`: its workdir or checkpoint directory) in one decoding `mode`.

    `interrupt`, where given, is called after every batch: it raises to stop the evaluation there
    (the training hook's stop on SIGTERM)."""

    def __init__(
        self,
        checkpoint: str = "",
        mode: str = "standard",
        batch_size: Any = DEFAULT_BATCH,
        prefill_passes: int = 2,
        max_length: int = 0,
        seed: int = 0,
        chat: Any = False,
        loaded: Loaded | None = None,
        progress: bool = True,
        log: Callable[[str], None] = _log,
        interrupt: Callable[[], None] | None = None,
        **harness_options: Any,
    ):
        super().__init__()
        unknown = sorted(set(harness_options) - set(HARNESS_OPTIONS))
        if unknown:  # a misspelt model_args key would otherwise be dropped, and the defaults run silently
            raise ConfigError(
                f"unknown model_args {', '.join(map(repr, unknown))} for the fbt backend; it takes checkpoint, mode, "
                "batch_size, prefill_passes, max_length, seed and chat"
            )
        if mode not in decode.MODES:
            raise ConfigError(f"mode={mode!r} is not a decoding mode; use one of {', '.join(decode.MODES)}")
        if int(prefill_passes) < 1 or int(max_length) < 0:
            raise ConfigError(f"prefill_passes={prefill_passes} must be at least 1 and max_length={max_length} >= 0")
        self.batch = _batch_size(batch_size)  # every argument checked before the checkpoint is read
        if loaded is None:
            if not checkpoint:
                raise ConfigError("the fbt backend needs model_args checkpoint=RUN (a run's workdir or checkpoints)")
            loaded = Loaded.read(paths.resolve(str(checkpoint), "checkpoint"), log)
        runner.check_modes(loaded.config, loaded.step, (mode,))
        self.loaded, self.mode, self.seed, self.show, self.log = loaded, mode, int(seed), progress, log
        self.max_length = int(max_length) or int(loaded.config.data.seq_len)
        self.tokenizer = loaded.tokenizer
        self.scorer = Scorer(loaded.generator, self.batch, int(prefill_passes))
        self.prefill_passes = int(prefill_passes)
        self.interrupt = interrupt or (lambda: None)
        self.warned: set[str] = set()
        # chat=True (a tuned run, with the harness's apply_chat_template): contexts are the run's template's
        # renders, read as written (the template writes its special tokens); a generation ends at its end-of-turn.
        self.template = runner.chat_prompts(loaded.config, self.tokenizer) if _true(chat) else None
        self.stop_ids = (int(self.tokenizer.eos_id), *(self.template.end_of_turn_ids if self.template else ()))

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name", "fbt"))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise ConfigError(
                "the fbt backend applies a chat template only with model_args chat=True (a run tuned on chat data: "
                "docs/post-training.md); run without apply_chat_template, or add chat=True"
            )
        return self.template.render(chat_history, add_generation_prompt)[0]

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template applied (the harness records it with the results), or None without chat=True."""
        return self.template.source if self.template is not None and chat_template else None

    # --- tokens ----------------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context reads: the beginning-of-document id, else the end-of-document one
        (documents are separated by it in training, so it is what precedes a document's start), as
        the harness's `hf` backend chooses."""
        bos = getattr(self.tokenizer, "bos_id", None)
        return self.eot_token_id if bos is None else int(bos)

    def encode(self, text: str) -> list[int]:
        if self.template is not None:  # a render of the template: its special tokens are in the text
            return [int(i) for i in self.tokenizer.encode_plain(text)]
        return [int(i) for i in self.tokenizer.encode_prompt(text)]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The harness's name for `encode` (a document's start reads as it did in training)."""
        return self.encode(string)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as the harness's own backends split them: its
        `_encode_pair` (the context's trailing whitespace moves to the continuation, whose ids are
        those of the whole text after the context's), and for an empty context the rule of its
        `TemplateLM.loglikelihood` (the prefix id reads first, unless the continuation starts with it)."""
        if context:
            return self._encode_pair(context, continuation)
        ids = self.tok_encode(continuation, add_special_tokens=False)
        if ids and ids[0] == self.prefix_token_id:
            return ids[:1], ids[1:]
        return [self.prefix_token_id], ids

    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        """TemplateLM's abstract scorer, for callers that split the requests themselves."""
        pairs = [self.fit(context, continuation) for _, context, continuation in requests]
        return [(s.total, s.is_greedy) for s in self._score(pairs, "loglikelihood", True, lambda *_: None)]

    def fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Cut the context from the left so that context + continuation − 1 tokens fit the model."""
        if not continuation:
            raise ConfigError("a loglikelihood request has an empty continuation; every request must score a token")
        if len(continuation) > self.max_length:
            raise ConfigError(
                f"a continuation of {len(continuation)} tokens does not fit the model's context of {self.max_length} "
                "tokens; shorten it or raise max_length"
            )
        room = self.max_length + 1 - len(continuation)
        if len(context) > room:
            self.say_once("truncated", f"some contexts exceed the model's context of {self.max_length} tokens: "
                                       "they are cut from the left, as the harness expects")  # fmt: skip
            context = context[-room:]
        return context, continuation

    def say_once(self, key: str, line: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self.log(f"fbt backend ({self.mode}): {line}")

    # --- the harness's requests -----------------------------------------------------------------------------

    def _score(self, pairs: list[tuple[list[int], list[int]]], what: str, disable: bool, finished: Callable) -> list:
        """The pairs scored; `finished(indices, scored)` after each batch (for the harness's cache)."""
        with shown_progress.shown(len(pairs), self.show and not disable, desc=f"{what} ({self.mode})") as bar:
            timing = self.loaded.generator.timing

            def done(indices: list[int], scored: list[Any]) -> None:
                finished(indices, scored)
                bar.update(len(indices))
                self.interrupt()
                bar.set_postfix(tokens_per_s=f"{timing.tokens / max(timing.decode_s, 1e-9):,.0f}")

            return self.scorer.score(pairs, self.mode, done)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.fit(*self.pair(*r.args)) for r in requests]

        def cache(indices: list[int], scored: list[Any]) -> None:  # kept as each batch finishes
            for i, one in zip(indices, scored):
                self.cache_hook.add_partial("loglikelihood", requests[i].args, (one.total, one.is_greedy))

        return [(s.total, s.is_greedy) for s in self._score(pairs, "loglikelihood", disable_tqdm, cache)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, request in enumerate(requests):
            tokens = self.encode(request.args[0])
            rolling = harness_utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
            for window in map(harness_utils.make_disjoint_window, rolling):
                windows.append(window)
                owners.append(i)
        totals, left = [0.0] * len(requests), collections.Counter(owners)

        def cache(indices: list[int], scored: list[Any]) -> None:  # a document is kept once all its windows are
            for i, one in zip(indices, scored):
                owner = owners[i]
                totals[owner] += one.total
                left[owner] -= 1
                if not left[owner]:
                    self.cache_hook.add_partial("loglikelihood_rolling", requests[owner].args, totals[owner])

        self._score(windows, "loglikelihood_rolling", disable_tqdm, cache)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):  # requests with the same settings share batches
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        with shown_progress.shown(len(requests), self.show and not disable_tqdm, desc=f"generate ({self.mode})") as bar:
            for indices in groups.values():
                settings = requests[indices[0]].args[1]
                until, new, sampling = self.generation_settings(settings)
                prompts = [self.fit_prompt(self.encode(requests[i].args[0]), new) for i in indices]
                order = sorted(range(len(indices)), key=lambda j: -len(prompts[j]))
                for start in range(0, len(order), self.batch):
                    chosen = order[start : start + self.batch]
                    rows = [Request(prompts[j], self.row_seed(requests[indices[j]])) for j in chosen]
                    ids = self.loaded.generator.generate(rows, self.mode, new, sampling, self.stop_ids, tuple(until),
                                                         self.tokenizer.decode)  # fmt: skip
                    for j, generated in zip(chosen, ids):
                        request = requests[indices[j]]
                        if generated and generated[-1] in self.stop_ids[1:]:  # an end-of-turn is not text
                            generated = generated[:-1]
                        out[indices[j]] = cut_at_stop(self.tokenizer.decode(generated), until)
                        self.cache_hook.add_partial("generate_until", request.args, out[indices[j]])
                    bar.update(len(chosen))
                    self.interrupt()
        return out

    def generation_settings(self, settings: dict[str, Any]) -> tuple[list[str], int, Sampling]:
        """(stop strings, new tokens at most, sampling) of a request's generation arguments."""
        settings = dict(settings)
        until = settings.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        new = int(settings.pop("max_gen_toks", DEFAULT_NEW_TOKENS))
        sample = bool(settings.pop("do_sample", False))
        temperature = float(settings.pop("temperature", 0.0) or 0.0)
        top_p, top_k = float(settings.pop("top_p", 1.0) or 1.0), int(settings.pop("top_k", 0) or 0)
        if settings:
            self.say_once(f"ignored {sorted(settings)}", f"generation arguments {sorted(settings)} are not used")
        if new >= self.max_length:
            raise ConfigError(
                f"max_gen_toks={new} leaves no room for a prompt in the model's context of {self.max_length} tokens; "
                "lower it (gen_kwargs) or raise max_length"
            )
        sampling = Sampling(temperature if sample else 0.0, top_p, top_k, self.prefill_passes)
        return until, new, sampling

    def fit_prompt(self, prompt: list[int], new: int) -> list[int]:
        room = self.max_length - new
        if len(prompt) > room:
            self.say_once("truncated", f"some prompts exceed the model's context of {self.max_length} tokens less "
                                       f"{new} new ones: they are cut from the left, as the harness expects")  # fmt: skip
            prompt = prompt[-room:]
        return prompt or [self.prefix_token_id]

    def row_seed(self, request: Any) -> int:
        """A generation's seed: its task, document and repeat, the same in every mode and batch."""
        return zlib.crc32(f"{self.seed}/{request.task_name}/{request.doc_id}/{request.idx}".encode())


def _true(value: Any) -> bool:
    """A model_args flag: the harness hands `chat=True` over as the string 'True'."""
    return value is True or str(value).lower() in ("true", "1", "yes")


def scored_pairs(lm: FBTLM, pairs: Sequence[tuple[str, str]]) -> list[Any]:
    """The `likelihood.Scored` tokens of (context, continuation) texts as `lm` reads them (for a
    check by hand of the harness's accuracy)."""
    return lm.scorer.score([lm.fit(*lm.pair(c, x)) for c, x in pairs], lm.mode)
