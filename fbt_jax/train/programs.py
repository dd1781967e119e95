"""The compiled programs of a run, and the static layout they are compiled for.

`TrainPrograms` turns a validated config and a device list into the mesh, the shardings of the
train state and of a batch, and the abstract (shape-only) train state; `compile()` then compiles
the train step of every pass count K the schedule can draw, and the eval step, ahead of time,
reporting each program's compile time and per-device memory. Nothing is allocated: the training
loop and the dry run share this, and only the loop then creates a state.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from fbt_jax import attention, contraction, sharding
from fbt_jax.model import ModelConfig, abstract_model, build_model
from fbt_jax.run_services import CACHE_HITS
from fbt_jax.schedule import PassSchedule
from fbt_jax.train.program_facts import out_of_memory
from fbt_jax.train.step import (
    TrainState,
    contraction_step,
    eval_step,
    make_optimizer,
    optimizer_with,
    step_constants,
    step_settings,
    train_step,
)


class TrainPrograms:
    """Mesh, shardings, abstract state and the compiled train (per K) and eval programs."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        schedule: PassSchedule,
        devices: list,
        packed: bool,
        log: Any = print,
        chat: bool = False,
    ):
        self.config, self.schedule, self.packed, self.log = config, schedule, packed, log
        self.chat = chat  # batches carry a per-token fuse mask (chat data: conversations.py)
        self.rules = sharding.parse_rules(config.sharding.rules)
        self.mesh = sharding.make_mesh(config.mesh, devices)
        self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
        self.model_cfg = ModelConfig.from_config(config.model)
        self.tx, self.lr_schedule = make_optimizer(config)
        self.step_constants = step_constants(config)  # the train step's third argument
        self.layout = sharding.activation_layout(self.mesh, self.rules)
        cfg = self.model_cfg  # which attention runs (a ConfigError naming one that can, if it cannot)
        platform, head_dim = self.mesh.devices.flat[0].platform, cfg.head_size
        self.log(
            attention.describe(cfg.attention_impl, platform, cfg.compute_dtype, packed, cfg.sliding_window, head_dim)
        )
        slow = attention.interpret_warning(cfg.attention_impl, platform)  # a Pallas kernel emulated here
        if slow:
            self.log(slow)
        self.graphdef = nnx.split(abstract_model(self.model_cfg, self.layout), nnx.Param)[0]
        self.abstract_state = jax.eval_shape(self._initial_state)
        self.state_shardings = self._state_shardings()
        # The dry run's: a program the compiler refuses for lack of memory is reported and the
        # next one compiled (name → the compiler's one line); a run raises instead.
        self.keep_going_out_of_memory = False
        self.refused: dict[str, str] = {}
        self.train: dict[int, Any] = {}  # K → compiled train step
        self.eval: Any = None  # compiled eval step (every K up to max(eval.num_passes)), if evaluating
        self.contraction: Any = None  # compiled contraction monitor on one held-out batch, if on
        e = config.eval
        # The passes the contraction monitor measures: just beyond the largest K trained.
        self.monitored = (
            contraction.monitored_passes(max(schedule.pass_counts), e.contraction_passes)
            if e.contraction_passes
            else None
        )

    def _initial_state(self) -> TrainState:
        model = build_model(self.model_cfg, self.config.seed, self.layout)
        params = nnx.state(model, nnx.Param)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

    def _state_shardings(self) -> TrainState:
        params = sharding.param_shardings(self.abstract_state.params, self.mesh, self.rules)
        replicated = sharding.replicated(self.mesh)
        opt_state = optax.tree_map_params(
            self.tx,
            lambda _, param_sharding: param_sharding,
            self.abstract_state.opt_state,
            params,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        return TrainState(step=replicated, params=params, opt_state=opt_state)

    def init_state(self) -> TrainState:
        """A fresh train state, each device creating only its own shards (never whole on one)."""
        return jax.jit(self._initial_state, out_shardings=self.state_shardings)()

    def sharded_abstract_state(self) -> TrainState:
        """The train state's shapes and dtypes with the shardings this run places it with
        (what a checkpoint restores onto, and what programs are compiled for)."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.abstract_state, self.state_shardings
        )

    def abstract_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (batch_size, self.config.data.seq_len)
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
        if self.packed:
            dtypes |= {"segment_ids": jnp.int32, "positions": jnp.int32}
        if self.chat:
            dtypes |= {"fuse": jnp.int32}
        return {k: jax.ShapeDtypeStruct(shape, dt, sharding=self.batch_sharding) for k, dt in dtypes.items()}

    def compile(self, pass_counts: tuple[int, ...] | None = None) -> dict[str, dict[str, float]]:
        """Compile the train program of every K in `pass_counts` (default: every K the schedule can
        draw), and the eval program.

        Returns per program its compile time and, where the backend reports it, the per-device
        memory of the compiled program.
        """
        report: dict[str, dict[str, float]] = {}
        abstract_state = self.sharded_abstract_state()
        replicated = sharding.replicated(self.mesh)
        settings = step_settings(self.config)
        constants = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.step_constants)
        for k in self.schedule.pass_counts if pass_counts is None else pass_counts:
            step_fn = functools.partial(
                train_step,
                graphdef=self.graphdef,
                make_tx=functools.partial(optimizer_with, self.config),
                settings=settings,
                num_passes=k,
            )
            jitted = jax.jit(
                step_fn,
                in_shardings=(self.state_shardings, self.batch_sharding, replicated),
                out_shardings=(self.state_shardings, replicated),
                donate_argnums=0,
            )
            batch = self.abstract_batch(self.config.train.batch_size)
            compiled, report[f"train_K{k}"] = self._compile(f"train_K{k}", jitted, abstract_state, batch, constants)
            self.train[k] = None if compiled is None else TrainProgram(compiled, self.step_constants, replicated)
            self.log(f"compiled train step K={k}: {describe(report[f'train_K{k}'], self.refused.get(f'train_K{k}'))}")
        e = self.config.eval
        if e.num_batches > 0:
            eval_fn = functools.partial(
                eval_step,
                graphdef=self.graphdef,
                num_passes=max(e.num_passes),
                fuse_from=e.fuse_from,
                monitored=self.monitored,
            )
            jitted = jax.jit(
                eval_fn, in_shardings=(self.state_shardings.params, self.batch_sharding), out_shardings=replicated
            )
            batch = self.abstract_batch(e.batch_size)
            self.eval, report["eval"] = self._compile("eval", jitted, abstract_state.params, batch)
            self.log(
                f"compiled eval (K up to {max(e.num_passes)}): {describe(report['eval'], self.refused.get('eval'))}"
            )
        if self.monitored and e.contraction_every_steps > 0:
            monitor_fn = functools.partial(
                contraction_step, graphdef=self.graphdef, fuse_from=e.fuse_from, monitored=self.monitored
            )
            jitted = jax.jit(
                monitor_fn, in_shardings=(self.state_shardings.params, self.batch_sharding), out_shardings=replicated
            )
            batch = self.abstract_batch(e.batch_size)
            self.contraction, report["contraction"] = self._compile("contraction", jitted, abstract_state.params, batch)
            first, last = self.monitored
            refused = self.refused.get("contraction")
            self.log(
                f"compiled contraction monitor (passes {first}–{last}): {describe(report['contraction'], refused)}"
            )
        return report

    def _compile(self, name: str, jitted: Any, *abstract_args: Any) -> tuple[Any, dict[str, float]]:
        start = time.perf_counter()
        try:
            return compile_aot(jitted, *abstract_args)
        except Exception as e:
            refusal = out_of_memory(e) if self.keep_going_out_of_memory else None
            if refusal is None:
                raise
            self.refused[name] = refusal[0]
            return None, {"compile_seconds": time.perf_counter() - start, "cache_hit": 0.0, "required_gib": refusal[1]}


class TrainProgram:
    """A compiled train step with its run's constants (step.step_constants) bound: `program(state, batch)`.
    Everything else (`as_text()`, `memory_analysis()`, ...) is the compiled program's."""

    def __init__(self, compiled: Any, constants: dict[str, Any], sharding: jax.sharding.Sharding):
        self.compiled, self._constants, self._sharding = compiled, constants, sharding
        self._placed: Any = None  # on the devices at the first step (a dry run's devices hold nothing)

    def __call__(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        if self._placed is None:
            self._placed = jax.device_put(self._constants, self._sharding)
        return self.compiled(state, batch, self._placed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def compile_aot(jitted: Any, *abstract_args: Any) -> tuple[Any, dict[str, float]]:
    """Lower and compile `jitted` for abstract arguments; the compiled program and its report."""
    hits = CACHE_HITS.count
    start = time.perf_counter()
    compiled = jitted.lower(*abstract_args).compile()
    # The time actually spent: a program loaded from the persistent cache reports its load time.
    report = {"compile_seconds": time.perf_counter() - start, "cache_hit": float(CACHE_HITS.count > hits)}
    memory = compiled.memory_analysis()
    if memory is not None:
        report["device_bytes"] = float(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
        report["temp_bytes"] = float(memory.temp_size_in_bytes)
    return compiled, report


def describe(report: dict[str, float], refused: str | None = None) -> str:
    if refused is not None:
        return f"does not fit (refused in {report['compile_seconds']:.1f}s): {refused}"
    text = f"compiled in {report['compile_seconds']:.1f}s"
    if report.get("cache_hit"):
        text += " (loaded from the compilation cache)"
    if "device_bytes" in report:
        text += f", per-device memory {report['device_bytes'] / 2**20:,.1f} MiB (temporaries {report['temp_bytes'] / 2**20:,.1f} MiB)"
    return text
