"""Keys to refuse: a VM that is gone leaves its host key certified until the certificate
ends (its lease's end, or `certificate_days`). Whoever had root on it could have copied
the key and its certificate, and a later VM given the same name or address could then
be impersonated with them. `@revoked` lines in known_hosts make ssh refuse those keys
(and every certificate of them) before the certificates end; `deploybot ssh-ca` prints
them below the `@cert-authority` line."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from bot.models import FINAL_STATES, JobState
from bot.sshca.certificates import read_certificate
from store.db import Store

# A job in one of these states no longer has its VM; in any other, it has (or will).
GONE = FINAL_STATES - {JobState.SUCCEEDED}


@dataclass(frozen=True)
class RevokedKey:
    name: str  # the VM that held it (the last one, if several did)
    key: str  # the public key line ("ssh-ed25519 AAAA...")
    until: datetime  # when its last certificate ends: the line may go after that

    @property
    def line(self) -> str:
        """The known_hosts line that makes ssh refuse the key for every host."""
        return f"@revoked * {self.key} deploybot-gone:{self.name}"


def _key(line: str) -> str:
    return " ".join(line.split()[:2])


async def revoked_keys(store: Store, now: datetime) -> list[RevokedKey]:
    """The host keys of VMs that are gone whose certificates have not ended, oldest
    end first; never a key a VM still holds (clones of a template whose keys were
    never regenerated share them: refusing one would refuse the living)."""
    alive = set(JobState) - GONE
    held = {_key(key) for _name, key, _cert in await store.jobs.host_keys(alive) if key}
    found: dict[str, RevokedKey] = {}
    for name, _key_line, certificate in await store.jobs.host_keys(GONE):
        info = read_certificate(certificate) if certificate else None
        if info is None or info.valid_before <= now or _key(info.key) in held:
            continue
        key = _key(info.key)
        known = found.get(key)
        if known is None or known.until < info.valid_before:
            found[key] = RevokedKey(name, key, info.valid_before)
    return sorted(found.values(), key=lambda r: (r.until, r.name))
