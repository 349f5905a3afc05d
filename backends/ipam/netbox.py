"""NetBox as the address manager, through pynetbox (NetBox's own client).

pynetbox is synchronous (requests): each call runs on a worker thread. A reservation is
an ip-address object taken with the prefix's (or, for a subnet with a `pool`, the IP
range's) `available-ips` endpoint, which NetBox serialises itself, so two processes
never get the same address. Each record says whose it is in its description
("deploybot <installation> job <id>: <name>"): release and activate refuse a record
that does not name the job (changed by hand), and reconciliation finds them by it.

NetBox 4 has no VLAN on an IP address: an address is in a prefix, and the prefix has the
VLAN (`Prefix.vlan`; NetBox's answer to "assign an IP to a VLAN", netbox#1234). With
`[ipam] vlan_field`, each reserved address also gets its prefix's VLAN in that custom
field (type Object, IPAM > VLAN), read with the prefix deploybot looks up anyway: no
call more per reservation.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import re
import socket
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar

import pynetbox
import requests

from backends.base import PermanentError, Unreachable
from backends.ipam.base import (
    AddressTaken,
    NotOurs,
    Pool,
    PoolExhausted,
    Record,
    Reservation,
    ReservedFor,
    Vlan,
)
from backends.ipam.config import IpamConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
_OWNER = re.compile(r"deploybot (?P<inst>[a-z0-9]+) job (?P<job>j[a-z0-9]+)")
_MAX_SKIPPED = 256  # reservations held back while looking for a free one


class _Session(requests.Session):
    """requests has no default timeout: a NetBox that stops answering must not hang a
    deploy (the caller retries an `Unreachable`)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout_s)
        return super().request(*args, **kwargs)


def description(reserved_for: ReservedFor) -> str:
    return f"deploybot {reserved_for.installation} job {reserved_for.job_id}: {reserved_for.name}"


