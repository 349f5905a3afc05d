"""Requests and jobs as data: pydantic models that map one to one onto store rows."""

from __future__ import annotations

import ipaddress
import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bot.models.ids import JOB_ID_RE, SHORT_ID_LENGTH, new_job_id

# Both are matched only after the value was found to be ASCII (`not_ascii`): with
# re.IGNORECASE, U+0130, U+0131, U+017F and U+212A (dotted I, dotless i, long s, Kelvin)
# match i, i, s and k, and lower() turns U+0130 into "i" plus a combining dot.
HOSTNAME_RE = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$", re.IGNORECASE)
# A MAC address as typed: six pairs of hex digits, by colons or hyphens (stored lower-case
# with colons).
MAC_RE = re.compile(r"^[0-9a-f]{2}([:-])[0-9a-f]{2}(?:\1[0-9a-f]{2}){4}$", re.IGNORECASE)
LOGIN_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


# The least memory a VM is given (cloud-init and sshd need about this much to boot).
MIN_MEMORY_MIB = 256


def check_login_name(value: str) -> str:
    """A login name cloud-init can create (a request's `user=`, and `[defaults] user`)."""
    odd = not_ascii(value)
    if odd is not None:
        raise ValueError(
            f"{value!r} is not a valid login name: {odd} is not an ASCII character; "
            "use ASCII lower-case letters a-z, digits, _ and - (e.g. ubuntu)"
        )
    if not LOGIN_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a valid login name: start with a lower-case letter or _, "
            "then up to 31 lower-case letters, digits, _ or - (e.g. ubuntu)"
        )
    return value


def not_ascii(value: str) -> str | None:
    """The first character of `value` that is not ASCII, described for a person; None
    when it is all ASCII. U+ notation, because the character may be invisible."""
    for char in value:
        if not char.isascii():
            return f"{char!r} (U+{ord(char):04X})"
    return None


def utcnow() -> datetime:
    return datetime.now(UTC)


class JobState(StrEnum):
    AWAITING_APPROVAL = "awaiting_approval"
    QUEUED = "queued"
    RUNNING = "running"
    ROLLING_BACK = "rolling_back"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    EXPIRED = "expired"
    RELEASED = "released"  # succeeded, and its VM has since gone: the name is free again
    # The other half of the life cycle (bot/kinds/deploy/destroy.py): a destroy that waits for an
    # approver, one under way (owned and claimed like a running deploy), and its end.
    DESTROY_REQUESTED = "destroy_requested"
    DESTROYING = "destroying"
    DESTROYED = "destroyed"
    # A lease that ended (bot/leases/enforce.py): the VM is powered off, not destroyed, until
    # the grace period ends (then destroying) or someone extends it (back to succeeded).
    EXPIRED_OFF = "expired_off"

    @property
    def final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset(
    {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.REJECTED,
        JobState.EXPIRED,
        JobState.RELEASED,
        JobState.DESTROYED,
    }
)
# Jobs in flight.
ACTIVE_STATES = frozenset(
    {JobState.AWAITING_APPROVAL, JobState.QUEUED, JobState.RUNNING, JobState.ROLLING_BACK}
)
# A succeeded job's VM on its way out: it still exists, so the job keeps its name and address.
DESTROY_STATES = frozenset({JobState.DESTROY_REQUESTED, JobState.DESTROYING, JobState.EXPIRED_OFF})
# The states in which a job holds its VM name (per backend) and its address: the store's
# unique indexes enforce it (store/migrations.py spells the same list).
HOLDING_STATES = ACTIVE_STATES | {JobState.SUCCEEDED} | DESTROY_STATES
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.AWAITING_APPROVAL: frozenset(
        {JobState.QUEUED, JobState.REJECTED, JobState.EXPIRED, JobState.CANCELLED}
    ),
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    # running -> queued: put back to resume after a restart (settings.recovery).
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.ROLLING_BACK, JobState.QUEUED}),
    JobState.ROLLING_BACK: frozenset({JobState.FAILED, JobState.CANCELLED}),
    # A destroy: at once, or once approved. A refused or failed one (the VM lost its tag,
    # the hypervisor said no) leaves the VM there, so the job is back to succeeded.
    # A lease that ends powers the VM off (expired_off); after the grace period it is
    # destroyed, unless extended first (back to succeeded, powered on again).
    JobState.SUCCEEDED: frozenset(
        {JobState.RELEASED, JobState.DESTROY_REQUESTED, JobState.DESTROYING, JobState.EXPIRED_OFF}
    ),
    # Destroyed by the timer after the grace, or asked for sooner (Destroy now).
    JobState.EXPIRED_OFF: frozenset(
        {JobState.DESTROYING, JobState.SUCCEEDED, JobState.DESTROY_REQUESTED}
    ),
    JobState.DESTROY_REQUESTED: frozenset({JobState.DESTROYING, JobState.SUCCEEDED}),
    JobState.DESTROYING: frozenset({JobState.DESTROYED, JobState.SUCCEEDED}),
}


