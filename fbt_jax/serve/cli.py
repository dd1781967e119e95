"""`fbt-serve`: a trained run behind an OpenAI-compatible API, in the three decoding modes.

    fbt-serve --checkpoint=runs/text --port=8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "text:soft", "prompt": "The", "max_tokens": 16, "temperature": 0}'

The run is read (local or gs://), every program is compiled, then the server listens. SIGTERM or
SIGINT drains it: no new requests, those running finish (within --grace seconds), then it exits 0.
docs/serving.md has the rest.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from fbt_jax import paths
from fbt_jax.errors import ArgumentParser, ConfigError, divert_library_noise, reported


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="fbt-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run's workdir or checkpoint directory (local or gs://)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one, printed)")
    parser.add_argument("--name", default="", help="the model id clients name (default: the run directory's name)")
    parser.add_argument("--slots", type=int, default=16, help="requests decoded at once (decode slots on the device)")
    parser.add_argument("--context-len", type=int, default=0, help="prompt + generated tokens (default: data.seq_len)")
    parser.add_argument(
        "--prefill-buckets", default="", help="prompt lengths compiled, comma-separated (default: doubling from 32)"
    )
    parser.add_argument("--prefill-passes", type=int, default=2, help="passes of the fused prefill (NAME:fused)")
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="choices queued beyond the slots: a request that fits --slots + this but not now gets 429, a larger one 400",
    )
    parser.add_argument(
        "--decode-steps", type=int, default=8, help="decode steps per trip from the host while no request waits"
    )
    parser.add_argument(
        "--grace", type=float, default=30.0, help="seconds running requests get to finish on SIGTERM (0: none)"
    )
    with reported("fbt-serve"):
        args = parser.parse_args(argv)
        buckets = check_args(args)
        served = load(args, buckets, log=lambda line: print(line, file=sys.stderr, flush=True))
        serve(served, args.host, args.port, args.grace)


def check_args(args: Any) -> tuple[int, ...]:
    """One-line errors for bad flags, before the checkpoint is read; returns the prefill buckets."""
    for flag, value, least in (("--slots", args.slots, 1), ("--prefill-passes", args.prefill_passes, 1),
                               ("--max-waiting", args.max_waiting, 0), ("--decode-steps", args.decode_steps, 1), ("--context-len", args.context_len, 0),
                               ("--port", args.port, 0)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{flag}={value} must be at least {least}")
    if args.port > 65535:
        raise ConfigError(f"--port={args.port} is not a port; use 1-65535, or 0 for any free one")
    if args.grace < 0:
        raise ConfigError(f"--grace={args.grace} is negative; give the seconds requests get to finish")
    try:
        buckets = tuple(int(b) for b in args.prefill_buckets.split(",") if b.strip())
    except ValueError:
        raise ConfigError(
            f"--prefill-buckets={args.prefill_buckets!r} is not comma-separated lengths, e.g. 64,256"
        ) from None
    if any(b < 1 for b in buckets):
        raise ConfigError(f"--prefill-buckets={args.prefill_buckets!r}: every length must be at least 1")
    if args.name and (":" in args.name or "/" in args.name):
        raise ConfigError(f"--name={args.name!r}: a model id here has no ':' or '/' (the modes add ':soft', ':fused')")
    return buckets


def load(args: Any, buckets: tuple[int, ...], log: Any = print) -> Any:
    """Read the run, build its pool and compile every program: the server's state, ready to serve."""
    from fbt_jax.data.plan import plan_data, run_chat_template
    from fbt_jax.run_services import use_run_cache
    from fbt_jax.serve.api import Served
    from fbt_jax.serve.metrics import Metrics
    from fbt_jax.serve.pool import Pool
    from fbt_jax.serve.text import ChatTemplate, Codec
    from fbt_jax.trained import load_model

    divert_library_noise(os.devnull)  # storage libraries' thread tracebacks on damaged checkpoints
    checkpoint = paths.resolve(args.checkpoint, "--checkpoint")
    model, config = load_model(checkpoint, log=log)
    use_run_cache(config, checkpoint, log=log)
    data = plan_data(config, read_data=False)  # the run's tokenizer and context; its data is not read
    context = args.context_len or int(data.seq_len)
    if buckets and max(buckets) > context:
        raise ConfigError(f"--prefill-buckets: {max(buckets)} exceeds the context of {context} tokens; drop it")
    codec = Codec(data)
    template = run_chat_template(config, codec.tokenizer, log) if codec.tokenizer is not None else None
    name = args.name or os.path.basename(os.path.normpath(checkpoint)) or "fbt"
    pool = Pool(model, args.slots, context, buckets=buckets or None, prefill_passes=args.prefill_passes,
                max_waiting=args.max_waiting, decode_steps=args.decode_steps, metrics=Metrics(args.slots))  # fmt: skip
    started = time.perf_counter()
    programs, _ = pool.compile()
    log(f"fbt-serve: compiled {programs} programs in {time.perf_counter() - started:.1f} s "
        f"({args.slots} slots, context {context}, prefill buckets {','.join(map(str, pool.buckets))})")  # fmt: skip
    chat = ChatTemplate(template, codec.tokenizer) if template else None
    if chat is not None:  # a tuned model ends its reply with the template's end-of-turn: a generation stops there
        codec.stop_ids = tuple(dict.fromkeys([*codec.stop_ids, *chat.end_of_turn_ids]))
    return Served(name, pool, codec, model.cfg.vocab_size, chat)


def serve(served: Any, host: str, port: int, grace: float) -> None:
    """Listen until SIGTERM or SIGINT, then drain: refuse new requests (503), let running ones finish
    within `grace` seconds, exit."""
    import signal
    import socket

    import uvicorn

    from fbt_jax.serve.api import create_app

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            served.pool.drain()
            super().handle_exit(sig, frame)

    try:
        sock = socket.create_server((host, port))
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}); choose another --port or --host") from None
    bound = sock.getsockname()[1]
    server = Server(server_config(create_app(served), grace))
    # uvicorn raises the signal it drained on once it has stopped, through the handler it found: a
    # drained server is a clean exit (0), so that handler does nothing.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(f"fbt-serve: serving {', '.join(served.model_ids())} at http://{host}:{bound}/v1", flush=True)
    server.run(sockets=[sock])
    print("fbt-serve: stopped", flush=True)


def server_config(app: Any, grace: float) -> Any:
    """uvicorn's settings for fbt-serve: quiet, and `grace` seconds for running requests once drained,
    as given: 0 is no grace (they are cut at once), where uvicorn reads None as no limit at all."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace)


@contextlib.contextmanager
def running(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """An app served by uvicorn in a thread of this process (a notebook's, a benchmark's, the tests'),
    on a free port unless one is given; yields its base URL and stops it on the way out."""
    import socket
    import threading

    import uvicorn

    sock = socket.create_server((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server stopped while starting")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


if __name__ == "__main__":
    main()
