"""After instruction tuning: does latent feedback's gain survive it, and what happens to answer length?

The paper measures half of its table after instruction tuning: the feedback gain persists, and the
base model's shorter reasoning with feedback is gone. At CPU scale, on a task that is solved in
written steps: the sum of six digits mod 10, asked as `sum 3 1 4 1 5 9 :` and answered either worked
(`3 4 8 9 4 = 3 .`: each running sum, then the result) or directly (`= 3 .`), half of each in the
pretraining text, so that the answer's length is the model's choice; half of that text asks and
answers as ChatML conversations, so that tuning changes the style, not the format.

Per seed and arm, with configs/tiny.py's model (D=64, 2 layers) and a word-level tokenizer with the
ChatML markers (configs/chat_templates/chatml.jinja):

1. pretrain on the text: the paper's 75/22/3 mixture (`paper`), or K=1 only (`k1`);
2. instruction-tune from those weights (`init_from`) on chat records whose replies are the worked
   answers only (the verbose style a tuning set is written in), with the arm's late mixture (2/3
   passes for `paper`, K=1 for `k1`), each reply fused from its first token, at the learning rate
   pretraining ended at;
3. evaluate both on held-out problems with `fbt-eval` in the three modes (the K=1 arm in standard
   mode: its fusion never trained), both asked as a user turn (`--chat`); accuracy of the final
   number, and answer length in generated tokens.

(e) is the soft − standard accuracy of the tuned `paper` arm, per seed (fused − standard beside
it); (f) the answer length, standard − soft, before and after tuning. Both are judged by
`budget.judge` over the tuning runs' settling (their K=1 and K=2 held-out loss) or a budget ladder
(`--ladder`, multiples of both phases' steps; (e)'s rungs measured before are carried by
summary.json, (f) is judged over the rungs one invocation measures).

    python experiments/after_tuning.py [--smoke] [--ladder=1,2.5] [--write-docs docs/results.md]
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
from typing import Any

import budget
import common
import numpy as np
import summary

NAME = "after_tuning"
DIGITS, MODULUS = 6, 10
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]")
WORDS = (*map(str, range(10)), "sum", ":", "=", ".", "user", "assistant", "system")
ARMS = {"paper": ("0.0:1=1.0; 0.75:2=0.88,3=0.12", "0:2=0.88,3=0.12"), "k1": ("0:1", "0:1")}  # pretrain, tune
MODES = ("standard", "soft", "fused")
# Tuning starts at the learning rate pretraining ends at (3e-3 × min_learning_rate_ratio 0.1): at 1e-3
# (the first rung, 2026-12-07) it lost accuracy in every mode before it settled.
TUNE_LR = 3e-4
COMMON = (  # every run: tiny's model on 64-token rows of the word-level vocabulary
    "--config.data.source=text", "--config.data.seq_len=64", "--config.model.vocab_size=24",
    "--config.train.batch_size=32", "--config.eval.num_batches=4", "--config.eval.contraction_passes=0",
    "--config.train.log_every=100",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Sizes:
    pretrain_steps: int
    tune_steps: int
    seeds: tuple[int, ...]
    documents: int  # pretraining texts
    conversations: int  # tuning records
    problems: int  # held-out evaluation problems
    arms: tuple[str, ...] = tuple(ARMS)
    modes: tuple[str, ...] = MODES  # those the feedback arm is read in
    extra: tuple[str, ...] = ()  # overrides of every run

    def scaled(self, factor: float) -> Sizes:
        return dataclasses.replace(
            self, pretrain_steps=round(self.pretrain_steps * factor), tune_steps=round(self.tune_steps * factor)
        )


FULL = Sizes(pretrain_steps=3000, tune_steps=600, seeds=(0, 1, 2), documents=200000, conversations=50000, problems=200)
# Smoke: one seed of the feedback arm, K <= 2 (fewer programs to compile), read in two modes.
SMOKE = Sizes(pretrain_steps=16, tune_steps=8, seeds=(0,), documents=600, conversations=200, problems=8,
              arms=("paper",), modes=("standard", "soft"),
              extra=("--config.passes.schedule=0:1; 0.5:2", "--config.eval.num_batches=1"))  # fmt: skip


def problem(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the digits, their running sums mod 10): the last running sum is the answer."""
    digits = tuple(int(d) for d in rng.integers(0, 10, DIGITS))
    return digits, tuple(int(s) % MODULUS for s in np.cumsum(digits))


