"""What `parse` (bot/requests/grammar.py) returns: one frozen dataclass per `/deploy` command, and
`Command`, their union. Front ends dispatch on these types; forms build `DeployArgs`
directly. Kept apart from the grammar so that the words of a command and its parsing can
be read (and changed) separately."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeployArgs:
    """A deploy as typed: converted values, not yet checked against the configuration."""

    name: str
    address: str | None = None
    template: str | None = None
    on: str | None = None
    storage: str | None = None
    cores: int | None = None
    memory_mib: int | None = None
    disk_grow_gib: int | None = None
    user: str | None = None
    upgrade: bool | None = None
    given: tuple[str, ...] = field(default=())
    network: str | None = None  # only forms set it; the text grammar has no key for it
    subnet: str | None = None  # where the next free address comes from, without ADDRESS
    # `lease=7d`: how long the VM lives once ready (bot/leases/enforce.py)
    lease_s: int | None = None
    lease_never: bool = False  # `lease=never`: no end (approvers only)
    # `+10.0.20.5` / `+lab20`: one word per NIC after the first (an address, or a subnet
    # for its next free address), without the `+`.
    more_nics: tuple[str, ...] = ()
    # `mac=` / `macN=`: (the NIC's number, 1 for the first, its MAC normalised).
    macs: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Help:
    pass


@dataclass(frozen=True)
class Status:
    job_id: str


@dataclass(frozen=True)
class History:
    limit: int = 10


@dataclass(frozen=True)
class Cancel:
    job_id: str


@dataclass(frozen=True)
class Templates:
    pass


@dataclass(frozen=True)
class Approve:
    job_id: str


@dataclass(frozen=True)
class Reject:
    job_id: str
    reason: str


@dataclass(frozen=True)
class SaveKey:
    """`key ssh-ed25519 AAAA... comment`: save a public SSH key for later deploys."""

    text: str


@dataclass(frozen=True)
class ShowSettings:
    pass


@dataclass(frozen=True)
class Destroy:
    """`destroy NAME`: the VM's name, or a job id (the service finds which)."""

    target: str


@dataclass(frozen=True)
class KnownHosts:
    """`known-hosts NAME`: the VM's known_hosts line again (its name, or a job id)."""

    target: str


@dataclass(frozen=True)
class SshCa:
    """`ssh-ca`: the known_hosts line that trusts deploybot's host CA (@cert-authority)."""


@dataclass(frozen=True)
class ExtendLease:
    """`lease extend NAME [7d]`: move a VM's lease end later (no length: the usual step)."""

    target: str
    length_s: int | None = None


@dataclass(frozen=True)
class BuildTemplate:
    """`template build PROFILE [on=B] [node=N] [storage=S] [name=X]`: a golden template
    from a build profile (bot/kinds/build/); `on` None is the default backend."""

    profile: str
    on: str | None = None
    node: str | None = None
    storage: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class TemplateProfiles:
    """`template profiles`: the build profiles there are."""


@dataclass(frozen=True)
class MigratePlan:
    """`migrate plan --from SOURCE --to TARGET [folder=F] [name=PATTERN]`: a read-only
    plan of the source's templates against the target, kept by id (bot/migration/)."""

    source: str
    target: str
    folder: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class MigrateApply:
    """`migrate apply PLAN`: rebuild a kept plan's templates on its target."""

    plan_id: str


@dataclass(frozen=True)
class ListVMs:
    """`list [mine|all|@USER] [page=N]`: `user` None with `everyone` False is "mine"."""

    everyone: bool = False
    user: str | None = None
    page: int = 1


Command = (
    DeployArgs
    | Help
    | Status
    | History
    | Cancel
    | Templates
    | Approve
    | Reject
    | SaveKey
    | ShowSettings
    | Destroy
    | KnownHosts
    | SshCa
    | ListVMs
    | ExtendLease
    | BuildTemplate
    | TemplateProfiles
    | MigratePlan
    | MigrateApply
)
