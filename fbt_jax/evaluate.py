"""Evaluating a trained checkpoint the way the paper does (`fbt-eval`).

- Feedback-depth stability: loss after k passes for k up to 1000 and the per-pass change
  ‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖ (one compiled `fori_loop` over passes, no gradients). A model trained with
  some three-pass batches should settle to a fixed point; one trained on {1, 2} only may diverge.
- Teacher-forced sequential feedback (method §4) over long sequences, position by position, via
  the soft decoding path: loss and top-state norm along the sequence.
- Per-position accuracy on the built-in task in each decoding mode.
- Linear probes on every layer's output, without feedback (K = 1) and with one feedback pass.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fbt_jax import decode, paths
from fbt_jax.errors import ArgumentParser, ConfigError, divert_library_noise, reported
from fbt_jax.feedback import feedback_pass, last_pass_inputs
from fbt_jax.layers import attention_mask, default_positions
from fbt_jax.losses import mean_loss, readout_nll, token_nll_BT


def depth_sweep(model: Any, batch: dict[str, np.ndarray], max_depth: int, fuse_from: int = 1) -> dict[str, np.ndarray]:
    """Loss and relative state change after each of passes 1 … max_depth (one compile)."""
    tokens = jnp.asarray(batch["inputs"])
    targets, weights = jnp.asarray(batch["targets"]), jnp.asarray(batch["weights"])
    # Packed text carries per-document positions and segment ids: attention and feedback stay
    # inside each document (fusion starts at `fuse_from` within every document).
    positions = jnp.asarray(batch["positions"]) if "positions" in batch else default_positions(tokens.shape)
    segments = jnp.asarray(batch["segment_ids"]) if "segment_ids" in batch else None
    fuse_from_B = jnp.full((tokens.shape[0],), fuse_from, jnp.int32)

    @jax.jit
    def run() -> tuple[jax.Array, jax.Array]:
        e = model.embed(tokens)
        h0 = model.stack(e, positions, segments)

        def body(k: jax.Array, carry: tuple) -> tuple:
            h, losses, changes = carry
            h_next = feedback_pass(model, e, h, fuse_from_B, positions, segments)
            loss = mean_loss(*readout_nll(model, h_next, targets, weights))
            change = jnp.linalg.norm((h_next - h).astype(jnp.float32)) / jnp.linalg.norm(h_next.astype(jnp.float32))
            return h_next, losses.at[k].set(loss), changes.at[k].set(change)

        losses = jnp.zeros(max_depth).at[0].set(mean_loss(*readout_nll(model, h0, targets, weights)))
        changes = jnp.zeros(max_depth).at[0].set(jnp.nan)
        _, losses, changes = jax.lax.fori_loop(1, max_depth, body, (h0, losses, changes))
        return losses, changes

    losses, changes = jax.device_get(run())
    return {"loss": np.asarray(losses), "change": np.asarray(changes)}


def sequential_profile(model: Any, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Teacher-forced latent feedback from position 1: loss and ‖h_t‖ at every position."""
    tokens = jnp.asarray(batch["inputs"])
    B, T = tokens.shape
    state = decode.prefill(model, tokens[:, :1], jnp.ones((B,), jnp.int32), T, "soft")

    def body(state: decode.DecodeState, token_B: jax.Array) -> tuple:
        return decode.step(model, state, token_B, "soft"), (state.logits_BV, state.h_last_BD)

    _, (logits_TBV, h_TBD) = jax.jit(lambda s: jax.lax.scan(body, s, tokens[:, 1:].T))(state)
    logits_BTV = jnp.swapaxes(logits_TBV, 0, 1)
    h_BTD = jnp.swapaxes(h_TBD, 0, 1)
    targets = jnp.asarray(batch["targets"])[:, : T - 1]
    weights = jnp.asarray(batch["weights"])[:, : T - 1]
    loss_T = mean_loss(jnp.sum(token_nll_BT(logits_BTV, targets, weights), 0), jnp.sum(weights, 0))
    norm_T = jnp.mean(jnp.linalg.norm(h_BTD.astype(jnp.float32), axis=-1), 0)
    return {"loss": np.asarray(loss_T), "state_norm": np.asarray(norm_T)}