def worked(sums: tuple[int, ...]) -> str:
    return " ".join(map(str, sums[:-1])) + f" = {sums[-1]} ."


def direct(sums: tuple[int, ...]) -> str:
    return f"= {sums[-1]} ."


def write_tokenizer(directory: str) -> str:
    """A word-level tokenizer of WORDS with the ChatML markers, saved as transformers saves one,
    with the shipped ChatML template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return directory
    os.makedirs(directory, exist_ok=True)
    vocab = {token: i for i, token in enumerate((*SPECIALS, *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": SPECIALS[0], "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    shutil.copyfile(
        os.path.join(common.REPO, "configs", "chat_templates", "chatml.jinja"),
        os.path.join(directory, "chat_template.jinja"),
    )
    return directory


def write_data(root: str, sizes: Sizes, tokenizer: str) -> dict[str, str]:
    """The pretraining text, the tuning conversations (worked replies only), the held-out problems and
    the task spec; every training problem differs from every held-out one. Half of the pretraining
    documents are ChatML conversations rendered as text (a web corpus holds transcripts too): tuning
    then changes the answers' style, not the format the task is read in. Without them (the first
    rungs, 2026-12-07) tuning had to learn the task again behind the markers, which move each digit
    several positions from its running sum, and every tuned model stayed at chance."""
    from fbt_jax.data.chat import ChatTemplate, chat_template
    from fbt_jax.data.tokenizers import load_tokenizer

    paths = {name: os.path.join(root, name) for name in ("text.jsonl", "chat.jsonl", "problems.jsonl")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    loaded = load_tokenizer(tokenizer)
    template = ChatTemplate(chat_template(loaded), loaded)
    rng = np.random.default_rng(2026)
    held_out = {}
    while len(held_out) < sizes.problems:
        digits, sums = problem(rng)
        held_out[digits] = sums

    def fresh() -> tuple[tuple[int, ...], tuple[int, ...]]:
        while True:
            digits, sums = problem(rng)
            if digits not in held_out:
                return digits, sums

    def prompt(digits: tuple[int, ...]) -> str:
        return "sum " + " ".join(map(str, digits))

    with open(paths["text.jsonl"] + ".tmp", "w", encoding="utf-8") as f:
        for i in range(sizes.documents):  # plain worked, plain direct, chat worked, chat direct
            digits, sums = fresh()
            answer = worked(sums) if i % 2 == 0 else direct(sums)
            if i % 4 < 2:
                text = f"{prompt(digits)} : {answer}"
            else:
                turns = [{"role": "user", "content": prompt(digits)}, {"role": "assistant", "content": answer}]
                text = template.render(turns)[0]
            f.write(json.dumps({"text": text}) + "\n")
    with open(paths["chat.jsonl"] + ".tmp", "w", encoding="utf-8") as f:
        for _ in range(sizes.conversations):
            digits, sums = fresh()
            turns = [{"role": "user", "content": prompt(digits)}, {"role": "assistant", "content": worked(sums)}]
            f.write(json.dumps({"messages": turns}) + "\n")
    with open(paths["problems.jsonl"] + ".tmp", "w", encoding="utf-8") as f:
        for i, (digits, sums) in enumerate(held_out.items()):
            f.write(json.dumps({"id": f"p{i}", "digits": " ".join(map(str, digits)), "answer": str(sums[-1])}) + "\n")
    spec = {"name": "sums-chat", "problems": "problems.jsonl", "fields": {"prompt": "digits", "answer": "answer"},
            "prompt_template": "sum {prompt}", "max_new_tokens": 12, "extract": {"kind": "last_number"},
            "compare": "numeric"}  # fmt: skip
    with open(os.path.join(root, "chat.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
    for path in paths.values():
        os.replace(path + ".tmp", path)
    return paths


def prepare(root: str, sizes: Sizes) -> tuple[str, str, str]:
    """(pretraining records, tuning records, tokenizer), prepared once."""
    tokenizer = write_tokenizer(os.path.join(root, "tokenizer"))
    files = write_data(root, sizes, tokenizer)
    out = []
    for name, extra in (("text", []), ("chat", ["--format=chat"])):
        output = os.path.join(root, f"prepared-{name}")
        if not os.path.exists(os.path.join(output, "meta.json")):
            command = ["fbt-prepare", f"--input={files[name + '.jsonl']}", f"--output={output}", "--seq-len=64",
                       f"--tokenizer={tokenizer}", "--validation-fraction=0.05", *extra]  # fmt: skip
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=common.REPO)
        out.append(output)
    return out[0], out[1], tokenizer


def train(workdir: str, *overrides: str) -> None:
    command = ["fbt-train", "--config=configs/tiny.py", f"--config.workdir={workdir}", *COMMON, *overrides]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=common.REPO)


def evaluate(run: str, spec: str, sizes: Sizes, modes: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """fbt-eval's scores per mode (pass@1 and mean / median answer tokens) on the problems asked as a
    user turn (`--chat`, before and after tuning alike), run in this process: its start-up once for
    every evaluation (a finished one is read back, a killed one resumes). A K=1 arm is read in
    standard mode alone: its fusion never trained (fbt-eval refuses the others)."""
    from fbt_jax.evals.cli import main as fbt_eval

    output = os.path.join(run, "eval-chat")
    argv = [f"--checkpoint={run}", f"--tasks={spec}", f"--output={output}", "--batch-size=64",
            f"--num-problems={sizes.problems}", f"--modes={','.join(modes)}", "--chat"]  # fmt: skip
    print("$ fbt-eval " + " ".join(argv), flush=True)
    fbt_eval(argv)
    with open(os.path.join(output, "scores.json"), encoding="utf-8") as f:
        (per_mode,) = json.load(f)["tasks"].values()
    return {mode: per_mode[mode] for mode in modes}


def run_arm(root: str, sizes: Sizes, data: tuple[str, str, str], arm: str, seed: int) -> dict[str, Any]:
    text, chat, _ = data
    pretrain_schedule, tune_schedule = ARMS[arm]
    base = os.path.join(root, f"{sizes.pretrain_steps}-steps", f"{arm}-seed{seed}")
    tuned = os.path.join(root, f"{sizes.pretrain_steps}-steps", f"{arm}-seed{seed}-tuned-lr{TUNE_LR:g}")
    p, t = sizes.pretrain_steps, sizes.tune_steps
    train(base, f"--config.data.path={text}", f"--config.seed={seed}", f"--config.train.steps={p}",
          f"--config.passes.schedule={pretrain_schedule}", f"--config.checkpoint.every_steps={max(p // 4, 1)}",
          f"--config.eval.every_steps={max(p // 10, 1)}", f"--config.optimizer.warmup_steps={max(p // 60, 1)}",
          *sizes.extra)  # fmt: skip
    train(tuned, f"--config.init_from={base}", f"--config.data.path={chat}", f"--config.seed={seed}",
          f"--config.train.steps={t}", f"--config.passes.schedule={tune_schedule}",
          f"--config.optimizer.learning_rate={TUNE_LR}", f"--config.optimizer.warmup_steps={max(t // 10, 1)}",
          f"--config.checkpoint.every_steps={max(t // 4, 1)}", f"--config.eval.every_steps={max(t // 10, 1)}",
          *sizes.extra)  # fmt: skip
    with open(os.path.join(tuned, "eval.jsonl"), encoding="utf-8") as f:
        curve = [json.loads(line) for line in f]
    modes = ("standard",) if arm == "k1" else sizes.modes
    return {
        "arm": arm,
        "seed": seed,
        "base": evaluate(base, os.path.join(root, "chat.json"), sizes, modes),
        "tuned": evaluate(tuned, os.path.join(root, "chat.json"), sizes, modes),
        "curve": curve,
    }


def job_minutes(root: str) -> float:
    """Every run's wall time, all attempts, from the goodput ledgers under `root`."""
    ledgers = glob.glob(os.path.join(root, "*-steps", "*", "goodput.jsonl"))
    return sum(json.loads(line)["wall_seconds"] for path in ledgers for line in open(path, encoding="utf-8")) / 60


