"""The host CA: its private key comes from the environment variable `[ssh] host_ca_env`
names (never from the file, never written anywhere: no log, row, message or repr holds
it), and signs the host keys deploybot confirmed as OpenSSH host certificates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

import asyncssh

from bot.config.settings import Settings
from bot.models.errors import ConfigError

# The comment ending the @cert-authority line: which CA a person's known_hosts trusts.
AUTHORITY_COMMENT = "deploybot-host-ca"


class HostCA:
    """deploybot's host certificate authority: signs host keys for the VMs it builds."""

    def __init__(
        self, key: asyncssh.SSHKey, patterns: Sequence[str], certificate_days: int, source: str
    ) -> None:
        self._key = key
        self.patterns = tuple(patterns)  # the hosts the @cert-authority line names
        self.certificate_days = certificate_days  # validity for a VM without a lease
        self.source = source  # where the key came from, for people: "$DEPLOYBOT_SSH_HOST_CA"

    def __repr__(self) -> str:  # the key is never shown, only which one it is
        return f"HostCA({self.fingerprint}, from {self.source})"

    @property
    def public_line(self) -> str:
        """The CA's public key as one OpenSSH line ("ssh-ed25519 AAAA...")."""
        algorithm, blob = self._key.export_public_key("openssh").decode().split()[:2]
        return f"{algorithm} {blob}"

    @property
    def fingerprint(self) -> str:
        return self._key.get_fingerprint("sha256")

    def authority_line(self, patterns: Sequence[str] | None = None) -> str:
        """The known_hosts line that trusts every host certificate this CA signs for
        those host patterns (default: the configured ones)."""
        hosts = ",".join(patterns if patterns is not None else self.patterns)
        return f"@cert-authority {hosts} {self.public_line} {AUTHORITY_COMMENT}"

    def sign(
        self,
        public_line: str,
        *,
        principals: Sequence[str],
        valid_after: datetime,
        valid_before: datetime,
        key_id: str,
    ) -> str:
        """The OpenSSH host certificate of the public key `public_line`, as one line
        ("ssh-ed25519-cert-v01@openssh.com AAAA...", no comment). ValueError when the
        line holds no public key."""
        try:
            host_key = asyncssh.import_public_key(public_line)
        except asyncssh.KeyImportError as exc:
            raise ValueError(f"not a public key line ({exc})") from None
        certificate = self._key.generate_host_certificate(
            host_key,
            key_id,
            principals=list(principals),
            valid_after=int(valid_after.timestamp()),
            valid_before=int(valid_before.timestamp()),
        )
        algorithm, blob = certificate.export_certificate("openssh").decode().split()[:2]
        return f"{algorithm} {blob}"


def load_host_ca(settings: Settings, environ: Mapping[str, str]) -> HostCA | None:
    """The configured host CA (None: `[ssh] host_ca_env` is not set). A `ConfigError`
    saying what to do when its variable is unset or empty, does not hold an unencrypted
    OpenSSH private key, or no host pattern is known (neither `ca_hosts` nor any
    subnet's search domain); the message never holds the variable's value."""
    ssh = settings.ssh
    env = ssh.host_ca_env
    if env is None:
        return None
    text = environ.get(env, "").strip()
    fix = (
        f"put the host CA's private key (OpenSSH format, no passphrase: "
        f'`ssh-keygen -t ed25519 -N "" -f host_ca`) in it, e.g. {env}="$(cat host_ca)", '
        "or remove host_ca_env to deploy without host certificates"
    )
    if not text:
        raise ConfigError(
            f"[ssh] host_ca_env: the environment variable {env} is unset or empty: {fix}"
        )
    try:
        key = asyncssh.import_private_key(text)
    except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError):
        raise ConfigError(
            f"[ssh] host_ca_env: {env} does not hold an unencrypted OpenSSH private key: {fix}"
        ) from None
    patterns = ssh.ca_hosts or default_patterns(settings)
    if not patterns:
        raise ConfigError(
            "[ssh] ca_hosts: no host patterns for the @cert-authority line (no subnet has a "
            'search_domain): set ca_hosts, e.g. ["*.lab.example"]'
        )
    return HostCA(key, patterns, ssh.certificate_days, f"${env}")


def default_patterns(settings: Settings) -> tuple[str, ...]:
    """ "*.<search_domain>" of every subnet that has one, each once."""
    domains = (s.search_domain.lower() for s in settings.subnets if s.search_domain)
    return tuple(dict.fromkeys(f"*.{d}" for d in domains))