def mode_accuracy(model: Any, batch: dict[str, np.ndarray], prompt_len: int) -> dict[str, float]:
    """Accuracy of the argmax prediction at positions ≥ prompt_len when the inputs are fed through
    each decoding mode (the task's inputs are given; the model predicts each position's label)."""
    tokens = jnp.asarray(batch["inputs"])
    B, T = tokens.shape
    out = {}
    for mode in decode.MODES:
        state = decode.prefill(model, tokens[:, :prompt_len], jnp.full((B,), prompt_len), T, mode)

        def body(state: decode.DecodeState, token_B: jax.Array, mode: str = mode) -> tuple:
            return decode.step(model, state, token_B, mode), jnp.argmax(state.logits_BV, -1)

        _, predictions_TB = jax.jit(lambda s, body=body: jax.lax.scan(body, s, tokens[:, prompt_len:].T))(state)
        # The prediction made at position t − 1 is for position t − 1's label.
        predicted = np.asarray(predictions_TB.T)  # labels of positions prompt_len − 1 … T − 2
        labels = np.asarray(batch["targets"])[:, prompt_len - 1 : T - 1]
        weights = np.asarray(batch["weights"])[:, prompt_len - 1 : T - 1]
        out[mode] = float(np.sum((predicted == labels) * weights) / max(np.sum(weights), 1))
    return out


def layer_features(model: Any, tokens: jax.Array, num_passes: int) -> list[np.ndarray]:
    """Each block's output (layer 0 … L−1) in the last of `num_passes` passes, fully fused."""
    if model.cfg.scan_layers:
        raise ConfigError("layer probes need an unscanned model (model.scan_layers=False)")
    positions = default_positions(tokens.shape)
    fully_fused = jnp.ones(tokens.shape[0], jnp.int32)
    _, u = last_pass_inputs(model, model.embed(tokens), fully_fused, num_passes, positions)
    mask = attention_mask(positions, None)
    x = u.astype(model.compute_dtype)
    outputs = []
    for block in model.blocks:
        x = block(x, positions, mask)
        outputs.append(np.asarray(x, np.float32))
    return outputs


def linear_probe(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, steps: int = 300
) -> float:
    """Held-out accuracy of a multinomial logistic regression (standardised features, Adam)."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    xtr, xte = jnp.asarray((train_x - mean) / std), jnp.asarray((test_x - mean) / std)
    classes = int(max(train_y.max(), test_y.max())) + 1
    params = {"w": jnp.zeros((xtr.shape[1], classes)), "b": jnp.zeros(classes)}
    tx = optax.adam(0.05)

    def loss_fn(p: dict) -> jax.Array:
        logits = xtr @ p["w"] + p["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(train_y)).mean() + 1e-4 * jnp.sum(
            p["w"] ** 2
        )

    @jax.jit
    def fit(params: dict) -> dict:
        def body(_: Any, carry: tuple) -> tuple:
            params, opt = carry
            grads = jax.grad(loss_fn)(params)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt

        return jax.lax.fori_loop(0, steps, body, (params, tx.init(params)))[0]

    params = fit(params)
    predictions = np.asarray(jnp.argmax(xte @ params["w"] + params["b"], -1))
    return float(np.mean(predictions == test_y))


def probes(model: Any, train: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per-layer probe accuracy for the label at every scored position, K = 1 and K = 2."""
    result: dict[str, Any] = {}
    tr_mask, te_mask = train["weights"] > 0, test["weights"] > 0
    counts = np.bincount(test["targets"][te_mask])
    result["chance"] = float(counts.max() / counts.sum())
    for k in (1, 2):
        tr_layers = layer_features(model, jnp.asarray(train["inputs"]), k)
        te_layers = layer_features(model, jnp.asarray(test["inputs"]), k)
        result[f"K{k}"] = [
            linear_probe(a[tr_mask], train["targets"][tr_mask], b[te_mask], test["targets"][te_mask])
            for a, b in zip(tr_layers, te_layers)
        ]
    return result


