"""The `fbt-train` command end to end, the train step's determinism and the optimizer."""

import dataclasses
import glob
import json
import os
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_config import ROOT, load_config

from fbt_jax.model import ModelConfig, build_model
from fbt_jax.train.step import make_optimizer
from fbt_jax.train.trainer import Trainer

REQUIRED_KEYS = {"step", "loss", "num_passes", "grad_norm", "learning_rate", "tokens_per_second", "loss_pass_1"}


def read_event_scalars(directory):
    """Scalars from TensorBoard event files (TFRecord framing around Event protos)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run") / "tiny")
    fbt_train = shutil.which("fbt-train")
    command = [fbt_train] if fbt_train else [sys.executable, "-m", "fbt_jax.train"]
    result = subprocess.run(
        command
        + [
            "--config=configs/tiny.py",
            f"--config.workdir={workdir}",
            "--config.train.steps=150",
            "--config.train.log_every=4",
            "--config.optimizer.warmup_steps=4",
            "--config.eval.num_batches=2",
            "--config.eval.every_steps=75",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


def test_cli_writes_metrics_with_every_required_key(cli_run):
    workdir, result = cli_run
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [*range(4, 150, 4), 150]
    for row in rows:
        assert REQUIRED_KEYS <= row.keys()
        assert {f"loss_pass_{k}" for k in range(1, row["num_passes"] + 1)} <= row.keys()
        assert "loss_pass_4" not in row  # the schedule never draws K > 3
        assert 1 <= row["mean_num_passes"] <= 3
        assert np.isfinite(row["loss"]) and row["tokens_per_second"] > 0
    assert {r["num_passes"] for r in rows[-3:]} & {2, 3}  # the late feedback phase ran
    for line in ("compiled train step K=1", "compiled train step K=2", "compiled train step K=3"):
        assert line in result.stdout
    assert f"outputs in {workdir}" in result.stdout


def test_cli_loss_goes_down_on_the_builtin_task(cli_run):
    workdir, _ = cli_run
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    first, last = rows[0]["loss"], np.mean([r["loss_pass_1"] for r in rows[-3:]])
    chance = np.log(6)  # S3 has 6 elements
    assert last < first - 0.5 and last < chance - 0.1, (first, last, chance)
    evals = [json.loads(line) for line in open(os.path.join(workdir, "eval.jsonl"))]
    assert evals[-1]["accuracy_K1"] > 1 / 6 + 0.05  # learned something beyond chance on held-out data


def test_cli_writes_eval_and_tensorboard(cli_run):
    workdir, result = cli_run
    evals = [json.loads(line) for line in open(os.path.join(workdir, "eval.jsonl"))]
    assert [e["step"] for e in evals] == [75, 150]
    assert {"loss_K1", "loss_K2", "loss_K3", "accuracy_K3"} <= evals[-1].keys()
    assert "K=3: loss" in result.stdout
    scalars = read_event_scalars(os.path.join(workdir, "tensorboard"))
    assert [step for step, _ in scalars["loss"]] == [*range(4, 150, 4), 150]
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert np.allclose([v for _, v in scalars["loss"]], [r["loss"] for r in rows], rtol=1e-6)
    eval_scalars = scalars
    assert "eval/loss_K2" in eval_scalars


def small_run_config(tmp_path, name):
    config = load_config("tiny")
    config.workdir = str(tmp_path / name)
    config.train.steps = 6
    config.train.log_every = 1
    config.optimizer.warmup_steps = 1
    config.passes.schedule = "0:2"  # one compiled program; feedback, noise and prefix mix-in all active
    config.eval.num_batches = 0
    return config


def test_training_is_reproducible(tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = Trainer(small_run_config(tmp_path, name), log=lambda *_: None)
        trainer.train(progress=False)
        runs.append(
            (trainer.state.params, [json.loads(x) for x in open(os.path.join(tmp_path, name, "metrics.jsonl"))])
        )
    (params_a, rows_a), (params_b, rows_b) = runs
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)))


def test_a_second_run_keeps_the_first_runs_logs(tmp_path):
    config = small_run_config(tmp_path, "same")
    config.train.steps = 2
    config.checkpoint.every_steps = 0  # no checkpoint to resume from: the second run starts afresh
    for _ in range(2):
        Trainer(config, log=lambda *_: None).train(progress=False)
    kept = glob.glob(os.path.join(config.workdir, "previous-*-metrics.jsonl"))
    assert len(kept) == 1 and len(open(kept[0]).readlines()) == 2
    assert len(open(os.path.join(config.workdir, "metrics.jsonl")).readlines()) == 2


def test_learning_rate_warms_up_then_decays_and_fusion_is_not_decayed():
    config = load_config("tiny")
    config.optimizer.warmup_steps = 2
    tx, lr = make_optimizer(config)
    o = config.optimizer
    assert float(lr(0)) == 0.0
    assert float(lr(o.warmup_steps)) == pytest.approx(o.learning_rate)
    assert float(lr(config.train.steps)) == pytest.approx(o.learning_rate * o.min_learning_rate_ratio)
    _, params = nnx.split(build_model(ModelConfig.from_config(config.model), seed=0), nnx.Param)
    zero_grads = jax.tree.map(np.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    # With zero gradients only weight decay moves parameters: matrices yes, fusion and norms no.
    assert np.abs(updates["blocks"][0]["mlp"]["up_DF"][...]).max() == 0.0  # lr(0) = 0 at step 0
    state = tx.init(params)
    for _ in range(o.warmup_steps + 1):
        updates, state = tx.update(zero_grads, state, params)
    assert np.abs(updates["blocks"][0]["mlp"]["up_DF"][...]).max() > 0
    assert np.abs(updates["fusion"]["state_proj_DD"][...]).max() == 0.0
    assert np.abs(updates["final_norm"]["scale"][...]).max() == 0.0


def test_divergence_stops_with_a_clear_error(tmp_path):
    config = small_run_config(tmp_path, "diverge")
    config.optimizer.learning_rate = 1e38
    config.optimizer.grad_clip_norm = 0.0
    with pytest.raises(FloatingPointError, match="(loss nan|gradient norm nan) at step [0-9]+ \\(K=2\\)"):
        Trainer(config, log=lambda *_: None).train(progress=False)
    assert os.path.exists(os.path.join(config.workdir, "metrics.jsonl"))


def test_train_step_applies_noise_and_prefix_mixin_and_eval_is_deterministic(tmp_path):
    import functools

    from fbt_jax.feedback import kpass_forward
    from fbt_jax.train.step import eval_step, step_settings, train_step

    config = small_run_config(tmp_path, "step")
    config.passes.prefix_mixin_prob = 1.0
    config.passes.fuse_from_min, config.passes.fuse_from_max = 5, 7
    trainer = Trainer(config, log=lambda *_: None, devices=jax.devices()[:1])
    trainer.init_state()
    batch = trainer.batch("train", 0, config.train.batch_size)

    def run(settings):
        step = functools.partial(
            train_step,
            graphdef=trainer.programs.graphdef,
            tx=trainer.programs.tx,
            lr_schedule=trainer.programs.lr_schedule,
            num_passes=2,
        )
        return jax.jit(step, static_argnames="settings")(trainer.state, batch, settings=settings)[1]

    base = step_settings(config)
    with_noise, again = run(base), run(base)
    without_noise = run(dataclasses.replace(base, pass_options=dataclasses.replace(base.pass_options, noise_std=0.0)))
    assert float(with_noise["loss_pass_2"]) == float(again["loss_pass_2"])  # keyed by (seed, step)
    assert float(with_noise["loss_pass_2"]) != float(without_noise["loss_pass_2"])
    assert float(with_noise["loss_pass_1"]) == float(without_noise["loss_pass_1"])
    fully_fused = run(dataclasses.replace(base, prefix_mixin_prob=0.0))
    assert float(fully_fused["mean_fuse_from"]) == 1.0
    assert 5.0 <= float(with_noise["mean_fuse_from"]) <= 7.0

    # Eval: no noise, fuse-from = eval.fuse_from, pass k of the program = a k-pass forward.
    out = jax.jit(functools.partial(eval_step, graphdef=trainer.programs.graphdef, num_passes=3, fuse_from=4))(
        trainer.state.params, batch
    )
    model = nnx.merge(trainer.programs.graphdef, trainer.state.params)
    states = kpass_forward(model, batch["inputs"], jnp.full((config.train.batch_size,), 4), 3)
    for k, h in enumerate(states, start=1):
        from fbt_jax.losses import token_nll

        nll, _ = token_nll(model.logits(h), batch["targets"], batch["weights"])
        assert float(out[f"nll_{k}"]) == pytest.approx(float(nll), rel=1e-5)


def test_interval_metrics_average_each_pass_over_the_steps_that_ran_it():
    from fbt_jax.train.loop import interval_metrics

    pending = [
        (1, {"loss": 2.0, "loss_pass_1": 2.0, "learning_rate": 0.1, "grad_norm": 1.0}),
        (2, {"loss": 3.0, "loss_pass_1": 4.0, "loss_pass_2": 2.0, "learning_rate": 0.2, "grad_norm": 3.0}),
    ]
    out = interval_metrics(pending)
    assert out == {
        "loss": 2.5,
        "loss_pass_1": 3.0,
        "loss_pass_2": 2.0,
        "learning_rate": 0.2,
        "grad_norm": 2.0,
        "num_passes": 2,
        "mean_num_passes": 1.5,
    }
