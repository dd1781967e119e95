"""A self-training run's figures per round: `rounds.json`, `rounds.md` and `rounds.png` in its workdir,
rewritten whole from the rounds' own files at the end of every attempt."""

from __future__ import annotations

import os
from typing import Any

from fbt_jax.data import store


def line(figures: dict[str, Any]) -> str:
    """One log line: each mode's held-out accuracy and mean answer length, and what the round kept."""
    modes = ", ".join(
        f"{mode} {f['accuracy']:.3f} ({f['mean_tokens']:.1f} tokens)" for mode, f in figures["held_out"].items()
    )
    text = f"round {figures['round']}: held-out {modes}"
    if "training" in figures:
        t = figures["training"]
        text += f"; kept {t['kept']} answers of {t['problems']} problems ({t['kept_fraction']:.0%}), {t['kept_mean_tokens']:.1f} tokens"
    return text


def markdown(figures: list[dict[str, Any]]) -> str:
    modes = list(figures[0]["held_out"])
    head = ["round", *(f"{m} accuracy" for m in modes), *(f"{m} tokens" for m in modes), "kept fraction",
            "kept tokens", "tokens sampled", "sampling s", "tuning s"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figures:
        held, training, seconds = f["held_out"], f.get("training"), f.get("seconds", {})
        cells = [str(f["round"])]
        cells += [f"{held[m]['accuracy']:.3f}" if m in held else "–" for m in modes]
        cells += [f"{held[m]['mean_tokens']:.2f}" if m in held else "–" for m in modes]
        if training:
            cells += [f"{training['kept_fraction']:.3f}", f"{training['kept_mean_tokens']:.2f}",
                      f"{training['tokens_sampled']:,}"]  # fmt: skip
        else:
            cells += ["–", "–", "–"]
        cells += [f"{seconds[s]:.0f}" if s in seconds else "–" for s in ("sampling", "tuning")]
        rows.append("| " + " | ".join(cells) + " |")
    return (
        "Held-out accuracy and mean answer length (generated tokens) per mode after each round (round 0: the "
        "starting weights); the kept fraction of training problems and the kept answers' mean length; wall "
        "seconds of sampling and tuning over every attempt.\n\n" + "\n".join(rows) + "\n"
    )


def plot(figures: list[dict[str, Any]], path: str) -> None:
    """Held-out accuracy and mean answer length per mode against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    rounds = [f["round"] for f in figures]
    for mode in figures[0]["held_out"]:
        axes[0].plot(rounds, [f["held_out"][mode]["accuracy"] for f in figures], marker="o", label=mode)
        axes[1].plot(rounds, [f["held_out"][mode]["mean_tokens"] for f in figures], marker="o", label=mode)
    for ax, label in ((axes[0], "held-out accuracy"), (axes[1], "mean answer tokens")):
        ax.set(xlabel="round", ylabel=label, xticks=rounds)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(workdir: str, figures: list[dict[str, Any]]) -> None:
    store.write_json(os.path.join(workdir, "rounds.json"), figures, staging=workdir)
    with open(os.path.join(workdir, "rounds.md"), "w", encoding="utf-8") as f:  # a view of rounds.json
        f.write(markdown(figures))
    plot(figures, os.path.join(workdir, "rounds.png"))
