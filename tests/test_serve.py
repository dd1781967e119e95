"""fbt-serve (`fbt_jax/serve`): the decode pool's answers equal `decode.generate`'s (fbt-decode's
path) whatever else shares the batch, the official openai client gets them in the three modes
(streamed or not), logprobs with echo equal a plain forward, chat follows the tokenizer's template,
bad requests get one-line 400s and the server stays up, a full queue answers 429, a failing request
fails alone, and the command serves a trained run, drains on SIGTERM and exits 0.

Most tests share one in-process server on a small random model (its programs compiled once)."""

import json
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
    ({"model": "nope", "prompt": "1"}, "'nope' is not served here"),
    ({"model": "tiny", "prompt": "1 2", "max_tokens": 0}, "max_tokens=0 must be at least 1"),
    ({"model": "tiny", "prompt": "1 2", "max_tokens": 23}, "exceeds the context of 24 tokens"),
    ({"model": "tiny", "prompt": " ".join(["1"] * 25)}, "does not fit the context of 24"),
    ({"model": "tiny", "prompt": [1, 99]}, "token id 99 is outside the vocabulary"),
    ({"model": "tiny", "prompt": "a b"}, "not space-separated token ids"),
    ({"model": "tiny", "prompt": "1", "temperature": -1}, "temperature=-1"),
    ({"model": "tiny", "prompt": "1", "logit_bias": {}}, "'logit_bias' is not a field this server takes"),
    ({"model": "tiny", "prompt": "1", "presence_penalty": 1}, "presence_penalty is not supported"),
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


def test_a_full_queue_answers_429_and_metrics_count(served, base_url):
    """With every slot busy and the queue at its limit, a request gets 429 with Retry-After; /metrics
    reports slots, tokens and first-token times in Prometheus' text format."""
    pool = served.pool
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
        assert "busy" in response.json()["error"]["message"]
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


def test_a_failing_request_fails_alone(served, base_url, monkeypatch):
    """A request whose prefill raises gets a 500 naming it; the next request is served."""
    real = served.pool._insert

    def insert(prompt, *args):
        if prompt[0] == 13:
            raise RuntimeError("injected")
        return real(prompt, *args)

    monkeypatch.setattr(served.pool, "_insert", insert)
    failed = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": [13, 2], "max_tokens": 2})
    assert failed.status_code == 500 and "injected" in failed.json()["error"]["message"]
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