def write_plots(report: dict[str, Any], output: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    depth = report["depth"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ks = np.arange(1, len(depth["loss"]) + 1)
    axes[0].semilogx(ks, depth["loss"])
    axes[0].set(xlabel="feedback depth k (passes)", ylabel="validation loss", title="loss vs depth")
    axes[1].loglog(ks[1:], np.maximum(depth["change"][1:], 1e-12))
    axes[1].set(xlabel="k", ylabel="‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖", title="per-pass change")
    fig.tight_layout()
    paths.append(os.path.join(output, "depth.png"))
    fig.savefig(paths[-1])
    plt.close(fig)
    seq = report["sequential"]
    if "skipped" in seq:
        return paths
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(seq["loss"])
    axes[0].set(xlabel="position", ylabel="loss", title="teacher-forced sequential feedback")
    axes[1].plot(seq["state_norm"])
    axes[1].set(xlabel="position", ylabel="mean ‖h_t‖", title="top-state norm")
    fig.tight_layout()
    paths.append(os.path.join(output, "sequential.png"))
    fig.savefig(paths[-1])
    plt.close(fig)
    if "probes" in report:
        fig, ax = plt.subplots(figsize=(5, 4))
        for k in ("K1", "K2"):
            ax.plot(report["probes"][k], marker="o", label=k)
        ax.axhline(report["probes"]["chance"], color="gray", linestyle="--", label="chance")
        ax.set(xlabel="layer", ylabel="probe accuracy", title="linear probes")
        ax.legend()
        fig.tight_layout()
        paths.append(os.path.join(output, "probes.png"))
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def evaluate(checkpoint_path: str, output: str, depths: int, seq_len: int, batch_size: int, log: Any = print) -> dict:
    from fbt_jax.data.pipeline import make_source
    from fbt_jax.trained import load_model

    model, config = load_model(checkpoint_path, log)
    if config.data.source == "task":
        config.data.seq_len = seq_len or config.data.seq_len  # default: the length the run trained on
    elif seq_len:
        log(f"prepared text keeps its records' length {config.data.seq_len} (--seq-len applies to built-in tasks)")
    # From pass T on the states are the exact recurrence, so the default stops at T + 1 (the last
    # change ~0 confirms it); up to 2T shows it settle, further would only repeat the same states.
    seq_len = config.data.seq_len
    depths = depths or seq_len + 1
    if depths > 2 * seq_len:
        raise ConfigError(
            f"--max-depth={depths} exceeds twice the evaluation length {seq_len}: from pass {seq_len} on the states "
            f"are exact and stop changing; use --max-depth <= {2 * seq_len} or a longer --seq-len"
        )
    source = make_source(config, "validation")
    if len(source) < batch_size:
        log(f"the validation split has {len(source)} examples; evaluating on all of them")
        batch_size = len(source)
    rows = np.arange(batch_size)
    batch = source.examples(rows)
    report: dict[str, Any] = {"checkpoint": checkpoint_path, "data": config.data.to_dict()}
    sweep = depth_sweep(model, batch, depths)
    report["depth"] = {"loss": sweep["loss"].tolist(), "change": sweep["change"].tolist()}
    if getattr(source, "packed", False):
        # The cached decode path runs one document per row; packed rows hold several.
        report["sequential"] = {"skipped": "packed text: the sequential profile needs one document per row"}
    else:
        report["sequential"] = {k: v.tolist() for k, v in sequential_profile(model, batch).items()}
    if config.data.source == "task":
        report["mode_accuracy"] = mode_accuracy(model, batch, prompt_len=max(1, config.data.seq_len // 4))
        if config.data.task in ("word_problem", "delayed_recall") and not model.cfg.scan_layers:
            train = make_source(config, "train").examples(rows)
            report["probes"] = probes(model, train, batch)
    os.makedirs(output, exist_ok=True)
    report["plots"] = write_plots(report, output)
    with open(os.path.join(output, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv: list[str] | None = None) -> None:
    """`fbt-eval`: evaluate a trained run (depth stability, sequential feedback, modes, probes)."""

    parser = ArgumentParser(prog="fbt-eval", description=main.__doc__)
    parser.add_argument("--checkpoint", required=True, help="a run's workdir or checkpoint directory")
    parser.add_argument("--output", required=True, help="directory for report.json and the plots")
    parser.add_argument(
        "--max-depth", type=int, default=0, help="largest number of passes k (default: evaluation length + 1)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=0, help="evaluation length for built-in tasks (default: the trained length)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    with reported("fbt-eval"):
        args = parser.parse_args(argv)
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size={args.batch_size} must be at least 1")
        if args.max_depth < 0:
            raise ConfigError(
                f"--max-depth={args.max_depth} is negative; use at least 1, or 0 for the evaluation length + 1"
            )
        if args.seq_len < 0 or 0 < args.seq_len < 4:
            raise ConfigError(f"--seq-len={args.seq_len} is too short; use at least 4, or 0 for the trained length")
        output = paths.resolve(args.output, "--output")
        paths.check_output_dir(output, "--output")
        checkpoint_path = paths.resolve(args.checkpoint, "--checkpoint")
        if not paths.is_url(output):
            # The storage libraries' tracebacks from their threads when a checkpoint does not
            # restore go to this log; the failure itself is reported as one line.
            divert_library_noise(os.path.join(output, "fbt-eval.log"))
        report = evaluate(checkpoint_path, output, args.max_depth, args.seq_len, args.batch_size)
    depth = report["depth"]
    print(
        f"loss at depth 1 / {len(depth['loss'])}: {depth['loss'][0]:.4f} / {depth['loss'][-1]:.4f}; "
        f"last per-pass change {depth['change'][-1]:.2e}"
    )
    if "mode_accuracy" in report:
        print("accuracy per mode: " + ", ".join(f"{m} {a:.3f}" for m, a in report["mode_accuracy"].items()))
    if "probes" in report:
        p = report["probes"]
        print(f"layer-0 probe: K=1 {p['K1'][0]:.3f}, K=2 {p['K2'][0]:.3f} (chance {p['chance']:.3f})")
    print(f"wrote {os.path.join(output, 'report.json')} and {len(report['plots'])} plots")


if __name__ == "__main__":
    main()
