"""What the test files share: the repository root, configs, small models and run configs, running
the fbt-* commands as subprocesses, and reading what a run wrote."""

import os

# Tests run on the CPU with 8 simulated devices, so that meshes can be tested on one machine
# (single-device references pass `devices=jax.devices()[:1]`).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Each process runs XLA's CPU kernels on one thread: two pytest workers share the 2 cores, and each
# one's processes running their kernels over both cores only took turns with the other's (the
# benchmarks' smoke runs, -n 2: 174 s against 185 s; FBT_TEST_EIGEN_THREADS=1 measures it again).
SINGLE_THREADED = "--xla_cpu_multi_thread_eigen=false" if not os.environ.get("FBT_TEST_EIGEN_THREADS") else ""
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" {SINGLE_THREADED} --xla_force_host_platform_device_count=8"
)

import atexit  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# In the commands the tests start, a DeprecationWarning met by our own code is an error, as it is in
# this process (pyproject.toml's filterwarnings): one filter per fbt_jax module, since the
# environment's filters match a module's name exactly. A dependency's deprecations inside its own
# code (ml_collections' `load_module`, say) stay warnings there.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODULES = sorted(
    os.path.splitext(os.path.relpath(path, _CHECKOUT))[0].replace(os.sep, ".").removesuffix(".__init__")
    for path in glob.glob(os.path.join(_CHECKOUT, "fbt_jax", "**", "*.py"), recursive=True)
)
os.environ["PYTHONWARNINGS"] = ",".join(f"error::DeprecationWarning:{module}" for module in _MODULES)

# One persistent compilation cache for the whole session, shared by this process and every command
# the tests start (they inherit the environment): most tests run the same tiny programs in a new
# process, and recompiling them dominated the suite's time. Keys cover the program, the XLA flags
# and the devices, so a cached program is the program. Removed when the session ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fbt-jax-test-compile-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Likewise one directory for what the session fixtures make (trained runs, prepared data): the first
# worker to need one makes it, the other waits and reads it (`made_once`).
if "FBT_TEST_SHARED_DIR" not in os.environ:
    os.environ["FBT_TEST_SHARED_DIR"] = tempfile.mkdtemp(prefix="fbt-jax-test-shared-")
    atexit.register(shutil.rmtree, os.environ["FBT_TEST_SHARED_DIR"], ignore_errors=True)

import glob  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import warm_commands  # noqa: E402
from scheduling import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: E402, F401  (how the workers share the suite)

from fbt_jax.model import ModelConfig, build_model  # noqa: E402

# The in-process tests' own programs compile with most of XLA's optimisation off: they are tiny,
# and compiling them cost more than running them (-45% of a compile-bound test's CPU time). A flag
# of this process alone: the commands the tests start (and the warm server) compile as a user's
# run does, and the persistent cache's keys tell the two kinds of program apart.
jax.config.update("jax_disable_most_optimizations", True)


@contextlib.contextmanager
def optimised_programs():
    """Within it, this process compiles with XLA's full optimisation, as the commands do: for a file
    that compares in-process figures with a command's to a tolerance finer than the two ways of
    compiling agree on. jit's in-memory caches are cleared on the way in and out (the setting is not
    part of their key), so no program compiled the other way is reused."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        jax.clear_caches()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)  # this environment's fbt-* scripts
MODULES = {
    "fbt-train": "fbt_jax.train",
    "fbt-eval": "fbt_jax.evals.cli",
    "fbt-decode": "fbt_jax.decode_cli",
    "fbt-prepare": "fbt_jax.data.prepare",
    "fbt-train-tokenizer": "fbt_jax.data.train_tokenizer",
    "fbt-sweep": "fbt_jax.sweep.cli",
    "fbt-serve": "fbt_jax.serve.cli",
    "fbt-self-train": "fbt_jax.selftrain.cli",
}


# --- configs and models ------------------------------------------------------------------------------


def load_config(name: str):
    """configs/<name>.py's config."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def small_model_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=16, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64)
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(scope="module")
def small_model():
    return build_model(small_model_config(), seed=0)


def run_config(tmp_path, name: str = "run", steps: int = 6, schedule: str = "0:1=0.5,2=0.5", mesh=None):
    """configs/tiny.py as a short run in tmp_path/name: `steps` steps, each logged, one warm-up
    step, no evaluation; `mesh` (data, fsdp, tensor) if given."""
    config = load_config("tiny")
    config.workdir = str(tmp_path / name)
    config.train.steps = steps
    config.train.log_every = 1
    config.optimizer.warmup_steps = 1
    config.passes.schedule = schedule
    config.eval.num_batches = 0
    if mesh is not None:
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    return config


