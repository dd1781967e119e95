"""fbt-serve (`fbt_jax/serve`): the decode pool's answers equal `decode.generate`'s (fbt-decode's
path) whatever else shares the batch, the official openai client gets them in the three modes
(streamed or not, a stream's chunks adding up to the answer), logprobs with echo equal a plain
forward, chat follows the tokenizer's template, bad requests get one-line errors in OpenAI's shape
and the server stays up, a full queue answers 429 and a request that can never fit 400, a failing
request fails alone, a client that goes away frees its slots, /metrics counts all of it, and the
command serves a trained run, drains on SIGTERM and exits 0.

Most tests share one in-process server on a small random model (its programs compiled once)."""

import json
import logging
import os
import signal
import subprocess
import threading
import time
import types

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_env, running, start_command, wait_for

from fbt_jax import decode
from fbt_jax.feedback import kpass_forward
from fbt_jax.serve import engine
from fbt_jax.serve.api import Served, create_app
from fbt_jax.serve.metrics import Metrics
from fbt_jax.serve.pool import Pool, Request
from fbt_jax.serve.text import ChatTemplate, Codec, chat_template

CONTEXT, SLOTS = 24, 3
TASK_DATA = types.SimpleNamespace(source="task")  # prompts and outputs are token ids


@pytest.fixture(scope="module")
def pool(small_model):
    pool = Pool(small_model, SLOTS, CONTEXT, buckets=(12,), max_waiting=40, metrics=Metrics(SLOTS))
    pool.compile()
    return pool


@pytest.fixture(scope="module")
def served(pool):
    return Served("tiny", pool, Codec(TASK_DATA), pool.model.cfg.vocab_size)


@pytest.fixture(scope="module")
def base_url(served):
    with running(create_app(served)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)


def reference(model, prompt, mode, max_tokens, width=16, generated=12):
    """fbt-decode's greedy tokens for the prompt alone (`decode.generate`, the prompt right-padded to
    `width` as in a batch of longer ones): its first `max_tokens` of `generated` (greedy tokens do not
    depend on how many follow), so that one program per mode serves every case."""
    if len(prompt) > width or max_tokens > generated:
        width, generated = len(prompt), max_tokens
    padded = jnp.asarray([prompt + [0] * (width - len(prompt))])
    tokens, count = decode.generate(model, padded, jnp.asarray([len(prompt)]), generated, mode)
    return np.asarray(tokens)[0, : min(int(count[0]), max_tokens)].tolist()


def prompt_of(length, salt=0):
    return [int(x) for x in np.random.default_rng(length * 7 + salt).integers(0, 16, length)]


CASES = [(3, "soft", 9), (7, "standard", 5), (12, "fused", 8), (5, "fused", 12), (16, "soft", 4), (1, "standard", 11),
         (9, "soft", 7)]  # fmt: skip


def submit_all(pool, cases, **settings):
    """Queue every case at once; returns each case's tokens when all have ended."""
    done, tokens = threading.Event(), {}

    def emit(i, event):
        if event.kind == "done":
            tokens[i] = list(requests[i].tokens)
            if len(tokens) == len(requests):
                done.set()

    requests = [
        Request(prompt_of(n), mode, m, lambda e, i=i: emit(i, e), **settings) for i, (n, mode, m) in enumerate(cases)
    ]
    pool.submit(requests)
    assert done.wait(120)
    return [tokens[i] for i in range(len(requests))]


@pytest.fixture(scope="module")
def device_thread(base_url):
    """The pool's device thread: the served app's (one per pool)."""


def test_batched_requests_equal_each_request_decoded_alone(pool, device_thread):
    """Seven requests of other lengths and modes through three slots (so they enter as others leave):
    each one's greedy tokens are decode.generate's for it alone; nothing compiles while serving."""
    programs = (engine.insert._cache_size(), engine.steps._cache_size())
    got = submit_all(pool, CASES, temperature=0.0)
    for (n, mode, m), tokens in zip(CASES, got):
        assert tokens == reference(pool.model, prompt_of(n), mode, m), (n, mode, m)
    assert (engine.insert._cache_size(), engine.steps._cache_size()) == programs


