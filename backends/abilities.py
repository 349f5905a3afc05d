"""Optional abilities of a backend, beside the `Backend` Protocol (backends/base.py): a
backend without them is used through the Protocol alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from backends.base import AddressUse, MissingPrivilege, Segment, Template, VMInfo, VMRef


@runtime_checkable
class ChecksPrivileges(Protocol):
    """A backend that can say which privileges a deploy of `template` lacks
    (`deploybot check`), and where its deploys' disks go by default."""

    default_storage: str | None
    endpoint: tuple[str, int]  # host and port of its API, for the certificate's subject

    async def missing_privileges(
        self, template: str, segments: Sequence[Segment] = (), *, certificates: bool = False
    ) -> list[MissingPrivilege]:
        """Those a deploy of `template` with NICs on `segments` (the subnets' segments on
        this backend) lacks; with `certificates` (a host CA is configured) those installing
        host certificates too. Raises `BackendError` when they cannot be asked (no such
        template: the places a deploy needs them depend on it); never an empty list for
        a check that did not run."""
        ...


@runtime_checkable
class ChecksSegments(Protocol):
    """A backend that can say, without building anything, whether a NIC can go on a
    subnet's segment (`deploybot check`; each deploy's own pre-flight is `prepare_clone`)."""

    async def segment_problems(self, segment: Segment) -> list[str]:
        """What stops a NIC on `segment`, one sentence per node or cluster that cannot
        take it (a missing bridge or network, a VLAN tag on a bridge that is not
        VLAN-aware, an uplink portgroup, a portgroup the hosts are not on); [] when none."""
        ...


@runtime_checkable
class KnowsMacs(Protocol):
    async def macs_in_use(self) -> dict[str, str]:
        """Every MAC address (lower-case) of every VM on this backend -> the VM's name
        (and id), for the MAC check of a fixed `mac=`."""
        ...


@runtime_checkable
class NamedTemplates(Protocol):
    """A backend that can look up one template by name without reading every one (a
    request names one: checking it should not cost a request per template)."""

    async def template(self, name: str) -> Template | None:
        """The template of that name; None when there is none."""
        ...


@runtime_checkable
class NamesWithAddresses(Protocol):
    """A backend that answers the name check and `addresses_in_use` from one read of
    its VMs (vSphere: one look of the session's VM tracker), so that a check of both
    (at admission, in check_free) asks once: the answer is as of that one read."""

    async def named_with_addresses(self, name: str) -> tuple[list[VMInfo], list[AddressUse]]:
        """`find_by_name(name)` and `addresses_in_use()`, from the same read."""
        ...


@dataclass(frozen=True)
class StepTime:
    """How long one finished deploy step took, as the job history recorded it."""

    step: str  # a pipeline step: clone, identity, resize, power_on, address
    template: str
    storage: str | None  # as requested (None: the default)
    duration_s: float


@runtime_checkable
class LearnsDurations(Protocol):
    """A backend that paces its waits by how long such steps took before. The bot
    hands it the recorded step durations (newest first) when it starts, so a fresh
    process does not poll as if it had never deployed."""

    def remember_steps(self, history: list[StepTime]) -> None: ...


@runtime_checkable
class ReadsHostKeys(Protocol):
    """A backend that reads a guest's SSH host keys through the hypervisor's own channel
    into the guest, not through the network (Proxmox: the guest agent's file-read)."""

    host_keys_through: str  # for people: "the QEMU guest agent"

    async def host_keys(self, ref: VMRef) -> list[str]:
        """The guest's public host keys as OpenSSH lines ("ssh-ed25519 AAAA...", no
        comment), read from /etc/ssh/ssh_host_{ed25519,ecdsa,rsa}_key.pub (those that
        exist). RetryableError while the channel is not up yet; PermanentError when it
        is refused (a missing privilege is named); [] when the guest has none."""
        ...


@runtime_checkable
class ChoosesHostKeys(Protocol):
    """A backend that writes the guest's cloud-config itself (vSphere, ESXi:
    guestinfo.userdata) and so installs the host key pair deploybot chose
    (`Identity.host_key`: cloud-config `ssh_keys` ed25519_private/ed25519_public and
    `ssh_deletekeys: true`)."""

    async def forget_host_key(self, ref: VMRef) -> None:
        """Remove the private key from where the hypervisor keeps the VM's cloud-config
        (vSphere: a reconfigure that blanks guestinfo.userdata), so nobody with read
        access to the hypervisor can read it afterwards. Idempotent; waits for its task;
        a VM that is gone is not an error (VMNotFound is swallowed)."""
        ...

    async def holds_host_key(self, ref: VMRef) -> bool:
        """Whether the VM's stored cloud-config still holds a private host key (gc asks)."""
        ...


@runtime_checkable
class InstallsHostCertificates(Protocol):
    """A backend that can put a host certificate into a running guest through the
    hypervisor's own channel (Proxmox: the guest agent's file-write and exec)."""

    certificates_through: str  # for people: "the QEMU guest agent"

    async def install_host_certificate(self, ref: VMRef, certificate: str) -> str | None:
        """Write `certificate` (an OpenSSH host certificate line) next to its key
        (/etc/ssh/ssh_host_<type>_key-cert.pub, the type from the certificate's algorithm),
        make sshd present it (HostCertificate in sshd's configuration) and reload sshd;
        returns a note. RetryableError while the channel is not up; PermanentError when
        refused (a missing privilege is named) or when the command in the guest fails
        (its exit code and output)."""
        ...