class IpamState(StrEnum):
    RESERVED = "reserved"
    ACTIVE = "active"
    RELEASED = "released"


class HostKeySource(StrEnum):
    """How a job's host key was confirmed to be its new VM's (issue 28)."""

    AGENT = "agent"  # presented over SSH and read through the hypervisor's channel (agent)
    CHOSEN = "chosen"  # deploybot chose it and the hypervisor installed it
    SSH = "ssh"  # only seen over SSH: nothing outside the network could confirm it


class ApprovalState(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"  # the requester (or an approver) cancelled the job first


def normal_mac(value: str) -> str:
    """`value` as aa:bb:cc:dd:ee:ff (lower case, colons), or ValueError saying why it is
    not one: a unicast address the hypervisor can give a NIC (not multicast, not all zero)."""
    if not value.isascii() or not MAC_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a MAC address: write six pairs of hex digits, like 52:54:00:12:34:56"
        )
    mac = value.lower().replace("-", ":")
    if int(mac[:2], 16) & 1:
        raise ValueError(
            f"{mac} is a multicast MAC address (its first byte is odd): a NIC needs a unicast "
            "one, like 52:54:00:12:34:56"
        )
    if mac == "00:00:00:00:00:00":
        raise ValueError(f"{mac} is not a usable MAC address: give a NIC's, like 52:54:00:12:34:56")
    return mac


class NicRequest(BaseModel):
    """One NIC after the first (net1, net2, ...): its address in its subnet, and what the
    subnet says of it. `gateway` only when its subnet says `gateway_when_not_first`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: ipaddress.IPv4Interface
    subnet: str  # the subnet's name (or CIDR when unnamed), as DeployRequest.subnet
    gateway: ipaddress.IPv4Address | None = None
    dns: tuple[ipaddress.IPv4Address, ...] = ()
    search_domain: str = ""
    mac: str | None = None  # normalised lower-case aa:bb:cc:dd:ee:ff
    picked: bool = False  # the next free address of its subnet

    @field_validator("mac")
    @classmethod
    def _mac(cls, value: str | None) -> str | None:
        return None if value is None else normal_mac(value)


class DeployRequest(BaseModel):
    """One validated `/deploy`: everything the pipeline needs, nothing it has to look up."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    address: ipaddress.IPv4Interface
    gateway: ipaddress.IPv4Address
    dns: tuple[ipaddress.IPv4Address, ...] = ()
    search_domain: str = ""
    template: str
    backend: str
    placement: str | None = None
    storage: str | None = None
    network: str | None = None
    cores: int = Field(ge=1)
    memory_mib: int = Field(ge=MIN_MEMORY_MIB)
    disk_grow_gib: int = Field(default=0, ge=0)
    user: str
    ssh_keys: tuple[str, ...] = ()
    upgrade: bool = False
    requester: str = Field(min_length=1)
    # The address was not asked for: deploybot took the next free one of `subnet`.
    picked: bool = False
    subnet: str = ""
    # The second, third ... NIC (net1, net2, ...), and the first NIC's fixed MAC (None:
    # the hypervisor makes one).
    nics: tuple[NicRequest, ...] = ()
    mac: str | None = None

    @property
    def addresses(self) -> tuple[ipaddress.IPv4Interface, ...]:
        """Every NIC's address, the first NIC's first."""
        return (self.address, *(nic.address for nic in self.nics))

    @property
    def macs(self) -> tuple[str, ...]:
        """Every fixed MAC of the request, the first NIC's first."""
        return tuple(m for m in (self.mac, *(nic.mac for nic in self.nics)) if m is not None)

    @field_validator("mac")
    @classmethod
    def _mac(cls, value: str | None) -> str | None:
        return None if value is None else normal_mac(value)

    @field_validator("name")
    @classmethod
    def _hostname(cls, value: str) -> str:
        odd = not_ascii(value)
        if odd is not None:
            raise ValueError(
                f"{value!r} is not a valid host name: {odd} is not an ASCII character; "
                "use ASCII letters a-z, digits and hyphens (e.g. web01)"
            )
        if not HOSTNAME_RE.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a valid host name: use 1-63 letters, digits or hyphens, "
                "not starting or ending with a hyphen (e.g. web01)"
            )
        return value.lower()  # only now: lower() of ASCII stays ASCII

    @field_validator("user")
    @classmethod
    def _login(cls, value: str) -> str:
        return check_login_name(value)

    @model_validator(mode="after")
    def _address_usable(self) -> DeployRequest:
        net = self.address.network
        ip = self.address.ip
        if net.prefixlen < 31 and ip in (net.network_address, net.broadcast_address):
            kind = "network" if ip == net.network_address else "broadcast"
            raise ValueError(f"{ip} is the {kind} address of {net}: pick a host address")
        if ip == self.gateway:
            raise ValueError(f"{ip} is the gateway of {net}: pick another address")
        for nic in self.nics:
            net, ip = nic.address.network, nic.address.ip
            if net.prefixlen < 31 and ip in (net.network_address, net.broadcast_address):
                kind = "network" if ip == net.network_address else "broadcast"
                raise ValueError(f"{ip} is the {kind} address of {net}: pick a host address")
        ips = [a.ip for a in self.addresses]
        twice = next((ip for ip in ips if ips.count(ip) > 1), None)
        if twice is not None:
            raise ValueError(f"{twice} is given twice: each NIC needs its own address")
        macs = self.macs
        again = next((m for m in macs if macs.count(m) > 1), None)
        if again is not None:
            raise ValueError(f"the MAC {again} is given twice: each NIC needs its own")
        return self


