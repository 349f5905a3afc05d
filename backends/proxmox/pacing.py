"""How often to ask whether something is done: task ends, and the guest agent after boot.

A poll that finds a task still running is a request spent for nothing, and a fixed
fast poll spends dozens per deploy (and fills the node's log with guest-agent 500s).
Most waits are predictable, though: a linked clone of the same template onto the same
storage takes about as long as the last one did. So each wait is paced from what this
process observed before (`Pacing`, one per backend, keyed by operation and
template/storage): the first look comes at the expected time, and later looks follow
geometrically (2.5% of the expectation, doubling), so a wait that runs a little over
costs one or two more requests and little time. An operation never seen before is
polled as before (`PollTiming`: fast at first, then a share of the time waited).

The estimates are learned in the backend from its own waits. A process starts from what
the store recorded (`remember`: the bot hands the backend the durations of past deploy
steps per template and storage, see bot/durations.py); those include a request or two
besides the task, so the quickest recent one is taken, and the first own wait replaces
it. Without history, `Config.expect_s` gives first guesses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_FIRST_STEP = 0.025  # after the expected time: look again after this share of it, doubling
_MIN_STEP_S = 0.01  # never a busy loop, even for a 0.1 s config task
# A wait that was already over at its first look says only "at most this long": aim a
# little earlier next time, so an operation that got faster is noticed.
_PROBE_EARLIER = 0.98
_EARLY_S = 0.001  # a look this much before a wait's time still counts as its own
_WEIGHT = 0.5  # of a new observation in the running estimate: follows change in 2-3 waits
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

    def __init__(self, expected_s: float | None, timing: PollTiming) -> None:
        self.expected_s = expected_s
        self.timing = timing
        self.looks = 0  # its own looks (at or after their time) that found it running
        self._step_s = max(_MIN_STEP_S, (expected_s or 0.0) * _FIRST_STEP)
        self._next_s = timing.interval_s(0.0) if expected_s is None else expected_s

    def next_at(self) -> float:
        """The age at which to look next."""
        return self._next_s

    def saw_running(self, age_s: float) -> None:
        if age_s < self._next_s - _EARLY_S:
            return  # a look for another wait: this one's time has not come
        self.looks += 1
        if self.expected_s is None:
            self._next_s = age_s + self.timing.interval_s(age_s)
        else:
            self._next_s = age_s + self._step_s
            self._step_s = min(self._step_s * 2, self.timing.max_s)

    def observed_s(self, done_s: float) -> float:
        """How long the wait took, as best the looks tell: the look that found it done,
        or a little earlier when it was done at its first own look (or before)."""
        if self.looks == 0 and self.expected_s is not None:
            return min(done_s, self.expected_s) * _PROBE_EARLIER
        return done_s


class Pacing:
    """Expected durations per (operation, key) learned from this process's waits; an
    operation without one falls back to what the store recorded (`remember`), then to
    `seeds` (configured), else to fast polling."""

    def __init__(self, seeds: Mapping[str, float] | None = None) -> None:
        self._seeds = dict(seeds or {})
        self._estimates: dict[tuple[str, str], float] = {}
        self._recorded: dict[tuple[str, str], float] = {}

    def expected_s(self, operation: str, key: str) -> float | None:
        found = self._estimates.get((operation, key)) or self._recorded.get((operation, key))
        return found or self._seeds.get(operation)

    def remember(self, operation: str, key: str, durations: Iterable[float]) -> None:
        """Recorded durations of past steps doing this operation (newest first). A step
        also spent a request or two around its task, and steps of deploys that ran
        together took longer than one alone: the quickest recent one is the closest to
        the task itself. Too early costs a look or two; too late costs time."""
        recent = [d for d in durations if d > 0][:_RECORDED]
        if recent:
            self._recorded[(operation, key)] = max(min(recent), _MIN_STEP_S)

    def schedule(self, operation: str, key: str, timing: PollTiming) -> Schedule:
        return Schedule(self.expected_s(operation, key), timing)

    def learn(self, operation: str, key: str, schedule: Schedule, done_s: float) -> None:
        observed = schedule.observed_s(done_s)
        before = self._estimates.get((operation, key))
        self._estimates[(operation, key)] = (
            observed if before is None else before + _WEIGHT * (observed - before)
        )


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