def test_a_seeded_sample_does_not_depend_on_its_companions(pool, device_thread):
    """Sampled at temperature 1 with a seed, a request draws the same tokens alone and among others,
    and whether the pool runs one decode step per trip from the host or eight."""
    alone = submit_all(pool, CASES[:1], temperature=1.0, seed=7)[0]
    together = submit_all(pool, CASES, temperature=1.0, seed=7)[0]
    assert alone == together and len(alone) == CASES[0][2]
    assert submit_all(pool, CASES[:1], temperature=1.0, seed=8)[0] != alone  # the seed matters
    pool.decode_steps = 1  # one step per trip from the host draws the same tokens as eight
    try:
        assert submit_all(pool, CASES, temperature=1.0, seed=7)[0] == alone
    finally:
        pool.decode_steps = 8


def test_the_openai_client_gets_fbt_decodes_tokens_in_every_mode(client, pool):
    """/v1/models lists a model id per mode; a greedy completion's text (token ids, this run trained on
    a task) is decode.generate's, streamed or not; usage counts tokens."""
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny:soft", "tiny:fused"]
    prompt = prompt_of(6)
    for model, mode in (("tiny", "standard"), ("tiny:soft", "soft"), ("tiny:fused", "fused")):
        want = " ".join(map(str, reference(pool.model, prompt, mode, 10)))
        out = client.completions.create(model=model, prompt=" ".join(map(str, prompt)), max_tokens=10, temperature=0)
        assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 10)
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "length"


def test_32_concurrent_openai_clients_get_fbt_decodes_tokens(base_url, pool):
    """32 requests at once from the async openai client (three slots: most wait in the queue), of other
    lengths, modes and token counts, half streamed: each gets decode.generate's greedy text for it alone."""
    import asyncio

    from openai import AsyncOpenAI

    cases = [(1 + i % 12, ("tiny", "tiny:soft", "tiny:fused")[i % 3], 1 + (i * 5) % 12, i % 2 == 0) for i in range(32)]

    async def ask(client, n, model, m, stream):
        prompt = prompt_of(n, salt=2)
        out = await client.completions.create(model=model, prompt=prompt, max_tokens=m, temperature=0, stream=stream)
        if not stream:
            return out.choices[0].text
        return "".join([c.choices[0].text async for c in out])

    async def everyone():
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(ask(client, *case) for case in cases))

    modes = {"tiny": "standard", "tiny:soft": "soft", "tiny:fused": "fused"}
    for (n, model, m, _), text in zip(cases, asyncio.run(everyone())):
        assert text == " ".join(map(str, reference(pool.model, prompt_of(n, salt=2), modes[model], m))), (n, model, m)


def test_choices_seeds_and_batches_of_prompts(client):
    """n choices per prompt for a list of prompts, indexed prompt-major; a seeded sampled request
    answers the same text on a rerun; its choices differ from one another."""
    prompts = [prompt_of(4), prompt_of(9)]
    ask = lambda: client.completions.create(
        model="tiny:soft", prompt=prompts, max_tokens=8, n=3, seed=5, temperature=1.0
    )
    first, again = ask(), ask()
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices[:3]}) > 1
    assert first.usage.prompt_tokens == 13 and first.usage.completion_tokens == 48


def test_echo_logprobs_are_a_plain_forwards(client, pool):
    """echo + logprobs in standard mode (lm-evaluation-harness's loglikelihood request): each prompt
    token's log-probability after the ones before it equals one plain forward's; the first has none;
    the top alternatives are the most likely tokens."""
    prompt = prompt_of(10, salt=1)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    (h,) = kpass_forward(pool.model, jnp.asarray([prompt]), jnp.ones((1,), jnp.int32), 1)
    logp = np.asarray(jax.nn.log_softmax(pool.model.logits(h)[0].astype(jnp.float32)))
    want = [logp[t - 1, prompt[t]] for t in range(1, 10)]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == 11
    np.testing.assert_allclose(lp.token_logprobs[1:10], want, atol=1e-5)
    assert list(lp.top_logprobs[1]) == [str(i) for i in np.argsort(-logp[0])[:2]]
    assert lp.tokens[:10] == [str(t) for t in prompt] and out.choices[0].text.startswith(" ".join(map(str, prompt)))