class NetBox:
    name = "NetBox"

    def __init__(self, api: Any, config: IpamConfig) -> None:
        self.api = api
        self.config = config
        self._containers: dict[Pool, tuple[Any, int | None]] = {}
        # Each pool's VLAN (NetBox's id and what it is), None: its prefix has none.
        self._vlans: dict[Pool, tuple[int, Vlan] | None] = {}
        self._field_ready = False  # [ipam] vlan_field found right (asked until it is)

    @classmethod
    def create(cls, config: IpamConfig, environ: Mapping[str, str]) -> NetBox:
        token = environ.get(config.token_env, "")
        if not token:
            raise PermanentError(
                f"[ipam] provider = netbox needs the API token in the environment variable "
                f"{config.token_env}: set it (the token is never read from the file)"
            )
        assert config.url is not None  # IpamConfig requires it for netbox
        api = pynetbox.api(config.url.rstrip("/"), token=token)
        session = _Session(config.timeout_s)
        session.verify = str(config.ca_bundle) if config.ca_bundle else config.verify_tls
        api.http_session = session
        return cls(api, config)

    async def _call(self, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except pynetbox.RequestError as exc:
            raise self._refused(exc) from None
        except requests.exceptions.SSLError as exc:
            raise PermanentError(
                f"NetBox at {self.config.url}: its certificate is not trusted ({exc}); set "
                "[ipam] ca_bundle to the CA that signed it"
            ) from None
        except (requests.exceptions.RequestException, pynetbox.ContentError) as exc:
            # The whole chain (urllib3's pool, its retries, the socket) goes to the log;
            # the message says only what happened.
            log.warning("NetBox at %s: %r", self.config.url, exc)
            why = _why_unanswered(exc, self.config.timeout_s)
            raise Unreachable(f"NetBox at {self.config.url} did not answer ({why})") from None

    def _refused(self, exc: Any) -> PermanentError | Unreachable:
        status = int(getattr(exc.req, "status_code", 0))
        if status == 400 and self.config.vlan_field and "custom_fields" in _detail(exc):
            self._field_ready = False  # changed since it was checked: ask again next time
            return PermanentError(
                f"NetBox refused the VLAN in custom field {self.config.vlan_field!r} "
                f"({_detail(exc)}): {self._field_fix()}"
            )
        if status >= 500:
            return Unreachable(f"NetBox at {self.config.url} answered {status}")
        if status in (401, 403):
            return PermanentError(
                f"NetBox refused the token in {self.config.token_env} ({status}: "
                f"{_detail(exc)}): check that it is valid and may read prefixes and add, "
                "change and delete IP addresses (`deploybot check` tests it)"
            )
        return PermanentError(f"NetBox refused the request ({status}: {_detail(exc)})")

    # --- lookups --------------------------------------------------------------------

    def _container(self, pool: Pool) -> tuple[Any, int | None]:
        """The prefix (or IP range, for a pool) that next-free addresses come from, and
        the VRF id (None: the global table). Looked up once per process."""
        if pool in self._containers:
            return self._containers[pool]
        vrf_id = None
        if pool.ipam_vrf:
            vrf = self.api.ipam.vrfs.get(name=pool.ipam_vrf)
            if vrf is None:
                raise PermanentError(f"NetBox has no VRF {pool.ipam_vrf!r} (subnet {pool.name})")
            vrf_id = int(vrf.id)
        scope: dict[str, Any] = {"vrf_id": vrf_id if vrf_id is not None else "null"}
        if _whole(pool):
            prefix = pool.ipam_prefix or str(pool.cidr)
            found = list(self.api.ipam.prefixes.filter(prefix=prefix, **scope))
            what = f"prefix {prefix}"
        else:
            found = list(
                self.api.ipam.ip_ranges.filter(
                    start_address=f"{pool.first}/{pool.cidr.prefixlen}",
                    end_address=f"{pool.last}/{pool.cidr.prefixlen}",
                    **scope,
                )
            )
            what = f"IP range {pool.first}-{pool.last}"
        if not found:
            where = f" in VRF {pool.ipam_vrf}" if pool.ipam_vrf else ""
            raise PermanentError(
                f"NetBox has no {what}{where} for subnet {pool.name}: create it in NetBox "
                "(or set ipam_prefix/ipam_vrf on the subnet)"
            )
        self._containers[pool] = (found[0], vrf_id)
        return self._containers[pool]

    def _prefix(self, pool: Pool, vrf_id: int | None) -> Any | None:
        """The subnet's prefix, for a pool whose container is an IP range (a range has
        no VLAN of its own); None when NetBox has none (the range is enough to serve)."""
        scope: dict[str, Any] = {"vrf_id": vrf_id if vrf_id is not None else "null"}
        prefix = pool.ipam_prefix or str(pool.cidr)
        found = list(self.api.ipam.prefixes.filter(prefix=prefix, **scope))
        return found[0] if found else None

    def _pool_vlan(self, pool: Pool) -> tuple[int, Vlan] | None:
        """The VLAN of the pool's prefix: read from the prefix `_container` already
        holds (a range: its prefix, asked once). Once per process, like the prefix."""
        if pool in self._vlans:
            return self._vlans[pool]
        container, vrf_id = self._container(pool)
        prefix = container if _whole(pool) else self._prefix(pool, vrf_id)
        nested = getattr(prefix, "vlan", None) if prefix is not None else None
        found = None
        if nested is not None:
            found = (int(nested.id), Vlan(int(nested.vid), str(getattr(nested, "name", "") or "")))
        self._vlans[pool] = found
        return found

    def _field_fix(self) -> str:
        return (
            f"create custom field {self.config.vlan_field} of type Object (related object "
            "type IPAM > VLAN) on IPAM > IP address, or unset [ipam] vlan_field"
        )

    def _field_problem(self) -> str | None:
        """What is wrong with `[ipam] vlan_field` in NetBox: missing, not on IP
        addresses, not an Object field of VLANs, or not live yet; None: ready."""
        name = self.config.vlan_field
        try:
            field = self.api.extras.custom_fields.get(name=name)
        except pynetbox.RequestError as exc:
            if int(getattr(exc.req, "status_code", 0)) not in (401, 403):
                raise
            return (
                f"NetBox refused to show custom field {name!r} to the token in "
                f"{self.config.token_env}: give its user permission to view custom fields, "
                "or unset [ipam] vlan_field"
            )
        if field is None:
            return f"NetBox has no custom field {name!r}: {self._field_fix()}"
        kind = str(getattr(field.type, "value", field.type))
        related = str(field.related_object_type or "")
        if "ipam.ipaddress" not in [str(t) for t in field.object_types or ()]:
            on = ", ".join(str(t) for t in field.object_types or ()) or "nothing"
            return (
                f"NetBox's custom field {name!r} is not on IP addresses (it is on {on}): add "
                "IPAM > IP address to its object types, or unset [ipam] vlan_field"
            )
        if kind != "object" or related != "ipam.vlan":
            label = str(getattr(field.type, "label", kind)) + (f" ({related})" if related else "")
            return (
                f"NetBox's custom field {name!r} is of type {label}, not Object (IPAM > "
                f"VLAN): {self._field_fix()}"
            )
        status = str(getattr(getattr(field, "status", None), "value", "active"))
        if status != "active":
            return (
                f"NetBox's custom field {name!r} is not live yet (status {status}: a NetBox "
                "background job is updating its data); it is used once that job is done"
            )
        return None

    def _vlan_to_record(self, pool: Pool) -> int | None:
        """NetBox's id of the VLAN a reservation in `pool` records, None: none (no
        `vlan_field`, or the prefix has no VLAN). The field is checked once a process."""
        if not self.config.vlan_field:
            return None
        found = self._pool_vlan(pool)
        if found is None:
            return None
        if not self._field_ready:
            problem = self._field_problem()
            if problem is not None:
                raise PermanentError(problem)
            self._field_ready = True
        return found[0]

    def _fields(
        self, reserved_for: ReservedFor, vrf_id: int | None, vlan_id: int | None
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "status": "reserved",
            "dns_name": reserved_for.dns_name,
            "description": description(reserved_for),
            "tags": [{"slug": tag} for tag in self.config.tags],
        }
        if vrf_id is not None:
            fields["vrf"] = vrf_id
        if vlan_id is not None:
            fields["custom_fields"] = {self.config.vlan_field: vlan_id}
        return fields

    def _at(self, address: ipaddress.IPv4Address, vrf_id: int | None) -> list[Any]:
        scope = {"vrf_id": vrf_id if vrf_id is not None else "null"}
        return list(self.api.ipam.ip_addresses.filter(address=str(address), **scope))

    # --- the contract ---------------------------------------------------------------

    async def reserve(
        self,
        pool: Pool,
        reserved_for: ReservedFor,
        *,
        address: ipaddress.IPv4Address | None = None,
        skip: frozenset[ipaddress.IPv4Address] = frozenset(),
    ) -> Reservation:
        return await self._call(
            lambda: self._reserve(pool, reserved_for, address, skip | pool.excluded)
        )

    def _reserve(
        self,
        pool: Pool,
        reserved_for: ReservedFor,
        address: ipaddress.IPv4Address | None,
        skip: frozenset[ipaddress.IPv4Address],
        *,
        record_vlan: bool = True,
    ) -> Reservation:
        container, vrf_id = self._container(pool)
        vlan_id = self._vlan_to_record(pool) if record_vlan else None
        fields = self._fields(reserved_for, vrf_id, vlan_id)
        if address is not None:
            taken = [r for r in self._at(address, vrf_id) if not _names(r, reserved_for)]
            if taken:
                who = _who(taken[0])
                raise AddressTaken(f"{address} is recorded in NetBox as {who}", holder=who)
            made = self.api.ipam.ip_addresses.create(
                {**fields, "address": f"{address}/{pool.cidr.prefixlen}"}
            )
            return Reservation(address, str(made.id))
        held_back: list[Any] = []  # taken elsewhere: kept until one is found, then freed
        try:
            for _ in range(_MAX_SKIPPED):
                made = container.available_ips.create(fields)
                if not made:
                    break
                record = made[0] if isinstance(made, list) else made
                ip = ipaddress.IPv4Interface(record.address).ip
                if ip not in skip:
                    return Reservation(ip, str(record.id))
                held_back.append(record)
        except pynetbox.AllocationError:
            pass  # 409: the prefix (or range) has no free address left
        except pynetbox.RequestError as exc:
            if int(getattr(exc.req, "status_code", 0)) not in (204, 409):
                raise
        finally:
            for record in held_back:
                record.delete()
        raise PoolExhausted(f"NetBox has no free address left in {pool.name}")

    async def holder(self, pool: Pool, address: ipaddress.IPv4Address, job_id: str) -> str | None:
        def find() -> str | None:
            _, vrf_id = self._container(pool)
            others = [r for r in self._at(address, vrf_id) if _owner(r)[1] != job_id]
            return _who(others[0]) if others else None

        return await self._call(find)

    def _owned(self, ref: str, reserved_for: ReservedFor) -> Any:
        record = self.api.ipam.ip_addresses.get(int(ref))
        if record is not None and not _names(record, reserved_for):
            raise NotOurs(
                f"NetBox ip-address {ref} no longer names job {reserved_for.job_id} of "
                f"installation {reserved_for.installation}"
            )
        return record

    async def activate(self, ref: str, reserved_for: ReservedFor) -> None:
        def mark() -> None:
            record = self._owned(ref, reserved_for)
            if record is None:  # removed by hand: the VM works; say so in the log
                log.warning("NetBox ip-address %s of job %s is gone", ref, reserved_for.job_id)
                return
            record.update({"status": "active"})

        await self._call(mark)

    async def release(self, ref: str, reserved_for: ReservedFor) -> None:
        def delete() -> None:
            record = self._owned(ref, reserved_for)
            if record is not None:
                record.delete()

        await self._call(delete)

    async def records(self, installation: str) -> list[Record]:
        def find() -> list[Record]:
            found = self.api.ipam.ip_addresses.filter(
                description__ic=f"deploybot {installation} job "
            )
            out = []
            for r in found:
                match = _OWNER.search(str(r.description or ""))
                if match is None or match["inst"] != installation:
                    continue
                out.append(
                    Record(
                        ref=str(r.id),
                        address=ipaddress.IPv4Interface(r.address).ip,
                        job_id=match["job"],
                        status=str(getattr(r.status, "value", r.status)),
                        created=datetime.fromisoformat(str(r.created).replace("Z", "+00:00")),
                    )
                )
            return out

        return await self._call(find)

    async def vlan(self, pool: Pool) -> Vlan | None:
        def find() -> Vlan | None:
            found = self._pool_vlan(pool)
            return found[1] if found is not None else None

        return await self._call(find)

    async def problems(self, pools: list[Pool]) -> list[str]:
        """Each pool's prefix or range exists, the tags exist, `vlan_field` is a custom
        field that can hold a VLAN, and the token may add and delete an address (one is
        reserved, with its VLAN, and deleted at once, named as a check)."""
        out = []
        for tag in self.config.tags:
            found = await self._call(functools.partial(self.api.extras.tags.get, slug=tag))
            if found is None:
                out.append(f"NetBox has no tag {tag!r}: create it, or set [ipam] tags = []")
        field_problem = None
        if self.config.vlan_field:
            field_problem = await self._call(self._field_problem)
            out += [field_problem] if field_problem else []
            self._field_ready = field_problem is None
        reserved_for = ReservedFor("jcheck00", "check", "deploybot-check", "deploybot-check")
        for pool in pools:
            try:
                # With the field wrong, every probe would only say so again: probe the rest.
                probe = functools.partial(self._reserve, pool, reserved_for, None, pool.excluded)
                made = await self._call(functools.partial(probe, record_vlan=not field_problem))
                await self.release(str(made.ref), reserved_for)
            except PoolExhausted:
                continue  # full, but reachable and writable enough to say so
            except (PermanentError, Unreachable) as exc:
                out.append(f"subnet {pool.name}: {exc.message}")
        return out

    async def close(self) -> None:
        self.api.http_session.close()


def _why_unanswered(exc: BaseException, timeout_s: float) -> str:
    """What went wrong under requests' and urllib3's wrappers, in a few words: the
    socket's error, a timeout, or a body that is not NetBox's JSON."""
    if isinstance(exc, pynetbox.ContentError):
        return "its answer was not NetBox's JSON: is the URL NetBox's?"
    if isinstance(exc, requests.exceptions.Timeout):
        return f"no answer within {timeout_s:g} s"
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, socket.gaierror):
            return "its host name does not resolve"
        if isinstance(link, ConnectionRefusedError):
            return "connection refused: nothing listens at that address and port"
        if isinstance(link, OSError) and link.strerror:
            return str(link.strerror).lower()
        reason = getattr(link, "reason", None)  # urllib3's MaxRetryError holds the cause
        link = reason if isinstance(reason, BaseException) else link.__cause__ or link.__context__
    return type(exc).__name__


def _whole(pool: Pool) -> bool:
    """Whether the pool is its whole subnet (addresses come from the prefix), not an IP
    range of it."""
    return pool.first == pool.cidr.network_address and pool.last == pool.cidr.broadcast_address


def _owner(record: Any) -> tuple[str, str] | tuple[None, None]:
    """The installation and the job a record's description names."""
    match = _OWNER.search(str(record.description or ""))
    return (match["inst"], match["job"]) if match else (None, None)


def _names(record: Any, reserved_for: ReservedFor) -> bool:
    """Whether the record is this job's, of this installation: a job id alone is
    random, but another installation's record is never ours to release."""
    return _owner(record) == (reserved_for.installation, reserved_for.job_id)


def _who(record: Any) -> str:
    status = getattr(record.status, "value", record.status)
    name = record.dns_name or record.description or "no name"
    return f"{name} ({status}, ip-address {record.id})"


def _detail(exc: Any) -> str:
    try:
        body = exc.req.json()
    except ValueError:
        return str(getattr(exc.req, "reason", "")) or "no detail"
    return str(body.get("detail", body)) if isinstance(body, dict) else str(body)