def per_seed(results: list[dict[str, Any]], arm: str, stage: str, value: Any) -> np.ndarray:
    return np.array([value(r[stage]) for r in results if r["arm"] == arm])


def said(values: Any, digits: int = 3) -> str:
    return ", ".join(f"{v:+.{digits}f}" for v in values)


def accuracy_gain(mode: str) -> Any:
    return lambda scores: scores[mode]["pass@1"] - scores["standard"]["pass@1"]


def shorter(scores: dict[str, dict[str, float]]) -> float:
    """Answer tokens, standard − soft (positive: soft answers shorter, the paper's base-model sign)."""
    return scores["standard"]["mean_tokens"] - scores["soft"]["mean_tokens"]


RULES = (budget.Rule("loss_K1", 0.02, relative=True),)
FEEDBACK_RULES = (budget.Rule("loss_K2", 0.02, relative=True),)
RULE_TEXT = "the tuning runs' K=1 held-out loss within 2% (and the paper arm's K=2) over their last 20% of steps"


def budget_check(results: list[dict[str, Any]]) -> budget.Check:
    """The tuning runs settled: an effect measured while tuning still moves is a verdict on its budget."""
    rows = [{"run": f"{r['arm']}, seed {r['seed']}", "label.schedule": r["arm"], "label.seed": r["seed"],
             "curve": [(row["step"], row) for row in r["curve"]]} for r in results]  # fmt: skip
    check = budget.check_with_feedback([r for r in rows if r["label.schedule"] == "paper"], RULES, FEEDBACK_RULES,
                                       "tuning, 75/22/3 arm")  # fmt: skip
    return check


