"""Evaluating a trained checkpoint the way the paper does (`fbt-eval`).

- Feedback-depth stability: loss after k passes and the per-pass change ‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖ over
  the positions pass k can still change (one compiled chunk of passes, repeated under a progress
  bar; no gradients), and the contraction monitor's verdict for the passes just beyond the
  trained K (`contraction.py`). A model trained with some three-pass batches should settle to a
  fixed point; one trained on {1, 2} only may not.
- Teacher-forced sequential feedback (method §4) over long sequences, position by position, via
  the soft decoding path: loss and top-state norm along the sequence.
- Per-position accuracy and loss on the built-in task in each decoding mode.
- Linear probes (`probes.py`) on every layer's output and on the first layer position by position,
  without feedback, with one feedback pass, and with the exact recurrence.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fbt_jax import contraction, decode
from fbt_jax import progress as shown_progress
from fbt_jax.data.tasks import prompt_length
from fbt_jax.errors import ConfigError
from fbt_jax.feedback import feedback_pass
from fbt_jax.layers import default_positions
from fbt_jax.losses import mean_loss, readout_nll, token_nll_BT
from fbt_jax.probes import probes, probes_by_position


def depth_sweep(
    model: Any, batch: dict[str, np.ndarray], max_depth: int, fuse_from: int = 1, progress: bool = False
) -> dict[str, np.ndarray]:
    """Loss after each of passes 1 … max_depth, and each pass's change (`change`, relative, over
    the positions it can still change; 0 once none can) with its sums (`change_sq`, `state_sq`,
    as `contraction.summarize` takes them). Passes run in compiled chunks of up to 32."""
    tokens = jnp.asarray(batch["inputs"])
    targets, weights = jnp.asarray(batch["targets"]), jnp.asarray(batch["weights"])
    # Packed text carries per-document positions and segment ids: attention and feedback stay
    # inside each document (fusion starts at `fuse_from` within every document).
    positions = jnp.asarray(batch["positions"]) if "positions" in batch else default_positions(tokens.shape)
    segments = jnp.asarray(batch["segment_ids"]) if "segment_ids" in batch else None
    fuse_from_B = jnp.full((tokens.shape[0],), fuse_from, jnp.int32)
    e = model.embed(tokens)
    chunk = min(32, max(max_depth - 1, 1))

    @jax.jit
    def passes(h: jax.Array, first: jax.Array) -> tuple:
        """Passes first … first + chunk − 1 from H^(first − 1): the last H, and per pass its
        loss and change sums."""

        def body(h: jax.Array, k: jax.Array) -> tuple:
            h_next = feedback_pass(model, e, h, fuse_from_B, positions, segments)
            loss = mean_loss(*readout_nll(model, h_next, targets, weights))
            return h_next, (loss, *contraction.change_sums(h_next, h, k, fuse_from_B, positions))

        return jax.lax.scan(body, h, first + jnp.arange(chunk))

    h = jax.jit(lambda: model.stack(e, positions, segments))()
    losses = [float(mean_loss(*readout_nll(model, h, targets, weights)))]
    change_sq, state_sq = [np.nan], [np.nan]
    with shown_progress.shown(max_depth, progress, initial=1, unit="pass") as bar:
        while len(losses) < max_depth:
            h, (loss, c_sq, s_sq) = passes(h, jnp.int32(len(losses) + 1))
            take = min(chunk, max_depth - len(losses))
            losses += np.asarray(loss)[:take].tolist()
            change_sq += np.asarray(c_sq)[:take].tolist()
            state_sq += np.asarray(s_sq)[:take].tolist()
            bar.update(take)
    change_sq, state_sq = np.asarray(change_sq), np.asarray(state_sq)
    change = np.where(state_sq > 0, np.sqrt(change_sq / np.maximum(state_sq, 1e-30)), 0.0)
    change[0] = np.nan
    return {"loss": np.asarray(losses), "change": change, "change_sq": change_sq, "state_sq": state_sq}


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


def mode_metrics(model: Any, batch: dict[str, np.ndarray], prompt_len: int) -> dict[str, dict[str, float]]:
    """Accuracy of the argmax prediction and mean loss at positions ≥ prompt_len when the inputs
    are fed through each decoding mode (the task's inputs are given; the model predicts each
    position's label)."""
    tokens = jnp.asarray(batch["inputs"])
    B, T = tokens.shape
    # The prediction made at position t − 1 is for position t − 1's label.
    labels = jnp.asarray(batch["targets"])[:, prompt_len - 1 : T - 1]
    weights = jnp.asarray(batch["weights"])[:, prompt_len - 1 : T - 1]
    out = {}
    for mode in decode.MODES:
        state = decode.prefill(model, tokens[:, :prompt_len], jnp.full((B,), prompt_len), T, mode)

        def body(state: decode.DecodeState, token_B: jax.Array, mode: str = mode) -> tuple:
            return decode.step(model, state, token_B, mode), state.logits_BV

        _, logits_TBV = jax.jit(lambda s, body=body: jax.lax.scan(body, s, tokens[:, prompt_len:].T))(state)
        logits_BTV = jnp.swapaxes(logits_TBV, 0, 1)
        correct = jnp.sum((jnp.argmax(logits_BTV, -1) == labels) * weights)
        total = jnp.maximum(jnp.sum(weights), 1.0)
        loss = jnp.sum(token_nll_BT(logits_BTV.astype(jnp.float32), labels, weights))
        out[mode] = {"accuracy": float(correct / total), "loss": float(loss / total)}
    return out


def text_samples(model: Any, batch: dict[str, np.ndarray], tokenizer: Any, rows: int = 2) -> list[dict[str, str]]:
    """Greedy continuations of the first documents of `batch` in every decoding mode, as text: the
    first half of each row's first document is the prompt, the rest its reference."""
    out = []
    first_B = batch["segment_ids"][:rows] == batch["segment_ids"][:rows, :1]
    length = max(2, int(first_B.sum(axis=1).min()) // 2)
    prompts = np.asarray(batch["inputs"][:rows, :length], np.int32)
    new = min(length, batch["inputs"].shape[1] - length)
    for mode in decode.MODES:
        tokens, counts = decode.generate(
            model, jnp.asarray(prompts), jnp.full((len(prompts),), length), new, mode, stop_tokens=(tokenizer.eos_id,)
        )
        tokens, counts = np.asarray(tokens), np.asarray(counts)
        for i in range(len(prompts)):
            out.append(
                {
                    "row": i,
                    "mode": mode,
                    "prompt": tokenizer.decode(prompts[i]),
                    "text": tokenizer.decode(tokens[i, : counts[i]]),
                }
            )
    return out


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
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for k in ("K1", "K2"):
            axes[0].plot(report["probes"][k], marker="o", label=k)
        axes[0].axhline(report["probes"]["chance"], color="gray", linestyle="--", label="chance")
        axes[0].set(xlabel="layer", ylabel="probe accuracy", title="linear probes, all positions")
        axes[0].legend()
        by_position = report["probes_by_position"]
        for name, label in (
            ("K1", "K=1 (no feedback)"),
            ("K2", "K=2 (one feedback pass)"),
            ("exact", "exact recurrence"),
        ):
            axes[1].plot(by_position["positions"], by_position[name], marker=".", label=label)
        axes[1].plot(by_position["positions"], by_position["chance"], color="gray", linestyle="--", label="chance")
        axes[1].set(xlabel="position t", ylabel="probe accuracy", title=f"layer {by_position['layer']}, per position")
        axes[1].legend()
        fig.tight_layout()
        paths.append(os.path.join(output, "probes.png"))
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def evaluate(
    checkpoint_path: str,
    output: str,
    depths: int,
    seq_len: int,
    batch_size: int,
    probe_examples: int = 512,
    log: Any = print,
    data_path: str = "",
) -> dict[str, Any]:
    from fbt_jax.data.pipeline import make_source
    from fbt_jax.data.plan import plan_data
    from fbt_jax.run_services import use_run_cache
    from fbt_jax.schedule import PassSchedule
    from fbt_jax.trained import load_model

    model, config = load_model(checkpoint_path, log)
    use_run_cache(config, checkpoint_path, log)
    if data_path:  # held-out text for a run that recorded none (an imported model)
        config.data.source, config.data.path = "text", data_path
    if config.data.source == "task":
        config.data.seq_len = seq_len or config.data.seq_len  # default: the length the run trained on
    elif seq_len:
        log(f"prepared text keeps its records' length {config.data.seq_len} (--seq-len applies to built-in tasks)")
    # From pass T on the states are the exact recurrence, so the default stops at T + 1 (the last
    # change 0 confirms it); up to 2T shows it settle, further would only repeat the same states.
    data = plan_data(config)  # the run's data settings, as evaluated here
    seq_len = data.seq_len
    depths = depths or seq_len + 1
    if depths > 2 * seq_len:
        raise ConfigError(
            f"--max-depth={depths} exceeds twice the evaluation length {seq_len}: from pass {seq_len} on the states "
            f"are exact and stop changing; use --max-depth <= {2 * seq_len} or a longer --seq-len"
        )
    source = make_source(data, "validation", "fbt-eval")
    if len(source) < batch_size:
        log(f"the validation split has {len(source)} examples; evaluating on all of them")
        batch_size = len(source)
    rows = np.arange(batch_size)
    batch = source.examples(rows)
    report: dict[str, Any] = {"checkpoint": checkpoint_path, "data": config.data.to_dict()}
    log(f"depth sweep: passes 1–{depths} on {batch_size} × {seq_len} tokens")
    sweep = depth_sweep(model, batch, depths, progress=True)
    report["depth"] = {"loss": sweep["loss"].tolist(), "change": sweep["change"].tolist()}
    trained_max = max(PassSchedule.parse(config.passes.schedule, config.train.steps, config.seed).pass_counts)
    first, last = contraction.monitored_passes(trained_max, 4)
    if last <= min(depths, seq_len):
        sums = {f"change_sq_{k}": sweep["change_sq"][k - 1] for k in range(first, last + 1)}
        sums |= {f"state_sq_{k}": sweep["state_sq"][k - 1] for k in range(first, last + 1)}
        report["contraction"] = contraction.summarize(sums, first, last)
    if getattr(source, "packed", False):
        # The cached decode path runs one document per row; packed rows hold several.
        report["sequential"] = {"skipped": "packed text: the sequential profile needs one document per row"}
        report["samples"] = text_samples(model, batch, data.tokenizer)
    else:
        report["sequential"] = {k: v.tolist() for k, v in sequential_profile(model, batch).items()}
    if data.source == "task":
        report["modes"] = mode_metrics(model, batch, prompt_len=prompt_length(seq_len))
        if data.task.task in ("word_problem", "delayed_recall") and not model.cfg.scan_layers:
            # Probes fit D weights per class: they need more rows than the sweep (one probe per position).
            probe_rows = np.arange(probe_examples)
            train, test = make_source(data, "train").examples(probe_rows), source.examples(probe_rows)
            log(f"probes: {probe_examples} training and {probe_examples} validation sequences")
            report["probes"] = probes(model, train, test)
            report["probes_by_position"] = probes_by_position(model, train, test)
    os.makedirs(output, exist_ok=True)
    report["plots"] = write_plots(report, output)
    with open(os.path.join(output, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return report