class Job(BaseModel):
    """One deploy's life, as stored: a row of the `jobs` table."""

    id: str = Field(default_factory=new_job_id)
    # What runs and recovers it (bot/kinds/): a deploy (its destroy is a phase of it),
    # or a kind registered beside it. Never read from the id.
    kind: str = "deploy"
    state: JobState
    requester: str
    name: str
    address: str
    backend: str
    request: DeployRequest
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    vm_id: str | None = None
    vm_placement: str | None = None
    final_address: str | None = None
    failed_step: str | None = None
    error: str | None = None
    wreckage: str | None = None
    approval_reason: str | None = None
    # The VM's public host key as one OpenSSH line ("ssh-ed25519 AAAA..."); rows from
    # before issue 28 hold its fingerprint ("SHA256:...") and no `host_key_source`.
    host_key: str | None = None
    host_key_source: HostKeySource | None = None
    # The OpenSSH host certificate of `host_key` deploybot's host CA signed (one line,
    # "ssh-ed25519-cert-v01@openssh.com AAAA...": public); None: no certificate.
    host_certificate: str | None = None
    # Opaque references a front end keeps on the job: where the request came from (a
    # chat channel, say), the thread that follows the job, and the approval message.
    origin: str | None = None
    thread_ref: str | None = None
    approval_ref: str | None = None
    # Who runs it: the runner that claimed it and until when its claim holds (renewed
    # while the runner lives). Another process takes a job over only once that passed.
    owner: str | None = None
    lease_until: datetime | None = None
    # Its fencing token: one more at every claim (store/owners.py, and any write that sets
    # `owner`), so a runner's writes name the claim they act under (`Claim`), not only
    # the runner: a task of an older claim can change nothing.
    claim_epoch: int = 0
    # The installation whose tag its VM carries (None: a job from before tags had one).
    installation: str | None = None
    # Who asked to cancel it while another process ran it (that process acts on it).
    cancel_requested: str | None = None
    # The IPAM's record of its address (NetBox's ip-address id) and where it stands:
    # reserved -> active when the VM answers; released once the job no longer holds it.
    ipam_ref: str | None = None
    ipam_state: IpamState | None = None
    # Its destroy (bot/kinds/deploy/destroy.py): who asked and when, who approved it (None: no
    # approval needed), when the VM was gone, and the approval card a front end posted.
    destroy_by: str | None = None
    destroy_asked_at: datetime | None = None
    destroy_approver: str | None = None
    destroyed_at: datetime | None = None
    destroy_ref: str | None = None
    # Its lease (bot/leases/enforce.py): how long it was granted from being ready (None: no
    # lease, it never expires), the end once set or extended, which reminders were
    # sent for that end (offsets in seconds, "259200,86400"), and when it was powered
    # off at expiry.
    lease_s: int | None = None
    expires_at: datetime | None = None
    reminders_sent: str | None = None
    powered_off_at: datetime | None = None

    @field_validator("id")
    @classmethod
    def _job_id(cls, value: str) -> str:
        if not JOB_ID_RE.fullmatch(value):
            raise ValueError(f"{value[:50]!r} is not a job id (j and 6-40 letters or digits)")
        return value

    @model_validator(mode="after")
    def _matches_request(self) -> Job:
        """The columns the store indexes repeat the request; a row where they disagree
        was changed behind the bot's back and cannot be trusted."""
        request = self.request
        expected = {
            "name": request.name,
            "backend": request.backend,
            "address": str(request.address.ip),
            "requester": request.requester,
        }
        for column, value in expected.items():
            if getattr(self, column) != value:
                raise ValueError(f"{column} {getattr(self, column)[:80]!r} is not the request's")
        return self

    @property
    def lease_end(self) -> datetime | None:
        """When its lease ends: the end recorded (extended), else `lease_s` from when it
        was ready; None for a VM without a lease (or not ready yet)."""
        if self.expires_at is not None:
            return self.expires_at
        if self.lease_s is None or self.finished_at is None:
            return None
        return self.finished_at + timedelta(seconds=self.lease_s)

    @property
    def short_id(self) -> str:
        """The first characters of the id, for headlines and tables; every lookup accepts
        it (or any other unambiguous prefix)."""
        return self.id[:SHORT_ID_LENGTH]

    @classmethod
    def for_request(cls, request: DeployRequest, state: JobState) -> Job:
        return cls(
            state=state,
            requester=request.requester,
            name=request.name,
            address=str(request.address.ip),
            backend=request.backend,
            request=request,
        )

    @property
    def ssh_line(self) -> str | None:
        if self.final_address is None:
            return None
        return f"ssh {self.request.user}@{self.final_address}"

    @property
    def known_hosts_line(self) -> str | None:
        """The line for ~/.ssh/known_hosts ("name,address ssh-ed25519 AAAA..."), when
        the job recorded a public key (older rows hold only its fingerprint)."""
        if self.host_key is None or self.host_key.startswith("SHA256:"):
            return None
        hosts = ",".join(dict.fromkeys([self.name, self.final_address or self.address]))
        return f"{hosts} {self.host_key}"

    def claim(self, runner: str) -> Claim:
        """The claim `runner` acts under on this job as read (its owner, its epoch)."""
        return Claim(runner=runner, epoch=self.claim_epoch)