def test_a_streamed_echo_with_logprobs_adds_up_to_the_unstreamed_answer(client):
    """echo + logprobs streamed, in standard and fused mode, scoring only (max_tokens 0) or generating
    too: the chunks' texts, tokens, log-probabilities, alternatives and text offsets, concatenated, are
    the unstreamed answer's (the prompt once, offsets into the whole text, not restarting per chunk)."""
    prompt = " ".join(map(str, prompt_of(10, salt=3)))
    for model in ("tiny", "tiny:fused"):
        for max_tokens in (0, 6):
            ask = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True, logprobs=2)
            whole = client.completions.create(**ask).choices[0]
            chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
            assert "".join(c.text for c in chunks) == whole.text, (model, max_tokens)
            assert whole.text.startswith(prompt) and whole.text.count(prompt) == 1
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                streamed = [x for c in chunks if c.logprobs for x in getattr(c.logprobs, field)]
                assert streamed == getattr(whole.logprobs, field), (model, max_tokens, field)
            assert len(whole.logprobs.tokens) == 10 + max_tokens and chunks[-1].finish_reason == "length"


def test_stop_strings_end_a_completion(client, pool):
    """A stop string ends the choice before it (finish_reason "stop"), streamed or not."""
    prompt = prompt_of(5)
    full = " ".join(map(str, reference(pool.model, prompt, "soft", 12)))
    stop = full.split(" ")[3]
    want = full[: full.find(stop)]
    for stream in (False, True):
        out = client.completions.create(model="tiny:soft", prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                        stream=stream)  # fmt: skip
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


BAD = [
    ("not json", "not valid JSON"),
    ({"model": "tiny"}, "no 'prompt'"),
    ({"model": "tiny", "prompt": "1 2", "max_tokens": 0}, "max_tokens=0 must be at least 1"),
    ({"model": "tiny", "prompt": "1 2", "max_tokens": 23}, "exceeds the context of 24 tokens"),
    ({"model": "tiny", "prompt": " ".join(["1"] * 25)}, "does not fit the context of 24"),
    ({"model": "tiny", "prompt": [1, 99]}, "token id 99 is outside the vocabulary"),
    ({"model": "tiny", "prompt": "a b"}, "not space-separated token ids"),
    ({"model": "tiny", "prompt": "1", "temperature": -1}, "temperature=-1"),
    ({"model": "tiny", "prompt": "1", "logit_bias": {}}, "'logit_bias' is not a field this server takes"),
    ({"model": "tiny", "prompt": "1", "presence_penalty": 1}, "presence_penalty=1: penalties are not supported"),
    ({"model": "tiny", "prompt": "1", "n": 0}, "n=0"),
    ("", "the request has no body"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "no chat template"),
]


@pytest.mark.parametrize("body,says", BAD, ids=[says for _, says in BAD])
def test_a_bad_request_gets_one_line_400_and_the_server_stays_up(base_url, body, says):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = httpx.post(base_url + path, headers={"Content-Type": "application/json"}, **kwargs)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert says in message and "\n" not in message, message
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}


