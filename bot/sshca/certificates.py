"""What a VM's host certificate says: the names it holds for (its principals: the VM's
name, its FQDN when its subnet has a search domain, its address), how long (from five
minutes ago, for clocks that lag, to its lease's end, else `[ssh] certificate_days`
from now), and its id; and the same read back from a certificate line for messages."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from bot.models import Job
from bot.sshca.authority import HostCA

CLOCK_SKEW = timedelta(minutes=5)  # a guest or client clock behind ours still accepts it


@dataclass(frozen=True)
class CertificateTerms:
    principals: tuple[str, ...]
    valid_after: datetime
    valid_before: datetime
    key_id: str


def principals_of(job: Job, address: str) -> tuple[str, ...]:
    """The names a VM's certificate holds for: what people type after `ssh`, in lower
    case as ssh compares them (a principal "web01.Lab.Example" would match no name)."""
    req = job.request
    names = [req.name.lower()]
    if req.search_domain:
        names.append(f"{req.name}.{req.search_domain}".lower())
    names.append(address)
    return tuple(dict.fromkeys(names))


def terms_for(job: Job, address: str, ca: HostCA, now: datetime) -> CertificateTerms:
    """The terms of `job`'s VM's certificate signed at `now`: until the lease's end (its
    recorded end, else its length from now: the lease starts when the VM is ready, a
    moment later), else `certificate_days` from now."""
    if job.expires_at is not None:
        until = job.expires_at
    elif job.lease_s is not None:
        until = now + timedelta(seconds=job.lease_s)
    else:
        until = now + timedelta(days=ca.certificate_days)
    return CertificateTerms(
        principals_of(job, address), now - CLOCK_SKEW, until, f"deploybot:{job.id}:{job.name}"
    )


def certify(ca: HostCA, job: Job, public_line: str, address: str, now: datetime) -> str:
    """The certificate line of `public_line`, the host key of `job`'s VM at `address`."""
    terms = terms_for(job, address, ca, now)
    return ca.sign(
        public_line,
        principals=terms.principals,
        valid_after=terms.valid_after,
        valid_before=terms.valid_before,
        key_id=terms.key_id,
    )


@dataclass(frozen=True)
class CertificateInfo:
    """A certificate line read back (no signature is checked: it is our own record)."""

    key: str  # the certified public key line ("ssh-ed25519 AAAA...")
    principals: tuple[str, ...]
    valid_after: datetime
    valid_before: datetime
    key_id: str
    authority: str  # the signing CA's fingerprint ("SHA256:...")


def read_certificate(line: str) -> CertificateInfo | None:
    """What an OpenSSH certificate line says; None when it holds no certificate."""
    try:
        cert = asyncssh.import_certificate(line)
    except (asyncssh.KeyImportError, ValueError):
        return None
    if not isinstance(cert, SSHOpenSSHCertificate):
        return None
    algorithm, blob = cert.key.export_public_key("openssh").decode().split()[:2]
    return CertificateInfo(
        key=f"{algorithm} {blob}",
        principals=tuple(cert.principals),
        valid_after=_when(cert._valid_after),
        valid_before=_when(cert._valid_before),
        key_id=cert._key_id.decode() if isinstance(cert._key_id, bytes) else str(cert._key_id),
        authority=cert.signing_key.get_fingerprint("sha256"),
    )


def _when(stamp: int) -> datetime:
    # OpenSSH's "forever" (2**64 - 1) is past what datetime holds.
    return datetime.fromtimestamp(min(stamp, 253402300799), UTC)