def checkpointed_config(tmp_path, name: str = "run", steps: int = 6, mesh=(-1, 1, 1)):
    """`run_config` with K drawn from {1, 2} and a checkpoint every 2 steps (the last 3 kept)."""
    config = run_config(tmp_path, name, steps, mesh=mesh)
    config.checkpoint.every_steps = 2
    config.checkpoint.max_to_keep = 3
    return config


def set_fields(config, overrides: dict) -> None:
    """Set config fields by dotted path, e.g. {"model.num_heads": 5, "seed": 1}."""
    for path, value in overrides.items():
        section, _, name = path.rpartition(".")
        (config[section] if section else config)[name] = value


def train_argv(workdir: str, *overrides: str) -> list[str]:
    """The fbt-train command of a short tiny run in `workdir` (each step logged, one warm-up step,
    no evaluation), then `overrides`; run it with `run_command` or `start_command`."""
    return [
        "fbt-train",
        "--config=configs/tiny.py",
        "--config.train.log_every=1",
        "--config.optimizer.warmup_steps=1",
        "--config.eval.num_batches=0",
        f"--config.workdir={workdir}",
        *overrides,
    ]


# --- commands as subprocesses ----------------------------------------------------------------------------


_WARM: dict[str, str] = {}


def warm_bin() -> str | None:
    """The directory of this pytest worker's warm shims for the fbt-* commands (tests/warm_commands.py:
    the same scripts, without importing jax again), its server started on first use; None where
    FBT_TEST_COLD is set (every command then starts cold, as a user's does)."""
    if os.environ.get("FBT_TEST_COLD") or not os.path.exists(os.path.join(BIN, "fbt-train")):
        return None
    if "bin" not in _WARM:
        server, shim_dir = warm_commands.start(BIN, dict(os.environ))
        atexit.register(warm_commands.stop, server, shim_dir)
        _WARM["bin"] = shim_dir
    return _WARM["bin"]


def with_warm_commands(env: dict[str, str]) -> dict[str, str]:
    """`env` with the warm shims first on its PATH: for shell lines (the documented commands)."""
    shims = warm_bin()
    return env if shims is None else {**env, "PATH": shims + os.pathsep + env.get("PATH", "")}


def command(argv: list[str], warm: bool = False) -> list[str]:
    """`argv` ready to run: an fbt-* program is this environment's script (`python -m` its module
    where the package is not installed; with `warm`, its warm shim where there is one), a launch/
    script runs under bash, anything else as is."""
    program = argv[0]
    shims = warm_bin() if warm and program in warm_commands.SERVED else None
    if shims is not None and os.path.exists(os.path.join(shims, program)):
        return [os.path.join(shims, program), *argv[1:]]
    if program in MODULES:
        script = os.path.join(BIN, program)
        head = [script] if os.path.exists(script) else [sys.executable, "-m", MODULES[program]]
        return [*head, *argv[1:]]
    if program.startswith("launch/"):
        return ["bash", *argv]
    return list(argv)


def cpu_env(devices: int | None = 1, **extra: str) -> dict[str, str]:
    """This process's environment for a command: on the CPU with `devices` simulated devices (None:
    no XLA_FLAGS, one device, as a user runs it), this environment's scripts first on PATH, and
    `extra` on top."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    env.pop("XLA_FLAGS", None)
    if SINGLE_THREADED:
        env["XLA_FLAGS"] = SINGLE_THREADED
    if devices is not None:
        env["XLA_FLAGS"] = f"{SINGLE_THREADED} --xla_force_host_platform_device_count={devices}".strip()
    return {**env, **extra}


def run_command(argv: list[str], env=None, cwd=ROOT, timeout=None, **kwargs) -> subprocess.CompletedProcess:
    """Run `argv` (see `command`; warm where it can be) from `cwd` to its end, its output captured as
    text. With `env` None it inherits this process's environment (8 simulated devices)."""
    # Warm unless the caller shapes the process itself (preexec_fn setting a limit, a session, ...):
    # the shim would take it, not the command.
    argv = command(argv, warm=set(kwargs) <= {"check", "input"})
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