def error_of(response: httpx.Response, status: int) -> dict:
    """The error a refusal carries, checked to be OpenAI's shape (what every client parses) in one line."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "\n" not in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("field,value", [("best_of", 3), ("suffix", "x"), ("presence_penalty", 0.5),
                                         ("frequency_penalty", -1)])  # fmt: skip
def test_a_refused_field_is_named_in_its_error(base_url, field, value):
    """A field the server does not take at that value: the message and `param` name it."""
    response = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "1", field: value})
    error = error_of(response, 400)
    assert error["param"] == field and error["message"].startswith(f"{field}="), error
    assert "JSON object" not in error["message"]


def test_null_optional_fields_take_their_defaults(base_url):
    """Explicit JSON null for any optional field OpenAI documents as nullable means its default."""
    nulls = dict.fromkeys(["max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                           "user", "presence_penalty", "frequency_penalty", "logprobs", "echo", "best_of", "suffix",
                           "logit_bias"])  # fmt: skip
    response = httpx.post(base_url + "/v1/completions", json={"model": "tiny:soft", "prompt": "1 2", **nulls})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert response.json()["usage"]["completion_tokens"] == 16 and choice["logprobs"] is None
    assert len(choice["text"].split()) == 16  # echo: false


def test_every_refusal_is_in_openais_shape_and_unknown_models_are_404(base_url, client):
    """Errors raised outside the handlers (an unknown route, a wrong method, a body that is not JSON
    or not UTF-8) come in OpenAI's shape, not FastAPI's {"detail": ...}; an unknown model is 404
    model_not_found (the openai client's NotFoundError), and GET /v1/models/{id} answers ours."""
    import openai

    assert "is not an endpoint" in error_of(httpx.get(base_url + "/v1/nope"), 404)["message"]
    wrong = httpx.get(base_url + "/v1/completions")
    assert "use POST" in error_of(wrong, 405)["message"] and wrong.headers["Allow"] == "POST"
    for body in (b"{", b"[1]", b"\xff\xfe"):
        assert error_of(httpx.post(base_url + "/tokenize", content=body), 400)["message"]
    assert "JSON object" in error_of(httpx.post(base_url + "/v1/completions", content=b"[1]"), 400)["message"]
    unknown = error_of(httpx.post(base_url + "/v1/completions", json={"model": "nope", "prompt": "1"}), 404)
    assert unknown["code"] == "model_not_found" and unknown["param"] == "model" and "'nope'" in unknown["message"]
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="nope", prompt="1", max_tokens=1)
    assert refused.value.code == "model_not_found"
    assert client.models.retrieve("tiny:fused").id == "tiny:fused"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny:nope")


def test_a_request_that_can_never_fit_is_400_and_one_that_fits_free_slots_enters(served, base_url):
    """429 means "retry shortly": only for a request that would fit (slots + --max-waiting) but not
    now. On an idle server a request that fits the free slots enters even with --max-waiting=0; one
    larger than slots + queue gets a 400 naming n or the prompt count and the limit."""
    pool, limit = served.pool, served.pool.max_waiting
    wait_for(lambda: not pool.running() and not pool.waiting, timeout=30)
    ask = lambda **body: httpx.post(base_url + "/v1/completions", json={"model": "tiny", "max_tokens": 2, **body})
    try:
        pool.max_waiting = 0
        assert ask(prompt=[1, 2]).status_code == 200
        assert len(ask(prompt=[1, 2], n=SLOTS).json()["choices"]) == SLOTS
        error = error_of(ask(prompt=[1, 2], n=SLOTS + 1), 400)
        assert error["param"] == "n" and "n=4" in error["message"] and "--max-waiting=0" in error["message"]
        pool.max_waiting = 2
        assert len(ask(prompt=[1, 2], n=SLOTS + 2).json()["choices"]) == SLOTS + 2  # n > --max-waiting, idle
    finally:
        pool.max_waiting = limit
    error = error_of(ask(prompt=[[1, 2]] * 300), 400)
    assert error["param"] == "prompt" and "300 prompts" in error["message"] and "at most 43" in error["message"]


