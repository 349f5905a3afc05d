"""How often to ask whether something is done: task ends, and the guest agent after boot.

A poll that finds a task still running is a request spent for nothing, and a fixed
fast poll spends dozens per deploy (and fills the node's log with guest-agent 500s).
Most waits are predictable, though: a linked clone of the same template onto the same
storage takes about as long as the last one did. So each wait is paced from what this
process observed before (`Pacing`, one per backend, keyed by operation and
template/storage): the first look comes at the expected time, and later looks follow
geometrically (1% of the expectation, doubling), so a wait that runs a little over
costs one or two more requests and little time. An operation never seen before is
polled as before (`PollTiming`: fast at first, then a share of the time waited).

How an estimate moves (`Pacing.learn`). A look that finds a wait over says only "at
most this long"; one that finds it running, "longer than this". So: a wait that was
over at its first look lowers the estimate by a small cut, which doubles while waits
keep being over at their first look (an estimate far too long comes down in a few
waits, not dozens); a wait that was not over raises it to the look that found it over
(an upper bound a step past the truth at most; halfway, when it took over half again
as long: one slow task is not the new normal) and the cut starts small again. In a
steady state the first look comes a few milliseconds after the end, and one wait in
several costs one more look. Waits scheduled from the same estimate (fifty deploys
at once) move it once, not fifty times: their looks all say the same.

The estimates are learned in the backend from its own waits. A process starts from what
the store recorded (`remember`: the bot hands the backend the durations of past deploy
steps per template and storage, see bot/jobs/durations.py); those include a request or two
besides the task, so the quickest recent one is taken, and the first own wait replaces
it. A template without history (a new one) starts from its operation's quickest on the
backend's other templates; with no history at all (a new database), `Config.expect_s`
gives first guesses: typical durations unless configured (`config.TYPICAL_S`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_FIRST_STEP = 0.01  # after the expected time: look again after this share of it, doubling
_MIN_STEP_S = 0.01  # never a busy loop, even for a 0.1 s config task
# A wait over at its first look: the next one aims this share earlier, doubling while
# that keeps happening, up to _MAX_CUT (see Pacing.learn).
_FIRST_CUT = 0.0025
_MAX_CUT = 0.25
# A wait that took more than this times its estimate moves it only halfway there: one
# slow clone (a backup holding the storage) must not make the next deploys wait as long;
# a lasting change shows again in the next wait, which moves it the rest of the way.
_OUTLIER = 1.5
_EARLY_S = 0.001  # a look this much before a wait's time still counts as its own
_RECORDED = 200  # recorded durations per operation and key that count: the recent ones


@dataclass(frozen=True)
class PollTiming:
    """Adaptive polling: fast at first, then a fixed share of the time already waited,
    capped. Waiting ~10% longer than the task is the most a poll can add."""

    initial_s: float = 0.05
    ratio: float = 0.1
    max_s: float = 2.0

    def interval_s(self, elapsed_s: float) -> float:
        return min(self.max_s, max(self.initial_s, elapsed_s * self.ratio))


class Schedule:
    """When to look at one wait, in seconds since it began (its age). `saw_running`
    records a look that found it not yet done; `observed_s` turns the looks into an
    observation of how long it took.

    Waits on one node share their looks (one task list answers for all), so a wait is
    often seen running before its own time: such a look moves nothing, else fifty
    deploys' waits would double each other's steps and all look late."""

    def __init__(
        self,
        expected_s: float | None,
        timing: PollTiming,
        basis: int = 0,
        step_s: float | None = None,
    ) -> None:
        """`step_s`: the first step after the expected time, when the estimate knows
        better than 1% of itself how far off it may be (`_Estimate.step_s`)."""
        self.expected_s = expected_s
        self.timing = timing
        self.basis = basis  # which estimate it was made from (Pacing.learn)
        self.looks = 0  # its own looks (at or after their time) that found it running
        self.running_s: float | None = None  # the age of the last look that found it so
        self.missed = False  # a look failed (the read did not answer): see `miss`
        self._step_s = max(_MIN_STEP_S, step_s or (expected_s or 0.0) * _FIRST_STEP)
        self._next_s = timing.interval_s(0.0) if expected_s is None else expected_s

    def next_at(self) -> float:
        """The age at which to look next."""
        return self._next_s

    def saw_running(self, age_s: float) -> None:
        if self.running_s is None or age_s > self.running_s:
            self.running_s = age_s  # any look that found it running bounds it from below
        self._step(age_s)

    def miss(self, age_s: float) -> None:
        """A look whose read failed: it says nothing of the wait, so the next look comes
        as after a look that found it running (the same backoff), and the wait teaches
        nothing about how long such waits take (`Pacing.learn`): its end was seen late."""
        self.missed = True
        self._step(age_s)

    def _step(self, age_s: float) -> None:
        if age_s < self._next_s - _EARLY_S:
            return  # a look for another wait: this one's time has not come
        self.looks += 1
        if self.expected_s is None:
            self._next_s = age_s + self.timing.interval_s(age_s)
        else:
            self._next_s = age_s + self._step_s
            self._step_s = min(self._step_s * 2, self.timing.max_s)

    def observed_s(self, done_s: float) -> tuple[float, float | None]:
        """How long a wait without an expectation took, as best its looks tell: between
        the last look that found it running and the one that found it over (fast
        polling's looks are 10% of the time waited apart): the middle, and how far the
        truth may lie above it."""
        if self.running_s is None or self.running_s >= done_s:
            return done_s, None
        return (self.running_s + done_s) / 2, (done_s - self.running_s) / 2


@dataclass
class _Estimate:
    seconds: float
    cut: float = _FIRST_CUT  # the share the next wait over at its first look takes off
    basis: int = 0  # bumped on every change: schedules made from it carry it
    # From a blind wait: the truth lies at most this far above `seconds`, so a wait that
    # is not over at its first look is over at its second (one more request at most).
    step_s: float | None = None


class Pacing:
    """Expected durations per (operation, key) learned from this process's waits; an
    operation without one falls back to what the store recorded (`remember`), then to
    `seeds` (configured), else to fast polling."""

    def __init__(self, seeds: Mapping[str, float] | None = None) -> None:
        self._seeds = dict(seeds or {})
        self._estimates: dict[tuple[str, str], _Estimate] = {}
        self._recorded: dict[tuple[str, str], float] = {}
        self._bases = 0

    def expected_s(self, operation: str, key: str) -> float | None:
        own = self._estimates.get((operation, key))
        if own is not None:
            return own.seconds
        return (
            self._recorded.get((operation, key))
            or self._typical(operation)
            or self._seeds.get(operation)
        )

    def _typical(self, operation: str) -> float | None:
        """For a key never seen (a new template): the same operation's quickest on
        this backend's other keys, learned or recorded (too early costs a look or two;
        too late, time)."""
        known = [e.seconds for (op, _key), e in self._estimates.items() if op == operation]
        known += [s for (op, _key), s in self._recorded.items() if op == operation]
        return min(known) if known else None

    def guess(self, seeds: Mapping[str, float]) -> None:
        """First guesses for the operations this pacing has none for (a backend's
        `expect_s`, when it was handed a pacing to share)."""
        self._seeds = {**seeds, **self._seeds}

    def remember(self, operation: str, key: str, durations: Iterable[float]) -> None:
        """Recorded durations of past steps doing this operation (newest first). A step
        also spent a request or two around its task, and steps of deploys that ran
        together took longer than one alone: the quickest recent one is the closest to
        the task itself. Too early costs a look or two; too late costs time."""
        recent = [d for d in durations if d > 0][:_RECORDED]
        if recent:
            self._recorded[(operation, key)] = max(min(recent), _MIN_STEP_S)

    def schedule(self, operation: str, key: str, timing: PollTiming) -> Schedule:
        own = self._estimates.get((operation, key))
        if own is not None:
            return Schedule(own.seconds, timing, own.basis, own.step_s)
        return Schedule(self.expected_s(operation, key), timing)

    def learn(self, operation: str, key: str, schedule: Schedule, done_s: float) -> None:
        """Move the estimate by what one wait's looks said (see the module's docstring).
        A wait made from an estimate that has moved since (a sibling of fifty learnt
        first) can only raise it, to the highest bound its siblings saw."""
        if schedule.missed:  # a look in between failed: its end may lie far before
            return
        own = self._estimates.get((operation, key))
        expected = schedule.expected_s
        if expected is None:  # polled blind: the first of its kind (or its siblings)
            seconds, above = schedule.observed_s(done_s)
            if own is None or seconds > own.seconds:
                self._set(operation, key, _Estimate(max(seconds, _MIN_STEP_S), step_s=above))
            return
        if own is None:  # the first own wait, from a recorded or configured expectation
            own = _Estimate(expected, basis=schedule.basis)
        if schedule.looks == 0:  # over at its first look: it takes at most this long
            if own.basis == schedule.basis:
                lowered = max(min(done_s, expected) * (1 - own.cut), _MIN_STEP_S)
                self._set(operation, key, _Estimate(lowered, min(own.cut * 2, _MAX_CUT)))
        else:  # over later: it takes at most `done_s`
            raised = done_s if done_s <= expected * _OUTLIER else (expected + done_s) / 2
            if own.basis == schedule.basis or raised > own.seconds:
                self._set(operation, key, _Estimate(max(raised, expected)))

    def _set(self, operation: str, key: str, estimate: _Estimate) -> None:
        self._bases += 1
        estimate.basis = self._bases
        self._estimates[(operation, key)] = estimate


@dataclass(eq=False)
class Pace:
    """What a task wait is, for its schedule: the operation and its template/storage.
    `seen_over_at`: when the look that found the task over was sent (loop time), for
    a caller that starts a clock at the task's end (the guest's boot)."""

    pacing: Pacing
    operation: str
    key: str
    seen_over_at: float | None = None
    began_at: float | None = None  # when the answer that started the task came (loop time)

    def schedule(self, timing: PollTiming) -> Schedule:
        return self.pacing.schedule(self.operation, self.key, timing)

    def ended_at(self) -> float | None:
        """When the task ended, as best known: its start plus the duration such tasks
        take, unless a look found it over before that. With fifty deploys the look
        that finds a start task over comes 20-60 ms late (one shared poll of the task
        list, a queue of requests); a boot clock started there makes the first ask of
        the guest agent that late too."""
        expected = self.pacing.expected_s(self.operation, self.key)
        if self.began_at is None or expected is None:
            return self.seen_over_at
        guess = self.began_at + expected
        return guess if self.seen_over_at is None else min(self.seen_over_at, guess)

    def learn(self, schedule: Schedule, done_s: float, at: float) -> None:
        self.seen_over_at = at
        self.pacing.learn(self.operation, self.key, schedule, done_s)


# The pipeline's steps whose time is mostly one wait of ours, and that wait's operation.
STEP_OPERATIONS = {
    "clone": "clone",
    "identity": "config",
    "resize": "resize",
    "power_on": "start",
    "address": "boot",
}


def clone_key(template: str, storage: str | None) -> str:
    """A clone's key: the template and the storage asked for (none: the default), which
    decide between a linked clone (seconds) and a full copy (minutes). Also what the
    job history records, so recorded clone steps find their key."""
    return f"{template}@{storage or ''}"


def step_key(step: str, template: str, storage: str | None) -> str:
    """The key of a step's operation: a clone's depends on the storage too; the other
    operations are keyed by template (a resize: its disk is the template's copy)."""
    return clone_key(template, storage) if step == "clone" else template