class Claim(BaseModel):
    """A runner's hold on a job, named by every write it makes to it (the fencing
    token): the write lands only while the job's owner is `runner` and its claim epoch
    is `epoch`. A runner that lost the job (its claim lapsed and another took it) or a
    task of an older claim of the same runner changes nothing. `epoch` None: any claim
    of this runner's, only for the move that starts a queued job it claimed (its epoch is
    read from that move's answer)."""

    model_config = ConfigDict(frozen=True)

    runner: str
    epoch: int | None = None


class JobEvent(BaseModel):
    """One step boundary of a job (a row of `job_events`)."""

    job_id: str
    at: datetime = Field(default_factory=utcnow)
    step: str
    phase: str  # started | finished | failed | skipped | undo | undo_failed | note
    duration_s: float | None = None
    detail: str = ""


class Approval(BaseModel):
    """The approval of one job (a row of `approvals`)."""

    job_id: str
    state: ApprovalState = ApprovalState.PENDING
    reason_required: str
    requested_at: datetime = Field(default_factory=utcnow)
    expires_at: datetime
    decided_by: str | None = None
    decided_at: datetime | None = None
    note: str | None = None


class RollbackReport(BaseModel):
    """What a rollback did: undo steps that worked, those that failed, and what is left."""

    undone: list[str] = Field(default_factory=list)
    failed: list[str] = Field(default_factory=list)
    wreckage: list[str] = Field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.failed and not self.wreckage


class UserPrefs(BaseModel):
    """One person's saved settings: public SSH keys and a default template."""

    user: str
    ssh_keys: tuple[str, ...] = ()
    default_template: str | None = None


class AuditEvent(BaseModel):
    """A refused or repeated action, kept even though it changed nothing else."""

    at: datetime = Field(default_factory=utcnow)
    actor: str
    action: str
    outcome: str  # refused | duplicate
    detail: str = ""