def test_a_full_queue_answers_429_and_metrics_count(served, base_url):
    """With every slot busy and the queue at its limit, a request gets 429 with Retry-After; /metrics
    reports slots, tokens, first-token times, refusals by status (429 among them), each answered
    request's latency and each choice's time in the queue, in Prometheus' text format."""
    pool = served.pool
    sample = lambda name, **labels: pool.metrics.registry.get_sample_value(name, labels) or 0.0
    refused = lambda status: sample("fbt_requests_refused_total", status=status)
    before = {status: refused(status) for status in ("400", "404", "405", "429")}
    answered, queued = sample("fbt_e2e_request_latency_seconds_count"), sample("fbt_request_queue_time_seconds_count")
    assert httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": [1], "n": 2}).status_code == 200
    httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": []})
    httpx.post(base_url + "/v1/completions", json={"model": "nope", "prompt": [1]})
    httpx.get(base_url + "/v1/completions")
    limit, release = pool.max_waiting, threading.Event()
    hold = [
        Request([1], "soft", 20, lambda e: None, stop_check=lambda ids: release.wait(30) and False)
        for _ in range(SLOTS)
    ]
    try:
        pool.submit(hold)  # they take every slot, and keep them until released
        while pool.running() < SLOTS:
            time.sleep(0.01)
        pool.max_waiting = 0
        response = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert "busy" in error_of(response, 429)["message"]
    finally:
        release.set()
        for r in hold:
            r.cancelled = True
        pool.max_waiting = limit
    while pool.running():
        time.sleep(0.01)
    time.sleep(0.05)  # the gauges are set after the step that freed the slots
    text = httpx.get(base_url + "/metrics").text
    assert "fbt_slots 3.0" in text and "fbt_time_to_first_token_seconds_count" in text
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    assert value["fbt_generated_tokens_total"] > 0 and value["fbt_requests_running"] == 0
    assert {status: refused(status) - before[status] for status in before} == dict.fromkeys(before, 1.0)
    assert sample("fbt_e2e_request_latency_seconds_count") == answered + 1
    assert sample("fbt_request_queue_time_seconds_count") >= queued + 2  # its two choices (and the held ones)
    for histogram in ("fbt_e2e_request_latency_seconds", "fbt_request_queue_time_seconds"):
        assert f'{histogram}_bucket{{le="+Inf"}}' in text and f"{histogram}_sum" in text


def test_a_failing_request_fails_alone(served, base_url, monkeypatch):
    """A request whose prefill raises gets a 500 naming it; the next request is served."""
    real = served.pool._insert

    def insert(prompt, *args):
        if prompt[0] == 13:
            raise RuntimeError("injected")
        return real(prompt, *args)

    monkeypatch.setattr(served.pool, "_insert", insert)
    failures = lambda: served.pool.metrics.registry.get_sample_value("fbt_requests_failed_total", {"status": "500"})
    before = failures() or 0.0
    failed = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": [13, 2], "max_tokens": 2})
    assert failed.status_code == 500 and "injected" in failed.json()["error"]["message"]
    assert failures() == before + 1  # counted in /metrics as failed, not refused
    ok = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": [12, 2], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "world", "the", "a", "cat",
         "sat", "on", "mat", "and", "dog"]  # fmt: skip