def cell(results: list[dict[str, Any]], arm: str, stage: str, mode: str, key: str, digits: int) -> str:
    """One mode's figure over an arm's seeds ('–' where that mode was not read)."""
    if not all(mode in r[stage] for r in results if r["arm"] == arm):
        return "–"
    return common.mean_std(per_seed(results, arm, stage, lambda s: s[mode][key]), digits)


def table(results: list[dict[str, Any]], sizes: Sizes) -> str:
    """Per arm and stage, each mode's accuracy and mean answer tokens."""
    header = ["arm", "stage", *(f"{m} accuracy" for m in MODES), *(f"{m} tokens" for m in MODES)]
    lines = []
    for arm in sizes.arms:
        for stage in ("base", "tuned"):
            cells = [cell(results, arm, stage, m, "pass@1", 3) for m in MODES]
            cells += [cell(results, arm, stage, m, "mean_tokens", 2) for m in MODES]
            lines.append([arm, "pretrained" if stage == "base" else "tuned", *cells])
    return common.docs_block.table(header, lines)


def parse_ladder(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main() -> None:
    args = common.arguments(__doc__, NAME, [("--ladder", {"default": "1", "help": "budget multiples to measure"})])
    sizes = SMOKE if args.smoke else FULL
    timer = common.Timer()
    root = os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)
    data = prepare(root, sizes)
    # (e)'s rungs measured before (summary.json keeps them per seed); (f) is judged over this invocation's.
    recorded = summary.load_effects(args, NAME)
    rungs: dict[str, list[budget.Rung]] = {
        "e": [budget.Rung.from_record(int(n), v) for n, v in recorded.items()],
        "f": [],
    }
    body_parts, results, codes = [], [], {}
    for factor in parse_ladder(args.ladder):
        at = sizes.scaled(factor)
        runs = os.path.join(root, f"{at.pretrain_steps}-steps")
        common.stamp_training(runs, common.code_version(), begun=os.path.isdir(runs))
        results = [run_arm(root, at, data, arm, seed) for arm in at.arms for seed in at.seeds]
        e = budget.Rung(at.tune_steps, tuple(per_seed(results, "paper", "tuned", accuracy_gain("soft"))))
        f = budget.Rung(at.pretrain_steps, tuple(per_seed(results, "paper", "base", shorter)))
        rungs["e"] = budget.ladder(rungs["e"], e)
        rungs["f"] = budget.ladder(rungs["f"], f)
        codes[str(at.tune_steps)] = common.rows_code([{"trained_at": common.trained_at(runs)}])
        body_parts.append(
            f"**{at.pretrain_steps} pretraining + {at.tune_steps} tuning steps** ({codes[str(at.tune_steps)]}), "
            f"{sizes.problems} held-out problems, seeds {list(at.seeds)}, mean ± std:\n\n{table(results, at)}\n\n"
            f"soft − standard accuracy, tuned 75/22/3, per seed: {said(e.values)}; "
            + (
                f"fused − standard: {said(per_seed(results, 'paper', 'tuned', accuracy_gain('fused')))}; "
                if "fused" in at.modes
                else ""
            )
            + f"before tuning: {said(per_seed(results, 'paper', 'base', accuracy_gain('soft')))}.\n\n"
            f"answer tokens, standard − soft, 75/22/3, per seed: before tuning {said(f.values, 2)}; "
            f"after: {said(per_seed(results, 'paper', 'tuned', shorter), 2)}."
        )
    check = budget_check(results)
    judged_e = budget.judge("tuned soft − standard accuracy (75/22/3)", rungs["e"], check, minimum=0.02)
    judged_f = budget.judge("base answer tokens, standard − soft (75/22/3)", rungs["f"], check)
    plot = plot_lengths(args, results, sizes)
    body = (
        f"Written by `python experiments/{NAME}.py{' --smoke' if args.smoke else ''}` in {timer.minutes():.1f} min on "
        f"{common.machine()} (its runs took {job_minutes(root):.1f} min of job time, one at a time, over every "
        f"invocation). The sum of {DIGITS} digits mod {MODULUS}, answered worked or directly (half each in the "
        f"pretraining text, half of it as ChatML conversations), tuned on worked answers only as ChatML "
        f"conversations, evaluated as a user turn.\n\n" + "\n\n".join(body_parts) + "\n\n"
        f"{common.figure_line(args, plot, 'answer length per mode before and after tuning')}\n\n{check.line}\n\n"
        f"verdict ((e) the feedback gain survives tuning): {judged_e.verdict}\n\n{judged_e.line}\n\n"
        f"verdict ((f) shorter answers with feedback before tuning): {judged_f.verdict}\n\n{judged_f.line}\n"
    )
    common.finish(args, NAME, body)
    gains = rungs["e"][-1]
    figures = (f"tuned soft − standard accuracy {common.mean_std(gains.values)}; (f) base answer tokens standard − soft "
               f"{common.mean_std(rungs['f'][-1].values, 2)}: {judged_f.verdict}")  # fmt: skip
    effects = {str(r.steps): r.record() for r in rungs["e"]}
    commits = {**summary.load_commits(args, NAME), **codes}
    row = summary.Row(figures, RULE_TEXT, check.held, judged_e.verdict, criterion=judged_e.criterion,
                      effect="tuned soft − standard accuracy (75/22/3)", effects=effects,
                      commits={k: v for k, v in commits.items() if k in effects})  # fmt: skip
    summary.record(args, NAME, row)


def plot_lengths(args: Any, results: list[dict[str, Any]], sizes: Sizes) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width, x = 0.12, np.arange(len(MODES))
    bars = [(arm, stage) for arm in sizes.arms for stage in ("base", "tuned")]
    for i, (arm, stage) in enumerate(bars):
        means = [
            per_seed(results, arm, stage, lambda s, m=m: s[m]["mean_tokens"] if m in s else np.nan).mean()
            for m in MODES
        ]
        label = f"{arm}, {'pretrained' if stage == 'base' else 'tuned'}"
        ax.bar(x + (i - len(bars) / 2) * width, means, width, label=label)
    ax.set_xticks(x, MODES)
    ax.set_ylabel("mean answer tokens")
    ax.legend(fontsize=7)
    path = common.plot_path(args, NAME)
    common.save_figure(fig, path)
    return path


if __name__ == "__main__":
    main()
