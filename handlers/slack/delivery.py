"""The parts of notices in Slack delivery: the count of parts each notice still waits
for, which parts an earlier process already put in Slack, and what to record in the
store. Each part is recorded as it reaches Slack, so a restart repeats only the others;
a notice is marked delivered once every part is. `SlackThreads` (threads.py) holds one
`Parts` and gives it to the build delivery (buildthreads.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from bot.models.notices import Notice
from handlers.slack.items import Part


class Parts:
    """What notices wait for. `wake` is called whenever there is something to record."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._waiting: Counter[int] = Counter()  # notice id -> parts not yet in Slack
        self._sent_before: dict[int, frozenset[str]] = {}  # parts a restart must not repeat
        self._sent: list[tuple[int, str]] = []  # parts in Slack, to record in the store
        self._delivered: list[int] = []  # to mark in the store
        # Given to the store by `to_record`, until it confirms (`recorded`) or fails.
        self._recording: tuple[list[int], list[tuple[int, str]]] = ([], [])
        self._jobs: dict[int, str] = {}  # notice id -> its job (or build), until recorded

    def hold(self, notice: Notice) -> int:
        """While a notice's parts are being queued, none may finish it early."""
        assert notice.id is not None
        self._waiting[notice.id] += 1
        self._sent_before[notice.id] = notice.sent
        self._jobs[notice.id] = notice.job_id
        return notice.id

    def release(self, notice: int) -> None:
        self._sent_before.pop(notice, None)
        self._settle(notice)

    def part(self, notice: int, name: str) -> Part | None:
        """A part of `notice` to put in Slack; None when Slack has it already (an earlier
        process delivered it before it stopped)."""
        if name in self._sent_before.get(notice, ()):
            return None
        self._waiting[notice] += 1
        return Part(notice, name)

    def done(self, parts: list[Part]) -> None:
        """Slack took `parts` (the `Done` callback of threads, cards and messages)."""
        for part in parts:
            self._sent.append((part.notice, part.name))
            self._settle(part.notice)
        self._wake()  # recorded at once: a kill now must not repeat it

    def _settle(self, notice: int) -> None:
        self._waiting[notice] -= 1
        if self._waiting[notice] <= 0:
            self.finish([notice])

    def finish(self, ids: list[int]) -> None:
        """These notices wait for nothing more (all said, or nothing can be shown)."""
        for notice in ids:
            self._waiting.pop(notice, None)
            self._delivered.append(notice)
        self._wake()

    def applying(self, notice: int) -> bool:
        """Whether this process is putting `notice` in Slack already."""
        return notice in self._waiting

    def nothing_to_record(self) -> bool:
        return not self._delivered and not self._sent

    def to_record(self) -> tuple[list[int], list[tuple[int, str]]]:
        """The notices delivered and the parts sent since last asked, to record; then
        `recorded` or `not_recorded` says how the store took them."""
        ids, self._delivered = self._delivered, []
        parts, self._sent = self._sent, []
        self._recording = (ids, parts)
        return ids, parts

    def recorded(self) -> None:
        ids, _parts = self._recording
        for notice in ids:
            self._jobs.pop(notice, None)
        self._recording = ([], [])

    def not_recorded(self) -> None:
        """The store did not take what `to_record` gave (it was away): keep it for the
        next try. Forgotten, those parts would be in Slack but not in the store, and
        whoever next delivers the job (a replica, after this claim lapsed) says them
        again. Recording twice is harmless: parts are a set, delivery a timestamp."""
        ids, parts = self._recording
        self._delivered[:0] = ids
        self._sent[:0] = parts
        self._recording = ([], [])

    def quiet(self, job_id: str) -> bool:
        """Nothing of this job's (or build's) notices waits for Slack, nor for the store
        to record it: only then may its delivery claim go, else whoever claims it next
        says again what Slack has."""
        ids, parts = self._recording
        sent = (notice for notice, _name in (*self._sent, *parts))
        notices = {*self._waiting, *self._delivered, *ids, *sent}
        return all(self._jobs.get(notice) != job_id for notice in notices)

    def forget(self, job_id: str) -> set[int]:
        """Stop waiting for this job's notices (another process delivers them now); what
        Slack already has is still recorded. The notices forgotten."""
        gone = {n for n in self._waiting if self._jobs.get(n) == job_id}
        for notice in gone:
            del self._waiting[notice]
            self._sent_before.pop(notice, None)
        return gone

    def settled(self) -> bool:
        """Nothing waits for Slack and nothing is left to record as delivered."""
        return not self._waiting and not self._delivered