def start_command(argv: list[str], env=None, cwd=ROOT, **kwargs) -> subprocess.Popen:
    """Start `argv` (see `command`; cold, as the tests that start a command signal or kill it) from
    `cwd`, in text mode; `kwargs` go to Popen (stdout=...)."""
    return subprocess.Popen(command(argv), cwd=cwd, env=env, text=True, **kwargs)


def running(app):
    """An ASGI app (fbt-serve's) served by uvicorn on a free local port, in a thread of this
    process (`fbt_jax.serve.cli.running`); yields its base URL."""
    from fbt_jax.serve.cli import running as serving

    return serving(app)


def last_line(text: str) -> str:
    """The last non-empty line of a command's output (after a progress bar's carriage returns):
    where every fbt-* command reports its one-line error."""
    return [line for line in re.split(r"[\r\n]", text) if line.strip()][-1]


def wait_for(predicate, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError("condition not reached")


# --- what a run wrote ------------------------------------------------------------------------------------


def read_jsonl(workdir: str, name: str = "metrics.jsonl") -> list[dict]:
    """The rows of a run's metrics.jsonl (or another JSON-lines log in its workdir)."""
    with open(os.path.join(workdir, name)) as f:
        return [json.loads(line) for line in f]


def tear_last_line(path) -> str:
    """Append what a write cut short by a kill or a full disk leaves: the first half of a record,
    no newline. Returns the torn text."""
    with open(path, "a", encoding="utf-8") as f:
        torn = json.dumps({"step": 10**6, "loss": 0.123456789})[:17]
        f.write(torn)
    return torn


def losses(workdir):
    return {r["step"]: r["loss"] for r in read_jsonl(workdir)}


def tree_snapshot(directory):
    """Every file under `directory` with its bytes: to prove that nothing was touched."""
    return {
        os.path.relpath(p, directory): open(p, "rb").read()
        for p in glob.glob(f"{directory}/**", recursive=True)
        if os.path.isfile(p)
    }


def saved_state(directory):
    """All arrays of a checkpoint's train state, as numpy, in a fixed order."""
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(directory, "state")
    checkpointer = ocp.StandardCheckpointer()
    one_device = jax.sharding.make_single_device_sharding(jax.devices()[0])  # whatever topology saved it
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device), checkpointer.metadata(path).item_metadata
    )
    state = checkpointer.restore(path, target)
    return jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, state))[0]


def assert_same_state(dir_a, dir_b):
    a, b = saved_state(dir_a), saved_state(dir_b)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        assert np.array_equal(x, y), path  # bitwise


# --- text data ---------------------------------------------------------------------------------------------


