"""The training loop with plain-Python programs and hooks (nothing compiled): K per step from the
schedule, hooks called in list order, metrics fetched only for hooks that read them and averaged
over the steps since the last such interval."""

import pytest

from fbt_jax.train.loop import Hook, StepEnd, interval_metrics, run_steps


class Schedule:
    """A stand-in for PassSchedule: K = 1 for the first `switch` steps, then 2."""

    def __init__(self, switch):
        self.switch = switch

    def num_passes(self, step):
        return 1 if step < self.switch else 2


def program(k):
    """A 'compiled step' for K = k: the state counts steps, the loss is the batch (a number)."""

    def step(state, batch):
        metrics = {"loss": float(batch), "learning_rate": 0.1 * (state + 1)}
        metrics.update({f"loss_pass_{j}": float(batch) * j for j in range(1, k + 1)})
        return state + 1, metrics

    return step


class Recorder(Hook):
    """Records every call into a shared list; acts every `every` steps."""

    def __init__(self, name, calls, every=1, reads_metrics=False):
        self.name, self.calls, self.every, self.reads_metrics = name, calls, every, reads_metrics
        self.records = {}

    def wants(self, end):
        return end.step % self.every == 0

    def on_step(self, end):
        self.calls.append((self.name, "on_step", end.step))

    def on_interval(self, end, record, state):
        self.calls.append((self.name, "on_interval", end.step))
        self.records[end.step] = (dict(record), state)


def run(hooks, steps=6, start_step=0, switch=3, stop_at=None):
    ends = []

    class Ends(Hook):
        def on_step(self, end):
            ends.append(end)

    state = run_steps(
        state=start_step,
        programs={1: program(1), 2: program(2)},
        schedule=Schedule(switch),
        batches=iter(range(start_step + 1, steps + 1)),  # step s (1-based) gets batch s
        start_step=start_step,
        steps=steps,
        tokens_per_step=10,
        hooks=[*hooks, Ends()],
        stop_requested=lambda step: step == stop_at,
    )
    return state, ends


def test_hooks_are_called_in_list_order_on_step_first_then_on_interval():
    calls = []
    first, second = Recorder("first", calls), Recorder("second", calls)
    run([first, second], steps=2)
    assert calls == [
        ("first", "on_step", 1),
        ("second", "on_step", 1),
        ("first", "on_interval", 1),
        ("second", "on_interval", 1),
        ("first", "on_step", 2),
        ("second", "on_step", 2),
        ("first", "on_interval", 2),
        ("second", "on_interval", 2),
    ]


def test_on_interval_is_called_only_for_hooks_that_want_the_step():
    calls = []
    every, third = Recorder("every", calls), Recorder("third", calls, every=3)
    run([every, third], steps=7)
    assert [s for name, call, s in calls if name == "every" and call == "on_interval"] == [1, 2, 3, 4, 5, 6, 7]
    assert [s for name, call, s in calls if name == "third" and call == "on_interval"] == [3, 6]
    assert [s for name, call, s in calls if name == "third" and call == "on_step"] == [1, 2, 3, 4, 5, 6, 7]


def test_a_hook_that_reads_no_metrics_gets_an_empty_record():
    calls = []
    logger = Recorder("logger", calls, every=3, reads_metrics=True)
    watcher = Recorder("watcher", calls)
    run([logger, watcher], steps=6)
    for step in (1, 2, 4, 5):  # steps where no hook that reads metrics acts
        assert watcher.records[step][0] == {}
    assert watcher.records[1][1] == 1 and watcher.records[5][1] == 5  # it still sees the state


def test_metrics_of_the_steps_between_intervals_are_averaged_into_the_next_interval():
    calls = []
    logger = Recorder("logger", calls, every=3, reads_metrics=True)
    state, _ = run([logger], steps=6, switch=2)  # K = 1, 1, 2, 2, 2, 2
    assert state == 6
    first, _ = logger.records[3]
    tokens_per_second = first.pop("tokens_per_second")
    assert tokens_per_second > 0
    assert first == pytest.approx(
        {
            "loss": (1 + 2 + 3) / 3,
            "loss_pass_1": (1 + 2 + 3) / 3,
            "loss_pass_2": 3 * 2,  # only step 3 ran a second pass
            "learning_rate": 0.1 * 3,  # the last step's
            "num_passes": 2,
            "mean_num_passes": (1 + 1 + 2) / 3,
        }
    )
    second, _ = logger.records[6]
    assert second["loss"] == pytest.approx((4 + 5 + 6) / 3)  # nothing of the first interval
    assert second["loss_pass_2"] == pytest.approx((4 + 5 + 6) * 2 / 3)
    assert second["mean_num_passes"] == 2


def test_each_step_runs_the_program_of_its_k_and_the_run_ends_where_asked():
    _, ends = run([], steps=6, start_step=2, switch=4, stop_at=5)
    assert ends == [
        StepEnd(step=3, num_passes=1, last=False, stopping=False),
        StepEnd(step=4, num_passes=1, last=False, stopping=False),
        StepEnd(step=5, num_passes=2, last=False, stopping=True),  # the loop reports a stop; hooks act on it
        StepEnd(step=6, num_passes=2, last=True, stopping=False),
    ]


def test_interval_metrics_average_each_pass_over_the_steps_that_ran_it():
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
