"""What a person is told about a VM's SSH host key: the fingerprint, how deploybot
confirmed it, and a ready known_hosts line (the end of a deploy, its DM, and
`/deploy known-hosts NAME`)."""

from __future__ import annotations

from backends.sshcheck import fingerprint
from bot.models import HostKeySource, Job
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
    ]


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
        f"{job.name} (job {job.short_id}) is {STATE_LABELS[job.state]}: only a VM that is "
        f"ready has a host key to show. See `/deploy status {job.short_id}`."
    )


def no_key_recorded(job: Job) -> str:
    return (
        f"{job.name} (job {job.short_id}) has no host key recorded: its SSH check read "
        "none. Read it from the VM's console (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`) "
        "before you trust a first connection."
    )
