# mypy: disable-error-code="no-untyped-call"
# (pyvmomi is typed, but the constructors of its data objects are not)
"""The logged-in connection as the blocking code sees it: the SOAP stub (call and byte
counts, re-login) and property reads through container views kept for the session.

A container view is a server-side object of the session: creating and destroying one
per lookup cost two round trips each time, so `Conn.contained` keeps one per (root,
type) and reads through it with the session's own PropertyCollector. A view belongs to
the login that made it: after a re-login (or if the server dropped it) it is made
again. The same goes for the idle PropertyCollectors that waits reuse
(`Conn.take_collector`) and for `Tracker`s, which mirror a few properties of every VM
and learn only what changed (`Conn.tracked`), so that checks over every VM cost the
same whatever the size of the inventory.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pyVmomi import vim, vmodl
from pyVmomi.SoapAdapter import StubAdapterBase

log = logging.getLogger(__name__)
T = TypeVar("T")
Props = dict[str, Any]
Row = tuple[Any, Props]
QUIET = (vmodl.MethodFault, OSError, http.client.HTTPException)
# Filters on ended tasks an idle PropertyCollector may keep (see `Conn.take_collector`);
# a new waiter's first answer repeats their final state, a few hundred bytes each.
MAX_ENDED_FILTERS = 8


class _CountedResponse(http.client.HTTPResponse):
    """An HTTP response that adds the body bytes read to its stub's count."""

    counter: Callable[[int], None] | None = None

    def read(self, amt: int | None = None) -> bytes:
        data = super().read(amt)
        if self.counter is not None:
            self.counter(len(data))
        return data


class Stub(StubAdapterBase):
    """The session's SOAP stub: counts calls and bytes, and logs in again when the
    session expired.

    A call refused with NotAuthenticated did nothing on the server, so repeating it
    after a new login is safe; concurrent callers that all saw the expiry log in once.
    Bytes are counted at the transport (request bodies sent, response bodies read), so
    the benchmark and tests see what a lookup really costs on the wire.
    """

    def __init__(self, soap: Any, login: Callable[[Stub], None]) -> None:
        super().__init__(version=soap.version)
        self.soap = soap
        self.calls: Counter[str] = Counter()
        self.bytes = Counter[str]()  # "sent" and "received"
        self.generation = 0
        # What the last Login answered (a UserSession: key, userName), so asking for the
        # session's privileges reads no property of the SessionManager.
        self.user_session: Any = None
        self._login = login
        self._count_lock = threading.Lock()
        self._login_lock = threading.Lock()  # held while logging in, which makes calls
        soap.requestModifierList.append(self._count_request)
        connection = soap.GetConnection

        def counted_connection() -> Any:
            conn = connection()
            conn.response_class = type(
                "Counted", (_CountedResponse,), {"counter": staticmethod(self._count_response)}
            )
            return conn

        soap.GetConnection = counted_connection

    def _count_request(self, body: Any) -> Any:
        with self._count_lock:
            self.bytes["sent"] += len(body)
        return body

    def _count_response(self, size: int) -> None:
        with self._count_lock:
            self.bytes["received"] += size

    def InvokeMethod(self, mo: Any, info: Any, args: Any) -> Any:  # pyvmomi names it
        for attempt in (1, 2):
            generation = self.generation
            with self._count_lock:
                self.calls[info.wsdlName] += 1
            status, result = self.soap.InvokeMethod(mo, info, args, self)
            if status == 200:
                return result
            expired = isinstance(result, vim.fault.NotAuthenticated)
            if attempt == 1 and expired and info.wsdlName != "Login":
                self.login_again(generation)
                continue
            raise result
        raise AssertionError("unreachable")

    def login_again(self, generation: int) -> None:
        with self._login_lock:
            if generation == self.generation:
                log.info("vSphere session expired; logging in again")
                self._login(self)
                self.generation += 1

    def with_session(self, call: Callable[[], T]) -> T:
        """For answers that report NotAuthenticated inside a result (property reads)."""
        generation = self.generation
        try:
            return call()
        except vim.fault.NotAuthenticated:
            self.login_again(generation)
            return call()


