"""Commands from chat, kept from their acknowledgement until they are answered.

A chat front end acknowledges a command at once (Slack allows 3 s) and carries it out
afterwards; a process that dies in between must not lose it silently. So the front end
calls `receive` before it acknowledges and `done` once it has answered, and looks for
`orphans` now and then: commands whose runner died before answering them, taken over
(store/inbox.py) and carried out again under the same dedupe key, so one that had
already made its job is answered as such rather than run twice.
"""

from __future__ import annotations

from bot import progress as tell
from bot.models import JobEvent, Received
from bot.service import Deployer

ORPHANS_PER_LOOK = 10
RESUMED_STEP = "inbox"  # the job event that says its command was carried out late


async def tell_resumed(deployer: Deployer, key: str, text: str) -> bool:
    """The command kept under `key`, taken over from a process that stopped before
    answering, made (or had made) a job: say so in that job's thread (`text`), once,
    through the outbox. The person may have been shown an error by the chat while the
    VM was being built; this tells the channel the command is carried out after all.
    False when the command made no job, or the job was already told."""
    store = deployer.store
    job_id = await store.delivered(key)
    if job_id is None:
        return False
    if any(e.step == RESUMED_STEP for e in await store.events(job_id)):
        return False  # told by a process that stopped before striking the command
    event = JobEvent(job_id=job_id, step=RESUMED_STEP, phase="note", detail=text)
    await store.add_event(event, tell.noted(job_id, text))
    return True


async def receive(deployer: Deployer, key: str, user: str, channel: str, text: str) -> bool:
    """Keep the command for this runner; False when this delivery was received before."""
    own = deployer.ownership
    now = own.clock()
    item = Received(key=key, user=user, channel=channel, text=text, received_at=now)
    return await deployer.store.inbox_add(item, own.id, own.lease_until(now))


async def done(deployer: Deployer, key: str) -> None:
    await deployer.store.inbox_done(key, deployer.ownership.clock())


async def orphans(deployer: Deployer) -> list[Received]:
    """Commands a dead runner took and never answered, now this runner's to carry out.
    Only a long-lived process takes them (a one-shot CLI run takes nothing over)."""
    own = deployer.ownership
    if not own.takes_over or own.closing:
        return []
    now = own.clock()
    return await deployer.store.inbox_claim_orphaned(
        own.id, now, own.lease_until(now), ORPHANS_PER_LOOK
    )