def chat_tokenizer(directory):
    """A 16-word tokenizer saved as transformers saves one, with a chat template (an instruct model's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(WORDS[:6])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def test_chat_completions_follow_the_tokenizers_template(served, client, tmp_path, monkeypatch):
    """A run whose tokenizer carries a chat template: the messages are rendered by it, and the answer
    is the soft greedy continuation of the rendered ids, streamed or not."""
    from fbt_jax.data.tokenizers import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(chat_tokenizer(tmp_path))
    codec = Codec(types.SimpleNamespace(source="text", tokenizer=tokenizer))
    template = chat_template(tokenizer)
    assert template == CHAT_TEMPLATE
    monkeypatch.setattr(served, "codec", codec)
    monkeypatch.setattr(served, "chat", ChatTemplate(template, tokenizer))
    messages = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world"}]
    ids = [0, 5, 8, 10, 3, 6, 7, 4]  # <s> <|system|> the cat <|user|> hello world <|assistant|>
    assert served.chat.encode(messages) == ids
    want = reference(served.pool.model, ids, "soft", 6)
    want = want[: want.index(1) + 1] if 1 in want else want  # ends at </s>
    out = client.chat.completions.create(model="tiny:soft", messages=messages, max_tokens=6, temperature=0)
    assert out.choices[0].message.content == tokenizer.decode(want) and out.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny:soft", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(want)
    assert chunks[0].choices[0].delta.role == "assistant"


class Collected(logging.Handler):
    """The records a logger emits while attached (uvicorn logs an application's tracebacks on
    `uvicorn.error`, which does not propagate to the root logger that pytest's caplog reads)."""

    def __init__(self, name: str):
        super().__init__(logging.ERROR)
        self.logger, self.records = logging.getLogger(name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "Collected":
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def test_text_that_is_not_unicode_is_a_400_and_chat_takes_nulls(served, base_url, tmp_path, monkeypatch):
    """A text run (a tokenizer with a chat template): a lone surrogate in a prompt, a /tokenize prompt
    or a chat message is the client's input, a one-line 400 naming it, with no traceback logged; a
    chat request's optional fields sent as null take their defaults."""
    from fbt_jax.data.tokenizers import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(chat_tokenizer(tmp_path))
    monkeypatch.setattr(served, "codec", Codec(types.SimpleNamespace(source="text", tokenizer=tokenizer)))
    monkeypatch.setattr(served, "chat", ChatTemplate(CHAT_TEMPLATE, tokenizer))
    post = lambda path, raw: httpx.post(base_url + path, content=raw, headers={"Content-Type": "application/json"})
    with Collected("uvicorn.error") as logged:
        for path, raw, param in [
            ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
            ("/v1/completions", '{"model": "tiny", "prompt": ["hello", "a\\ud800b"]}', "prompt"),
            ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
            ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
             "messages"),
        ]:  # fmt: skip
            error = error_of(post(path, raw), 400)
            assert error["param"] == param and "lone surrogate ('\\ud" in error["message"], error
    assert not logged.records, [r.getMessage() for r in logged.records]
    nulls = dict.fromkeys(["max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stop",
                           "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "user",
                           "tools", "tool_choice", "response_format"])  # fmt: skip
    body = {"model": "tiny:soft", "messages": [{"role": "user", "content": "hello"}], **nulls}
    response = httpx.post(base_url + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


def test_fbt_serve_serves_a_trained_run_and_drains_on_sigterm(trained_run, tmp_path):
    """The command on a trained run: ready after compiling, fbt-decode's soft tokens to the openai
    client; SIGTERM while requests stream: they all finish, then it exits 0."""
    from openai import OpenAI

    from fbt_jax.trained import load_model

    argv = ["fbt-serve", f"--checkpoint={trained_run}", "--name=run", "--port=0", "--slots=1", "--context-len=64",
            "--prefill-buckets=64"]  # fmt: skip
    log = open(tmp_path / "serve.log", "w+")
    server = start_command(argv, cpu_env(1), stdout=subprocess.PIPE, stderr=log)
    try:
        ready = server.stdout.readline()
        assert "serving run, run:soft, run:fused at http://127.0.0.1:" in ready, (
            ready + (tmp_path / "serve.log").read_text()
        )
        url = ready.split(" at ")[1].strip()
        client = OpenAI(base_url=url, api_key="none", max_retries=0)
        model, _ = load_model(trained_run, log=lambda *_: None)
        prompt = [3, 1, 4, 1, 5]
        out = client.completions.create(model="run:soft", prompt="3 1 4 1 5", max_tokens=8, temperature=0)
        assert out.choices[0].text == " ".join(map(str, reference(model, prompt, "soft", 8)))
        # One slot, three long streams: SIGTERM after the first chunk; each stream still ends whole.
        streams = [client.completions.create(model="run", prompt=prompt, max_tokens=40, temperature=0, stream=True)
                   for _ in range(3)]  # fmt: skip
        first = next(iter(streams[0]))
        os.kill(server.pid, signal.SIGTERM)
        texts = [first.choices[0].text + "".join(c.choices[0].text for c in streams[0])]
        texts += ["".join(c.choices[0].text for c in s) for s in streams[1:]]
        assert all(len(t.split()) == 40 for t in texts), texts
        assert server.wait(60) == 0
        assert "fbt-serve: stopped" in server.stdout.read()
    finally:
        server.kill()


def test_a_client_that_goes_away_frees_its_slot(served, base_url, monkeypatch):
    """A streaming client that closes its connection after the first chunk: its request leaves its
    slot at the next step (counted as cancelled), long before its max_tokens."""
    pool, real = served.pool, served.pool._step

    def slow_step(sampling, num_steps):  # 23 steps would take over a second: the request is cut well before
        time.sleep(0.05 * num_steps)
        return real(sampling, num_steps)

    monkeypatch.setattr(pool, "_step", slow_step)
    cancelled = lambda: (
        pool.metrics.registry.get_sample_value("fbt_requests_finished_total", {"mode": "soft", "reason": "cancelled"})
        or 0.0
    )
    before, started = cancelled(), time.perf_counter()
    body = {"model": "tiny:soft", "prompt": [1], "max_tokens": 23, "temperature": 0, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body) as response:
        next(response.iter_lines())
    wait_for(lambda: cancelled() == before + 1 and not pool.running(), timeout=30)
    assert time.perf_counter() - started < 23 * 0.05


def test_a_non_streamed_client_that_goes_away_frees_its_slots(served, base_url, monkeypatch):
    """A client that gives up on a non-streamed request (its connection closed while a token comes
    every 0.1 s, so the wait for the next one never times out): the request leaves its slot within a
    check and a step (counted as cancelled), long before its max_tokens."""
    pool, real = served.pool, served.pool._step

    def slow_step(sampling, num_steps):  # 23 steps would take 2.3 s: the request is cut well before
        time.sleep(0.1 * num_steps)
        return real(sampling, num_steps)

    monkeypatch.setattr(pool, "_step", slow_step)
    monkeypatch.setattr(pool, "decode_steps", 1)  # a token every step: no pause between tokens
    cancelled = lambda: (
        pool.metrics.registry.get_sample_value("fbt_requests_finished_total", {"mode": "soft", "reason": "cancelled"})
        or 0.0
    )
    before, started = cancelled(), time.perf_counter()
    body = {"model": "tiny:soft", "prompt": [1], "max_tokens": 23, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, timeout=0.3)
    wait_for(lambda: cancelled() == before + 1 and not pool.running(), timeout=10)
    assert time.perf_counter() - started < 23 * 0.1


def test_grace_zero_is_no_grace():
    """--grace reaches uvicorn as given: 0 cuts running requests at once, and a fraction is kept
    (uvicorn reads None, which `int(grace) or None` gave for both, as waiting without limit)."""
    from fastapi import FastAPI

    from fbt_jax.serve import cli

    assert cli.server_config(FastAPI(), 0.0).timeout_graceful_shutdown == 0
    assert cli.server_config(FastAPI(), 0.5).timeout_graceful_shutdown == 0.5
    assert cli.server_config(FastAPI(), 30.0).timeout_graceful_shutdown == 30


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--slots=0"], "--slots=0 must be at least 1"),
        (["--prefill-buckets=64,x"], "is not comma-separated lengths"),
        (["--port=70000"], "--port=70000 is not a port"),
        (["--name=a:b"], "a model id here has no ':'"),
        (["--checkpoint=/nonexistent/run"], "/nonexistent/run"),
    ],
)
def test_fbt_serve_refuses_bad_flags_in_one_line(flags, says, capsys):
    """Each refused before the checkpoint is read (or when it cannot be), as one line, exit code 2."""
    from fbt_jax.serve import cli

    argv = ["--checkpoint=/nonexistent/run", *flags] if not flags[0].startswith("--checkpoint") else flags
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and err.startswith("fbt-serve: "), err
    assert exited.value.code != 0
