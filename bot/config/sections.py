"""The configuration's own sections ([defaults], [limits], [timeouts], [recovery],
[ownership], [approval], [slack], [metrics], [store], [ssh]) as pydantic models (split from
bot/config/settings.py, which assembles them into `Settings`). Sections that
belong to one feature live with it instead (bot/requests/quotas.py, bot/leases/terms.py,
backends/ipam/config.py, bot/images/). Each forbids unknown keys, so a typo in the file
stops the start instead of being ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bot.models import MIN_MEMORY_MIB, check_login_name
from bot.models.keys import check_ssh_key


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Defaults(_Section):
    backend: str | None = None
    template: str = "ubuntu-24.04"
    cores: int = Field(default=2, ge=1)
    memory_mib: int = Field(default=2048, ge=MIN_MEMORY_MIB)
    disk_grow_gib: int = Field(default=0, ge=0)
    user: str = "ubuntu"
    ssh_keys: tuple[str, ...] = ()
    ssh_port: int = Field(default=22, ge=1, le=65535)

    @field_validator("user")
    @classmethod
    def _login(cls, value: str) -> str:
        """Checked at start: every deploy without user= would be refused."""
        return check_login_name(value)

    @field_validator("ssh_keys")
    @classmethod
    def _public_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        """Checked at start: a key that is not one would lock everybody out of every VM."""
        checked = []
        for number, key in enumerate(keys, 1):
            try:
                checked.append(check_ssh_key(key))
            except ValueError as exc:
                raise ValueError(f"key {number}: {exc}") from None
        return tuple(checked)


class Limits(_Section):
    """`max_running` and `max_running_per_backend` bound one process's queue
    (bot/jobs/queue.py), not the installation: each replica claims work up to its own limits,
    so N replicas may run N times as many jobs on one backend. A per-installation
    count would have to be taken in the store by every path that starts a job (intake,
    approval, the claim of queued work, recovery); until then operators divide."""

    max_cores: int = Field(default=16, ge=1)
    max_memory_mib: int = Field(default=65536, ge=MIN_MEMORY_MIB)
    max_disk_grow_gib: int = Field(default=1024, ge=0)
    max_running: int = Field(default=8, ge=1)
    max_running_per_backend: int = Field(default=4, ge=1)


class Timeouts(_Section):
    """Seconds each pipeline step may take before it counts as failed."""

    check_free_s: float = Field(default=30, gt=0)
    clone_s: float = Field(default=900, gt=0)
    identity_s: float = Field(default=120, gt=0)
    resize_s: float = Field(default=300, gt=0)
    power_on_s: float = Field(default=120, gt=0)
    address_s: float = Field(default=300, gt=0)
    ssh_s: float = Field(default=180, gt=0)
    power_off_s: float = Field(default=120, gt=0)
    destroy_s: float = Field(default=300, gt=0)
    wreckage_retry_s: float = Field(default=300, gt=0)  # how often to retry failed rollbacks
    retry_initial_s: float = Field(default=0.5, gt=0)  # backoff after a failed call
    retry_max_s: float = Field(default=10, gt=0)
    poll_initial_s: float = Field(default=0.1, gt=0)  # the SSH check asking again: see retrying


class Recovery(_Section):
    """What a restart does with a job that was running when the bot died: `roll_back`
    (the default: remove its VM and fail it) or `resume` (carry on from the last step
    that finished, when every later step is safe to run again; else roll back)."""

    interrupted: Literal["roll_back", "resume"] = "roll_back"


class OwnershipSettings(_Section):
    """How processes sharing one database share the work (bot/ownership/claims.py).

    A runner renews its claim on its jobs every `tick_s`; a job whose claim has been
    unrenewed for `lease_s` is taken over by another runner. A process on the same host
    that is seen to be gone frees its jobs at once, without waiting for the claim to lapse.

    `stop_s`: what `deploybot serve` gives its work on SIGTERM/SIGINT. Running deploys
    and answers to chat may finish for that long; then answers not yet sent are left
    in the inbox for another process, running deploys are cancelled (they roll back),
    and what still rolls back after `stop_s` more is left to the runner that takes it
    over. Queued jobs go back at once. The process exits within about twice `stop_s`
    (one budget shared by the rollbacks, destroys and recoveries still going, whose
    claims are renewed meanwhile)."""

    lease_s: float = Field(
        default=30,
        gt=0,
        description="How long a runner's claim on its jobs lasts unrenewed (the key keeps its "
        "old name; it is not a VM's lease, see [leases])",
    )
    tick_s: float = Field(default=2, gt=0)
    stop_s: float = Field(default=10, gt=0)

    @model_validator(mode="after")
    def _renews_in_time(self) -> OwnershipSettings:
        if self.tick_s * 3 > self.lease_s:
            raise ValueError(
                f"tick_s ({self.tick_s:g}) must be at most a third of lease_s "
                f"({self.lease_s:g}), so a live runner renews before its claim lapses"
            )
        return self


class ApprovalPolicy(_Section):
    """Who may deploy, who approves, and which requests wait for an approver."""

    deployers: tuple[str, ...] = ()  # empty: everyone may deploy
    approvers: tuple[str, ...] = ()
    # Groups whose members approve too; a chat front end resolves their members.
    approver_groups: tuple[str, ...] = ()
    always: bool = False
    backends: tuple[str, ...] = ()
    templates: tuple[str, ...] = ()
    cores_over: int | None = None
    memory_mib_over: int | None = None
    disk_grow_gib_over: int | None = None
    expire_after_s: float = Field(default=3600, gt=0)
    # Destroys (bot/kinds/deploy/destroy.py): whether one waits for an approver, and who may ask for
    # one besides the VM's requester and the approvers (people, and chat user groups).
    destroy: Literal["never", "always"] = "never"
    destroyers: tuple[str, ...] = ()
    destroyer_groups: tuple[str, ...] = ()
    # Template builds (bot/kinds/build/) change templates everyone deploys from: "approvers_skip"
    # (the default) lets an approver's build run at once and makes anyone else's wait for
    # an approver; "always" makes every build wait; "never" none. With no approvers (and
    # no approver groups) configured nobody could approve, so builds then run at once.
    builds: Literal["always", "approvers_skip", "never"] = "approvers_skip"

    @property
    def has_rules(self) -> bool:
        return bool(
            self.always
            or self.backends
            or self.templates
            or self.cores_over is not None
            or self.memory_mib_over is not None
            or self.disk_grow_gib_over is not None
            or self.destroy == "always"
            or self.builds == "always"
        )

    @model_validator(mode="after")
    def _someone_can_approve(self) -> ApprovalPolicy:
        if self.has_rules and not self.approvers and not self.approver_groups:
            raise ValueError(
                "some requests need approval but `approvers` is empty (and so is `approver_groups`)"
            )
        return self


class SlackSettings(_Section):
    """The chat front end: where the Web API is, where approvals go, how fast to post.

    Tokens are never here: only the names of the environment variables that hold them.
    """

    # GovSlack workspaces use https://slack-gov.com/api/; tests point it at a local fake.
    api_base_url: str = Field(default="https://slack.com/api/", pattern=r"^https?://\S+/$")
    command: str = Field(default="/deploy", pattern=r"^/[a-z0-9_-]{1,31}$")
    approvals_channel: str | None = Field(default=None, pattern=r"^[CG][A-Z0-9]{2,}$")
    bot_token_env: str = "SLACK_BOT_TOKEN"
    app_token_env: str = "SLACK_APP_TOKEN"
    signing_secret_env: str = "SLACK_SIGNING_SECRET"
    # Slack allows about one message per second per channel; keep inside it.
    posts_per_second: float = Field(default=1.0, gt=0, le=1000)
    group_cache_s: float = Field(default=300, ge=0)


class StoreSettings(_Section):
    """The database's side of an outage (store/retry.py): a write that cannot reach it
    (a restart, a failover, SQLite's file locked past its busy timeout) is run again
    from the start for up to `write_retry_s`; then the deploy hears that the database is
    not answering."""

    write_retry_s: float = Field(default=30.0, ge=0)


class MetricsSettings(_Section):
    """Prometheus' /metrics: on the HTTP server in HTTP mode; in Socket Mode on a small
    listener of its own when `listen` ("127.0.0.1:9464") is set."""

    listen: str | None = None


# An environment variable's name, as a shell may set it.
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class SshSettings(_Section):
    """SSH host certificates (bot/sshca/): with `host_ca_env` set, deploybot signs each
    VM's confirmed host key with that certificate authority, so a person whose
    known_hosts has the one `@cert-authority` line `deploybot ssh-ca` prints is never
    asked about a new VM's key. The CA's private key is read from the environment
    variable `host_ca_env` names, never from this file; a named variable that is unset,
    empty or not an unencrypted OpenSSH private key stops the start."""

    # The variable holding the host CA's private key (OpenSSH format, no passphrase),
    # e.g. "DEPLOYBOT_SSH_HOST_CA"; unset: no certificates.
    host_ca_env: str | None = Field(default=None, pattern=_ENV_NAME)
    # The host patterns of the @cert-authority line (default: "*.<search_domain>" of
    # every subnet that has one).
    ca_hosts: tuple[str, ...] = ()
    # How long a certificate holds for a VM without a lease (one with a lease: its end).
    certificate_days: int = Field(default=365, ge=1, le=3650)

    @field_validator("ca_hosts")
    @classmethod
    def _patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        """known_hosts joins the patterns with commas and ends them at a space."""
        for pattern in patterns:
            if not pattern or any(c.isspace() or c == "," for c in pattern):
                raise ValueError(
                    f"{pattern!r} is not one host pattern: no spaces or commas "
                    '(give each as its own string, e.g. ["*.lab.example", "10.0.0.*"])'
                )
        # ssh matches a host pattern against the name typed in lower case: "*.Lab.Example"
        # would never match, so the patterns are kept as ssh compares them.
        return tuple(pattern.lower() for pattern in patterns)


class MigrationSettings(_Section):
    """`deploybot migrate` (bot/migration/): how old a plan may be when it is applied.
    An apply also reads the source again and refuses a plan whose source changed; the
    window bounds what a plan can miss besides (the target, the profiles)."""

    plan_valid_s: float = Field(default=3600.0, gt=0)