@dataclass
class Conn:
    """The logged-in session as the blocking code sees it."""

    stub: Stub
    content: Any
    vcenter: bool
    _views: dict[tuple[str, str], Any] = field(default_factory=dict)
    _views_login: int = 0
    _views_lock: threading.Lock = field(default_factory=threading.Lock)
    _idle_collectors: list[tuple[Any, int]] = field(default_factory=list)
    _collectors_login: int = 0
    _trackers: dict[tuple[str, str, tuple[str, ...]], Tracker] = field(default_factory=dict)

    def collect(self, spec: Any) -> list[Row]:
        return self.stub.with_session(lambda: self._collect_once(spec))

    def _collect_once(self, spec: Any) -> list[Row]:
        pc = self.content.propertyCollector
        result = pc.RetrievePropertiesEx([spec], vmodl.query.PropertyCollector.RetrieveOptions())
        rows: dict[str, Row] = {}  # by id: vcsim lists some objects twice
        while result is not None:
            for content in result.objects:
                for missing in content.missingSet or []:
                    # A property we may not read stays absent; only a lost session is an
                    # error. (pyvmomi gives the MethodFault itself for the
                    # LocalizedMethodFault of the schema, whose `fault` it would be.)
                    fault = getattr(missing.fault, "fault", missing.fault)
                    if isinstance(fault, vim.fault.NotAuthenticated):
                        raise fault
                props = {p.name: p.val for p in content.propSet or []}
                rows[content.obj._moId] = (content.obj, props)
            token = result.token
            result = pc.ContinueRetrievePropertiesEx(token) if token else None
        return list(rows.values())

    def retrieve(self, objs: list[Any], kind: Any, paths: list[str]) -> list[Row]:
        if not objs:
            return []
        query = vmodl.query.PropertyCollector
        spec = query.FilterSpec(
            objectSet=[query.ObjectSpec(obj=obj, skip=False) for obj in objs],
            propSet=[query.PropertySpec(type=kind, pathSet=paths, all=False)],
        )
        return self.collect(spec)

    def props(self, obj: Any, kind: Any, paths: list[str]) -> Props:
        rows = self.retrieve([obj], kind, paths)
        return rows[0][1] if rows else {}

    def contained(
        self, root: Any, kind: Any, paths: list[str], more: tuple[tuple[Any, list[str]], ...] = ()
    ) -> list[Row]:
        """Every object of `kind` under `root`, with `paths` (and, for objects of a
        subtype in `more`, its paths too), in one read (two when the session's view of
        them has to be made first)."""
        for attempt in (1, 2):
            view = self._view(root, kind)
            try:
                return self.collect(_through(view, ((kind, paths), *more)))
            except vmodl.fault.ManagedObjectNotFound as fault:
                # The view went with an old login, or the root object went: forget the
                # view and try once with a new one (which fails if the root is gone).
                self._forget(root, kind, view)
                if attempt == 2 or getattr(fault, "obj", None) != view:
                    raise
        raise AssertionError("unreachable")

    def _view(self, root: Any, kind: Any) -> Any:
        key = (root._moId, kind._wsdlName)
        with self._views_lock:
            if self._views_login != self.stub.generation:  # a new login: views are gone
                self._views, self._views_login = {}, self.stub.generation
            view = self._views.get(key)
            if view is None:
                manager = self.content.viewManager
                view = manager.CreateContainerView(root, [kind], True)
                self._views[key] = view
            return view

    def _forget(self, root: Any, kind: Any, view: Any) -> None:
        with self._views_lock:
            key = (root._moId, kind._wsdlName)
            if self._views.get(key) is view:
                del self._views[key]

    def take_collector(self) -> tuple[Any, int, int]:
        """A PropertyCollector for one waiter alone, the login it belongs to, and how
        many filters of ended tasks it holds.

        Waiters sharing a collector would steal each other's updates, but an idle one
        can serve the next waiter: reusing them saves a CreatePropertyCollector and a
        DestroyPropertyCollector per wait. A filter on a task that ended may stay on it
        (the task changes no more, so it sends nothing): destroying the collector once
        every MAX_ENDED_FILTERS waits is cheaper than a DestroyPropertyFilter per wait.
        """
        with self._views_lock:
            if self._collectors_login != self.stub.generation:  # gone with the old login
                self._idle_collectors, self._collectors_login = [], self.stub.generation
            if self._idle_collectors:
                collector, ended = self._idle_collectors.pop()
                return collector, self._collectors_login, ended
        collector = self.content.propertyCollector.CreatePropertyCollector()
        return collector, self.stub.generation, 0

    def give_back(self, collector: Any, login: int, ended: int) -> None:
        """Keep a collector whose only filters are on `ended` tasks for the next waiter
        of the same login, or destroy it (with them) when they are many."""
        with self._views_lock:
            if login != self.stub.generation:
                return  # it went with the login that made it
            if ended < MAX_ENDED_FILTERS and login == self._collectors_login:
                self._idle_collectors.append((collector, ended))
                return
        with contextlib.suppress(*QUIET):
            collector.DestroyPropertyCollector()

    def tracked(self, root: Any, kind: Any, paths: list[str]) -> dict[str, Row]:
        """Every object of `kind` under `root` with `paths`, by id, as a `Tracker` of the
        session keeps them: one request, whose answer holds only what changed."""
        key = (root._moId, kind._wsdlName, tuple(paths))
        with self._views_lock:
            tracker = self._trackers.setdefault(key, Tracker(self, root, kind, paths))
        return tracker.sync()

    def find_vm(self, instance_uuid: str) -> Any | None:
        return self.content.searchIndex.FindByUuid(None, instance_uuid, True, True)

    def find_path(self, path: str) -> Any | None:
        return self.content.searchIndex.FindByInventoryPath(path)


