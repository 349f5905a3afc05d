"""The hypervisor contract: one small async Protocol every backend implements.

A deploy is the same five moves on every hypervisor: copy a template, hand the copy
its identity, power it on, learn its address, prove it answers on SSH. This module
names those moves and the data they exchange; `backends/sim/` is the reference
implementation that the demo and the tests run against.

Contract (every backend keeps it; the shared conformance tests in tests/support/contract.py
check it):

* Every mutating method returns only after the hypervisor finished the work. A backend
  whose API is asynchronous (Proxmox UPIDs, vSphere tasks) waits for the task itself.
* Failures surface only as `BackendError` subclasses. Vendor exceptions are mapped at
  the backend boundary: `RetryableError` for what may work on a second try (a lock
  held by someone else; its subclass `Unreachable` when the API itself does not answer:
  refused, timed out, 5xx), `PermanentError` for the rest.
* Identity is durable: `prepare_clone` chooses the id the new VM will have *before*
  anything is created, so a crash in the middle of `clone` still leaves the caller
  knowing what to clean up. Every later call locates the VM by that id, never by a
  name or a database key that can be reassigned.
* Safety: `power_off` and `destroy` refuse (`NotOurVM`) a VM that does not carry the
  job tag of the `VMRef` they are given. A VM that is already gone makes `destroy`
  and `power_off` succeed quietly: rollback is idempotent.
* `destroy` never removes a VM while it runs: it fails, as it does on real hypervisors
  (callers stop first and wait for the stop), or it stops the VM itself and waits for
  that stop first (Proxmox, so a rollback whose stop failed still ends).
* The undo moves (`power_off`, `destroy`) aim at a state: when one fails and the VM is
  not yet in that state, the failure is retryable (the caller tries again within its
  timeout), so a rollback ends with the VM gone.
* A VM held by another operation (a backup, a snapshot, a migration) is waited for a
  bounded time inside the backend, then `Locked` says which lock and what to do.
  What a call waits out meanwhile (that lock, a read of its task that failed and is
  asked again) is told to the caller through `backends.troubles`, so a caller whose
  own timeout comes first can say what the call last met.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from backends.config import BackendConfig
from backends.tags import job_tag
from bot.models.errors import BackendError

# --- errors -------------------------------------------------------------------------


class RetryableError(BackendError):
    """Timeouts, connection failures, lock contention: the same call may succeed later."""

    retryable = True


class Unreachable(RetryableError):
    """The hypervisor's API does not answer at all (refused, timed out, 5xx): the job
    waits for it, says so in its thread, and carries on when it is back."""


class IdTaken(RetryableError):
    """The id `prepare_clone` chose was taken by another client before the clone began:
    the caller forgets that id (it names someone else's VM now) and prepares a new one."""


class PermanentError(BackendError):
    """The hypervisor said no for a reason that another attempt will not change."""


class Locked(PermanentError):
    """Another operation holds the VM (its `lock`: backup, snapshot, migrate, ...) and
    still held it after the backend waited its bounded time. Not retried by callers: the
    holder may run for hours. The message names the lock and what to do about it."""

    def __init__(self, message: str, *, lock: str, vm_id: str | None = None) -> None:
        super().__init__(message, vm_id=vm_id)
        self.lock = lock


class VMNotFound(PermanentError):
    """The durable id names no VM (any more)."""


class NotOurVM(PermanentError):
    """The VM exists but does not carry the expected job tag: deploybot must not touch it."""


# --- data ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    name: str
    os_family: str
    node: str | None = None
    storage: str | None = None
    disk_gib: int = 0
    default_user: str | None = None  # the image's login user, when the template knows it
    # Why no deploy from it can work as configured (e.g. a vmxnet3 NIC for a guest
    # without VMware Tools), in the backend's words; None: nothing known against it.
    problem: str | None = None


@dataclass(frozen=True)
class Storage:
    name: str
    node: str | None
    total_bytes: int
    free_bytes: int
    supports_linked_clone: bool = False


@dataclass(frozen=True)
class Network:
    name: str
    node: str | None = None
    distributed: bool = False


@dataclass(frozen=True)
class Segment:
    """Where a NIC is plugged in on one backend, as its subnet says (`[subnets.segments.B]`):
    a Proxmox bridge with an optional VLAN tag and firewall switch, or a vSphere network
    (a standard one or a distributed portgroup) by name. A value a NIC has: a VM with
    several NICs has one per NIC."""

    network: str  # Proxmox: the bridge; vSphere and the simulator: the network's name
    vlan: int | None = None  # the 802.1Q tag the hypervisor adds (Proxmox `tag`)
    firewall: bool = False  # Proxmox's per-NIC firewall (off: VMware VMs never had one)

    def __str__(self) -> str:
        return f"{self.network} VLAN {self.vlan}" if self.vlan is not None else self.network


@dataclass(frozen=True)
class Nic:
    """One NIC after the first: its address, its gateway (None: no route through it),
    where it goes (`Segment`, None: the backend's default network) and a fixed MAC."""

    address: ipaddress.IPv4Interface
    gateway: ipaddress.IPv4Address | None = None
    segment: Segment | None = None
    mac: str | None = None


@dataclass(frozen=True)
class MissingPrivilege:
    """A privilege a deploy step needs and the backend's account lacks."""

    privilege: str
    where: str  # a Proxmox ACL path, a vSphere inventory object
    step: str  # what the deploy does with it
    account: str  # the user or token (never a secret)


@dataclass(frozen=True)
class Placement:
    """Where a VM can land: a Proxmox node, a vSphere resource pool, a simulator node."""

    name: str
    kind: str = "node"


@dataclass(frozen=True)
class HostKeyPair:
    """A host key pair deploybot chose for a guest: installed by a backend that writes the
    guest's cloud-config itself. `private_openssh` is a secret: never logged, never stored."""

    private_openssh: str  # OpenSSH private key text (ed25519), as asyncssh exports it
    public: str  # "ssh-ed25519 AAAA..." (no comment)

    def __repr__(self) -> str:  # never print the private key, even in a traceback
        return f"HostKeyPair(public={self.public!r})"


@dataclass(frozen=True)
class Identity:
    """What cloud-init gives the guest on first boot."""

    hostname: str
    user: str
    ssh_keys: tuple[str, ...]
    address: ipaddress.IPv4Interface
    gateway: ipaddress.IPv4Address
    dns: tuple[ipaddress.IPv4Address, ...]
    search_domain: str
    upgrade: bool
    cores: int
    memory_mib: int
    network: str | None = None  # the NIC's network, as in CloneSpec (None: the default)
    segment: Segment | None = None  # its subnet's segment, as in CloneSpec
    # The host key pair deploybot chose, for a backend that installs it (ChoosesHostKeys);
    # None: the guest makes its own at first boot.
    host_key: HostKeyPair | None = None
    # The OpenSSH host certificate of `host_key` (deploybot's host CA signed it), installed with
    # it in the cloud-config (`ssh_keys: ed25519_certificate`: cloud-init writes it and sets
    # sshd's HostCertificate); None: no certificate.
    host_certificate: str | None = None
    more_nics: tuple[Nic, ...] = ()  # net1, net2, ... in order
    mac: str | None = None  # the first NIC's fixed MAC (None: the hypervisor's)
    search_domains: tuple[str, ...] = ()  # search list beyond search_domain (merged)

    @property
    def searches(self) -> tuple[str, ...]:
        """The whole search list: `search_domain` first, then `search_domains`."""
        first = (self.search_domain,) if self.search_domain else ()
        return tuple(dict.fromkeys((*first, *self.search_domains)))

    @property
    def nic(self) -> Segment | None:
        """Where the NIC goes: the segment, else `network` alone (None: the default)."""
        if self.segment is not None:
            return self.segment
        return Segment(self.network) if self.network else None


@dataclass(frozen=True)
class CloneSpec:
    job_id: str
    name: str
    template: str
    placement: str | None = None
    storage: str | None = None
    network: str | None = None  # the NIC's network (None: the backend's default)
    # Where its subnet puts the NIC on this backend; wins over `network` when set.
    segment: Segment | None = None
    # What cloud-init will give the guest, for backends that can set it in the clone
    # itself; apply_identity is still called and must then be cheap and idempotent.
    identity: Identity | None = None
    installation: str | None = None  # None: a job recorded before installations had ids
    more_nics: tuple[Nic, ...] = ()  # net1, net2, ... in order, as in Identity
    mac: str | None = None  # the first NIC's fixed MAC (None: the hypervisor's)

    @property
    def tag(self) -> str:
        return job_tag(self.job_id, self.installation)

    @property
    def nic(self) -> Segment | None:
        """Where the NIC goes: the segment, else `network` alone (None: the default)."""
        if self.segment is not None:
            return self.segment
        return Segment(self.network) if self.network else None


@dataclass(frozen=True)
class VMRef:
    """The durable handle of a VM built by one job; safe to store and reuse after a restart.

    `placement` is opaque to the core: each backend stores there what it needs to find
    the VM again (a Proxmox `node@cluster`, a vCenter's identity).
    """

    vm_id: str
    job_id: str
    placement: str | None = None
    installation: str | None = None  # the job's installation (None: an old, bare tag)

    @property
    def tag(self) -> str:
        return job_tag(self.job_id, self.installation)


@dataclass(frozen=True)
class VMInfo:
    vm_id: str
    name: str
    running: bool
    tags: frozenset[str] = field(default_factory=frozenset)
    placement: str | None = None
    # What holds the VM when the hypervisor says (Proxmox `lock: backup`); None: free.
    lock: str | None = None


@dataclass(frozen=True)
class AddressUse:
    """An IPv4 address a VM on the hypervisor is configured with or reports."""

    address: ipaddress.IPv4Address
    vm_id: str
    vm_name: str
    # Where it was seen, for the refusal message: "ipconfig0", "guest agent", "guest.net", ...
    source: str


@dataclass(frozen=True)
class CloneMode:
    """Whether a clone request implies a fast linked clone or a full copy, and why."""

    linked: bool
    reason: str


class BackendFactory(Protocol):
    def __call__(self, config: BackendConfig, environ: Mapping[str, str]) -> Backend: ...


# --- the Protocol -------------------------------------------------------------------


@runtime_checkable
class Backend(Protocol):
    """One hypervisor endpoint. See the module docstring for the contract."""

    name: str
    # The network a NIC is put on when the request names none (None: the template's),
    # so that a request can be refused before anything is built if it does not exist.
    default_network: str | None

    async def templates(self) -> list[Template]: ...

    async def storages(self, placement: str | None = None) -> list[Storage]: ...

    async def networks(self, placement: str | None = None) -> list[Network]: ...

    async def placements(self) -> list[Placement]: ...

    async def clone_mode(self, spec: CloneSpec) -> CloneMode: ...

    async def find_vm(self, ref: VMRef) -> VMInfo | None:
        """Resolve a durable id; None when no such VM exists, or when the id now names a
        VM without this job's tag (someone else's)."""
        ...

    async def find_by_name(self, name: str) -> list[VMInfo]: ...

    async def find_tagged(self) -> list[VMInfo]:
        """Every VM carrying any deploybot job tag (for orphan finding)."""
        ...

    async def prepare_clone(self, spec: CloneSpec) -> VMRef:
        """Choose the new VM's durable id without creating anything."""
        ...

    # The four deploy moves may return a note for the job's thread (a setting the server
    # could not take, a full copy where a linked clone was hoped for), or None.

    async def clone(self, spec: CloneSpec, ref: VMRef) -> str | None: ...

    async def apply_identity(self, ref: VMRef, identity: Identity) -> str | None: ...

    async def grow_disk(self, ref: VMRef, grow_gib: int) -> str | None:
        """Grow the boot disk by `grow_gib` once per job, whoever asks again.

        The target size is fixed on the hypervisor (a mark on the VM) when it is first
        known, so a retry after a lost answer, or a job resumed by a new process after
        a restart (the growth may or may not have happened), finds it done rather than
        growing the disk twice.
        """
        ...

    async def power_on(self, ref: VMRef) -> str | None: ...

    async def wait_for_address(
        self, ref: VMRef, expected: ipaddress.IPv4Address | None
    ) -> ipaddress.IPv4Address:
        """Wait until the guest reports an address; callers bound it with a timeout.

        Loopback, link-local and container-bridge addresses are skipped; the expected
        address wins when the guest reports several.
        """
        ...

    async def probe_ssh(self, ref: VMRef, address: ipaddress.IPv4Address, port: int) -> str | None:
        """One attempt: return once a TCP connection to the guest's SSH port succeeded,
        with the public host key the server presented, as one OpenSSH line
        ("ssh-ed25519 AAAA...", no comment), or None when it could not be read
        (`backends.sshcheck`, through the config's `ssh_jump` when it has one)."""
        ...

    async def power_off(self, ref: VMRef) -> None: ...

    async def destroy(self, ref: VMRef) -> None: ...

    async def addresses_in_use(self, ours: str | None = None) -> list[AddressUse]:
        """Every IPv4 address that any VM on this endpoint (ours or not, templates excluded)
        is configured with or reports, for a conflict check before a clone takes one.
        Only the VMs this account may see: the hypervisor hides the others.

        Configured: what the hypervisor keeps for the guest's boot (Proxmox `ipconfigN`,
        the simulator's identity), stopped VMs too. Reported: what a running guest says
        (QEMU guest agent, VMware Tools `guest.net`/`guest.ipAddress`); an address that
        lives only inside a stopped guest cannot be seen. One entry per VM and address,
        naming the configured source when it is both. The `lo` interface, link-local,
        unspecified and multicast addresses, container bridges inside guests and IPv6
        are left out (other loopback addresses stay: see `listable`).

        Cost: one bulk read where the API has one (vSphere: one PropertyCollector read);
        Proxmox has none: a config read per VM and an agent read per running VM with an
        agent, at bounded concurrency. So the answer may be cached briefly (Proxmox:
        `addresses_cache_s`). A kept answer may not yet show a VM this backend object
        cloned since (its job holds that address in deploybot's store, which callers
        ask first: 50 deploys at once must not each sweep the cluster), but a VM it
        destroyed is taken out at once, so its address is free again. `ours` (an
        installation id): VMs that installation built may be left out where reading
        them costs requests (Proxmox); the caller knows their addresses from its jobs.

        Errors: the list is complete or the call raises (`Unreachable` or another
        `RetryableError` when the API, or one VM's read, did not answer; `PermanentError`
        when it refused): never read a failure as "no conflict". A guest agent that is
        silent, not running or not configured is no error: that VM reports nothing.
        """
        ...

    async def close(self) -> None: ...


# Optional abilities (ChecksPrivileges, NamedTemplates, LearnsDurations, ReadsHostKeys,
# ChoosesHostKeys) are in backends/abilities.py; template builds (BuildsTemplates) in
# backends/building.py.
