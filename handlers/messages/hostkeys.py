"""What a person is told about a VM's SSH host key: the fingerprint, how deploybot
confirmed it, a ready known_hosts line, and its host certificate when deploybot's host CA
signed one (the end of a deploy, its DM, and `/deploy known-hosts NAME`); and
`/deploy ssh-ca`, the @cert-authority line."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from backends.sshcheck import fingerprint
from bot.models import HostKeySource, Job, utcnow
from bot.sshca.authority import HostCA
from bot.sshca.certificates import read_certificate
from bot.sshca.revocation import RevokedKey
from handlers.messages.text import STATE_LABELS

HOW_CONFIRMED = {
    HostKeySource.AGENT: (
        "confirmed through the hypervisor's guest agent, which read it inside the VM "
        "(not over the network)"
    ),
    HostKeySource.CHOSEN: "chosen by deploybot and installed by the hypervisor",
    HostKeySource.SSH: (
        "only seen over SSH: the hypervisor could not confirm it (a backend that can neither "
        "read a guest's keys nor choose them), so compare it with the VM's console before "
        "you trust it"
    ),
}


def host_key_lines(job: Job) -> list[str]:
    """The host key's sentences; lines indented by four spaces are to be copied as they
    are. Nothing when no key was read; a job recorded before keys were kept whole has
    only its fingerprint, said as it was."""
    if not job.host_key:
        return []
    line = job.known_hosts_line
    if line is None:
        return [f"Its host key is {job.host_key}: check that ssh shows the same."]
    how = HOW_CONFIRMED.get(job.host_key_source or HostKeySource.SSH, "")
    return [
        f"Its host key is {fingerprint(job.host_key)}, {how}. For ~/.ssh/known_hosts:",
        f"    {line}",
        *certificate_lines(job),
    ]


def known_hosts_answer(job: Job) -> list[str]:
    """`known-hosts NAME`: the line again, with how it was confirmed."""
    line = job.known_hosts_line
    if line is None:
        return known_hosts_fingerprint_only(job)
    how = HOW_CONFIRMED.get(job.host_key_source or HostKeySource.SSH, "")
    return [
        f"{job.name} {job.final_address or job.address} (job {job.short_id}): host key "
        f"{fingerprint(line.split(' ', 1)[1])}, {how}. Add this line to ~/.ssh/known_hosts:",
        f"    {line}",
        *certificate_lines(job),
    ]


def certificate_lines(job: Job, now: datetime | None = None) -> list[str]:
    """The sentence about the VM's host certificate; nothing when it has none. One past
    its end is said to have ended (ssh refuses it), not to hold until a past date."""
    info = read_certificate(job.host_certificate) if job.host_certificate else None
    if info is None:
        return []
    until = info.valid_before
    when = f"{until.day} {until:%b %Y %H:%M} UTC"
    if until <= (now or utcnow()):
        return [
            f"Its host certificate from deploybot's host CA ended {when}: ssh no longer "
            "trusts it through the @cert-authority line, only through the line above."
        ]
    return [
        f"It is certified by deploybot's host CA until {when} for "
        f"{', '.join(info.principals)}: with the @cert-authority line from `deploybot "
        "ssh-ca` (or `/deploy ssh-ca`) in ~/.ssh/known_hosts, ssh trusts it without asking "
        "when you connect by a name that line's patterns cover."
    ]


def authority_answer(
    ca: HostCA | None, revoked: Sequence[RevokedKey] = (), cap: int | None = None
) -> list[str]:
    """`ssh-ca`: the @cert-authority line for known_hosts, or how to get one; then the
    @revoked lines of keys of VMs that are gone (the first `cap`, the rest counted).
    The lines for known_hosts are the indented ones."""
    if ca is None:
        return [
            "This deploybot has no host CA, so its VMs' host keys are not certified: compare "
            "each VM's key with the line its ready message gives (`/deploy known-hosts "
            "NAME`). An operator sets one up: make a key without a passphrase (`ssh-keygen "
            "-t ed25519 -N '' -f host_ca`), put the file's text in the environment variable "
            "DEPLOYBOT_SSH_HOST_CA, and set `host_ca_env = 'DEPLOYBOT_SSH_HOST_CA'` under "
            "[ssh] in deploybot.toml (the docs: usage, Host certificates)."
        ]
    return [
        f"deploybot's host CA ({ca.fingerprint}) certifies the host keys of the VMs it "
        f"builds for {', '.join(ca.patterns)}. Add this line to ~/.ssh/known_hosts, and ssh "
        "asks nothing about those VMs' keys while their certificates hold:",
        f"    {ca.authority_line()}",
        *_revoked_lines(revoked, cap),
    ]


def _revoked_lines(revoked: Sequence[RevokedKey], cap: int | None) -> list[str]:
    if not revoked:
        return []
    shown = revoked if cap is None else revoked[:cap]
    lines = [
        f"{len(revoked)} VM(s) are gone whose host keys are certified still (until "
        f"{revoked[-1].until:%Y-%m-%d %H:%M} UTC at the latest). Add these lines too, and "
        "ssh refuses those keys, so nobody who kept one can pass for a new VM of that "
        "name or address:",
        *(f"    {key.line}" for key in shown),
    ]
    if len(shown) < len(revoked):
        lines.append(f"... and {len(revoked) - len(shown)} more: `deploybot ssh-ca` prints all.")
    return lines


def known_hosts_fingerprint_only(job: Job) -> list[str]:
    assert job.host_key is not None
    return [
        f"{job.name} (job {job.short_id}) was deployed before deploybot kept whole host "
        f"keys: only its fingerprint is recorded, {job.host_key}. Run "
        f"`ssh-keyscan {job.final_address or job.address}` from a trusted network and "
        "compare the fingerprint (`ssh-keygen -lf`) before you add its line."
    ]


def not_ready(job: Job) -> str:
    return (
        f"{job.name} (job {job.short_id}) is not ready ({STATE_LABELS[job.state]}): only a "
        f"VM that is ready has a host key to show. See `/deploy status {job.short_id}`."
    )


def no_key_recorded(job: Job) -> str:
    return (
        f"{job.name} (job {job.short_id}) has no host key recorded: its SSH check read "
        "none. Read it from the VM's console (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`) "
        "before you trust a first connection."
    )