def text_config(tmp_path, path, seq_len=32):
    """configs/tiny.py on text files (or prepared records) at `path`, byte-tokenised."""
    config = load_config("tiny")
    config.workdir = str(tmp_path / "run")
    config.data.source = "text"
    config.data.path = str(path)
    config.data.seq_len = seq_len
    config.data.validation_fraction = 0.2
    config.model.vocab_size = 257
    return config


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_corpus(directory, num_docs=60, seed=0):
    """Random word documents, the first half as lines of docs.jsonl, the rest as doc<i>.txt files."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    docs = [" ".join(rng.choice(WORDS, size=rng.integers(3, 60))) for _ in range(num_docs)]
    with open(os.path.join(directory, "docs.jsonl"), "w") as f:
        for doc in docs[: num_docs // 2]:
            f.write(json.dumps({"text": doc}) + "\n")
    for i, doc in enumerate(docs[num_docs // 2 :]):
        with open(os.path.join(directory, f"doc{i}.txt"), "w") as f:
            f.write(doc)
    return docs


def made_once(name: str, make) -> str:
    """`<shared dir>/name`, made by `make(path)` once per pytest run however many workers ask (a file
    lock; the others wait for it): for session fixtures that tests only read."""
    import fcntl

    root = os.environ["FBT_TEST_SHARED_DIR"]
    path = os.path.join(root, name)
    with open(os.path.join(root, f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if `make` fails
        if not os.path.exists(f"{path}.done"):
            shutil.rmtree(path, ignore_errors=True)  # a failed attempt's leftovers
            make(path)
            open(f"{path}.done", "w").close()
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """(directory, documents) of `write_corpus`; read only."""
    documents = write_corpus(tmp_path_factory.mktemp("corpus"))  # seeded: the shared directory's documents
    return pathlib.Path(made_once("corpus", write_corpus)), documents


@pytest.fixture(scope="session")
def prepared(corpus, tmp_path_factory):
    """(corpus directory, records directory, documents): the corpus prepared by fbt-prepare
    (seq_len 32, a fifth of the documents held out); read only."""
    directory, docs = corpus

    def make(out: str) -> None:
        result = run_command(
            ["fbt-prepare", f"--input={directory}/*", f"--output={out}", "--seq-len=32", "--validation-fraction=0.2"]
        )
        assert result.returncode == 0, result.stderr

    return directory, made_once("prepared-records", make), docs


# The run the resume tests interrupt (SIGKILL, SIGTERM under the supervisor, a kill in a bucket): K
# drawn from a mix, so that K changes around every interruption, and a checkpoint every 10 steps.
RESUME_STEPS, RESUME_EVERY = 120, 10
RESUME_ARGS = [
    "--config=configs/tiny.py",
    f"--config.train.steps={RESUME_STEPS}",
    "--config.train.log_every=1",
    "--config.optimizer.warmup_steps=5",
    "--config.passes.schedule=0:1=0.5,2=0.3,3=0.2",
    f"--config.checkpoint.every_steps={RESUME_EVERY}",
    "--config.checkpoint.max_to_keep=2",
    "--config.eval.num_batches=0",
]


@pytest.fixture(scope="session")
def resume_reference(tmp_path_factory):
    """RESUME_ARGS run uninterrupted on one device: what every interrupted run must end equal to."""
    return made_once(
        "resume-reference",
        lambda workdir: run_command(["fbt-train", *RESUME_ARGS, f"--config.workdir={workdir}"], cpu_env(1), check=True),
    )


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A tiny run trained by fbt-train for 40 steps (K up to 3), for fbt-eval and fbt-decode."""
    argv = [
        "fbt-train",
        "--config=configs/tiny.py",
        "--config.train.steps=40",
        "--config.optimizer.warmup_steps=4",
        "--config.eval.num_batches=0",
        "--config.passes.schedule=0:1;0.5:2=0.9,3=0.1",
    ]
    return made_once(
        "trained-run", lambda workdir: run_command([*argv, f"--config.workdir={workdir}"], cpu_env(1), check=True)
    )


HARNESS_TASKS = os.path.join(ROOT, "tests", "harness")  # tiny local lm-evaluation-harness tasks
HARNESS_STEPS = 40


@pytest.fixture(scope="session")
def text_run(prepared, tmp_path_factory):
    """A tiny byte-level text run (40 steps, K=2 from step 20) that ran the harness's tiny_mc and
    tiny_ppl in each mode at steps 20 and 40 (`eval.harness_tasks`), from the repository root as
    their relative data files ask."""
    workdir = str(tmp_path_factory.mktemp("harness") / "run")
    run_command(
        [
            "fbt-train",
            "--config=configs/tiny.py",
            f"--config.workdir={workdir}",
            "--config.data.source=text",
            f"--config.data.path={prepared[1]}",
            "--config.data.seq_len=32",
            "--config.model.vocab_size=257",
            f"--config.train.steps={HARNESS_STEPS}",
            "--config.optimizer.warmup_steps=4",
            "--config.eval.num_batches=0",
            "--config.passes.schedule=0:1;0.5:2",
            "--config.eval.contraction_passes=0",
            "--config.eval.harness_tasks=tiny_mc,tiny_ppl",
            f"--config.eval.harness_include={HARNESS_TASKS}",
            f"--config.eval.harness_every_steps={HARNESS_STEPS // 2}",
        ],
        cpu_env(1),
        check=True,
    )
    return workdir


# --- a subword tokenizer, trained here (no download) -----------------------------------------------------

BPE_SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<pad>"]


def train_bpe_tokenizer(directory) -> str:
    """A byte-level BPE tokenizer (about 1000 ids, BPE_SPECIALS first) trained on some 300 KB of the
    standard library's sources, saved as `directory`/tokenizer.json; returns that path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for root, _, files in sorted(os.walk(os.path.dirname(os.__file__))):
        for name in sorted(files):
            if name.endswith(".py") and size < 300_000:
                with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                    texts.append(f.read()[:20_000])
                size += len(texts[-1])
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so any text round-trips
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    path = os.path.join(str(directory), "tokenizer.json")
    tokenizer.save(path)
    return path


@pytest.fixture(scope="session")
def bpe_tokenizer_json(tmp_path_factory) -> str:
    """The path of a tokenizer.json trained by `train_bpe_tokenizer`; read only."""
    return train_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))