class Tracker:
    """A mirror of some properties of every object of a kind under a root, kept up to
    date through a PropertyCollector filter of its own on the session's view of them.

    The first `sync` reads them all (once per login); each later one is a single
    `WaitForUpdatesEx` that returns at once (maxWaitSeconds 0) with the objects that
    came, went or changed since the last, so a name or MAC check costs the same
    request and bytes whatever the size of the inventory. vSphere has no server-side
    filter by name; this is how its own clients keep an inventory without re-reading it.
    """

    def __init__(self, conn: Conn, root: Any, kind: Any, paths: list[str]) -> None:
        self.conn, self.root, self.kind, self.paths = conn, root, kind, paths
        # One look at a time (updates follow a version); callers that come while one
        # runs share the next, which starts after they came (`sync`).
        self._turn = threading.Condition()
        self._started = self._finished = 0
        self._running = False
        self._collector: Any = None
        self._view: Any = None
        self._login = -1
        self._version = ""
        self._rows: dict[str, Row] = {}

    def sync(self) -> dict[str, Row]:
        """The rows as they are now: after a look that started after this call."""
        with self._turn:
            wanted = self._started + 1  # a look already under way may be too early
            while self._finished < wanted:
                if self._running:
                    self._turn.wait()
                    continue
                self._running, self._started = True, self._started + 1
                number = self._started
                try:
                    self._turn.release()
                    try:
                        self._look()
                    finally:
                        self._turn.acquire()
                    self._finished = number
                finally:
                    self._running = False
                    self._turn.notify_all()
            return dict(self._rows)

    def _look(self) -> None:
        for attempt in (1, 2):
            if self._collector is None or self._login != self.conn.stub.generation:
                self._start()
            try:
                self._pull()
                return
            except (vmodl.fault.ManagedObjectNotFound, vmodl.query.InvalidCollectorVersion):
                # The collector or view went (with a login, or dropped by the server),
                # or it lost our version: start again from a full read, on a new view.
                self.conn._forget(self.root, self.kind, self._view)
                with contextlib.suppress(*QUIET):  # if it is still there at all
                    self._collector.DestroyPropertyCollector()
                self._collector = None
                if attempt == 2:
                    raise

    def _start(self) -> None:
        login = self.conn.stub.generation
        pc = self.conn.content.propertyCollector.CreatePropertyCollector()
        self._view = view = self.conn._view(self.root, self.kind)
        pc.CreateFilter(_through(view, ((self.kind, self.paths),)), False)
        self._collector, self._login, self._version = pc, login, ""
        with self._turn:
            self._rows = {}

    def _pull(self) -> None:
        options = vmodl.query.PropertyCollector.WaitOptions(maxWaitSeconds=0)
        while True:
            update = self._collector.WaitForUpdatesEx(self._version, options)
            if update is None:  # nothing changed since the last version
                return
            self._version = update.version
            with self._turn:  # callers served by an earlier look copy the rows meanwhile
                for filter_update in update.filterSet or []:
                    for change in filter_update.objectSet or []:
                        self._apply(change)
            if not update.truncated:  # a large first answer comes in parts
                return

    def _apply(self, change: Any) -> None:
        obj, key = change.obj, change.obj._moId
        if change.kind == "leave":
            self._rows.pop(key, None)
            return
        props = dict(self._rows[key][1]) if key in self._rows else {}
        for prop in change.changeSet or []:
            if prop.op in ("remove", "indirectRemove"):
                props.pop(prop.name, None)
            else:
                props[prop.name] = prop.val
        self._rows[key] = (obj, props)


def _through(view: Any, props: tuple[tuple[Any, list[str]], ...]) -> Any:
    """A filter spec reading, of every object in a container view, the paths its type
    has in `props`."""
    query = vmodl.query.PropertyCollector
    view_type = vim.view.ContainerView
    traverse = query.TraversalSpec(name="view", type=view_type, path="view", skip=False)
    return query.FilterSpec(
        objectSet=[query.ObjectSpec(obj=view, skip=True, selectSet=[traverse])],
        propSet=[query.PropertySpec(type=k, pathSet=p, all=False) for k, p in props],
    )
