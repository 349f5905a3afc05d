"""Block Kit for Slack, built with `slack_sdk.models` so Slack's limits are checked here.

`to_dict()` on these objects validates the limits (100 options, 75-character option text,
3000-character sections, 24-character modal titles...), so a payload that Slack would
refuse fails in our code and our tests, not in a user's channel. Long text is split or
cut to fit before it is wrapped. Wording comes from handlers/messages/.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime, tzinfo
from typing import Any

from slack_sdk.models.blocks import (
    ActionsBlock,
    Block,
    ButtonElement,
    ConfirmObject,
    ContextBlock,
    HeaderBlock,
    InputBlock,
    MarkdownTextObject,
    Option,
    PlainTextInputElement,
    PlainTextObject,
    SectionBlock,
    StaticSelectElement,
)
from slack_sdk.models.views import View

from bot.app.queries import VMPage
from bot.models import Job, JobState
from bot.models.builds import Build
from bot.models.errors import UserError
from handlers.messages.builds import build_approval_summary, build_context
from handlers.messages.destroys import destroy_confirm, destroy_summary
from handlers.messages.listing import list_empty, list_row, list_title
from handlers.messages.slack import (
    FORM_LABELS,
    FORM_LOADING,
    REJECT_TITLE,
    approval_summary,
    reject_question,
)
from handlers.messages.text import Said, escape, mention

SECTION_MAX = 3000
OPTION_TEXT_MAX = 75
MESSAGE_BLOCKS_MAX = 50  # Slack's limit for a message (a modal allows 100)
SELECT_MAX = 100  # options in a static select

# action_id / callback_id values the app listens for.
APPROVE = "approve"
REJECT = "reject"
REJECT_VIEW = "reject_reason"
DESTROY = "destroy"  # value: the job id (the thread's parent, a row of the list)
LIST_PAGE = "list_page"  # value: JSON {"user": whose or null, "page": N}
LEASE_EXTEND = "lease_extend"  # value: the job id (a lease reminder's Extend button)


def mrkdwn(text: str | Said, people: Sequence[str] = ()) -> str:
    """Plain text as mrkdwn that shows it as typed (`<!channel>` or `<@U123>` typed by
    someone pings nobody), with the people the bot itself named in it made mentions:
    `people` (or a `Said`'s) are ids from the bot's records, each shown as a mention
    where it first appears, since the bot names people before anything typed. Nothing
    else becomes a mention: an id someone typed (in a reason, a name, a template) is
    text, even one that looks like a member's."""
    if isinstance(text, Said):
        people = (*people, *text.people)
        text = text.text
    shown = escape(text)
    for person in dict.fromkeys(p for p in people if p):
        shown = _whole(person).sub(lambda m: mention(m[0]), shown, count=1)
    return shown


def refusal(exc: UserError) -> list[Said]:
    """An error's lines, with the people the core named in it (bot.models.errors)."""
    return [Said(line, exc.people) for line in exc.message.splitlines()]


def typed(text: str) -> str:
    """Text as the person typed it. Slack escapes `&`, `<` and `>` in the text of a slash
    command (`R&D <2` arrives as `R&amp;D &lt;2`); undone once here, where it comes in,
    so the store keeps what was typed and output escapes it exactly once. `&amp;` last,
    so a typed `&lt;` (sent as `&amp;lt;`) stays `&lt;`."""
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def _whole(person: str) -> re.Pattern[str]:
    """The id as a whole word (not inside a longer id, nor a mention already made)."""
    return re.compile(rf"(?<![\w@]){re.escape(person)}(?!\w)")


def fit(text: str, limit: int) -> str:
    """Cut text to `limit` characters, marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def chunks(text: str, limit: int = SECTION_MAX) -> list[str]:
    """Split text at line ends into pieces of at most `limit` characters."""
    pieces: list[str] = []
    current = ""
    for line in text.splitlines():
        while len(line) > limit:  # a single line longer than a section
            pieces.append(line[:limit])
            line = line[limit:]
        candidate = f"{current}\n{line}" if current else line
        if len(candidate) > limit:
            pieces.append(current)
            current = line
        else:
            current = candidate
    if current or not pieces:
        pieces.append(current or " ")
    return pieces


def option(text: str, value: str) -> Option:
    return Option(text=PlainTextObject(text=fit(text, OPTION_TEXT_MAX)), value=value[:150])


def lines_blocks(lines: Sequence[str], *, monospace: bool = False) -> list[Block]:
    """Reply lines as sections (a table in a code block keeps its columns)."""
    text = "\n".join(lines)
    size = SECTION_MAX - 6 if monospace else SECTION_MAX
    parts = chunks(text, size)[:MESSAGE_BLOCKS_MAX]
    wrap = (lambda p: f"```{p}```") if monospace else (lambda p: p)
    return [SectionBlock(text=MarkdownTextObject(text=wrap(p))) for p in parts]


def answer(lines: Sequence[str], *, monospace: bool = False) -> list[dict[str, Any]]:
    """An ephemeral answer as validated block dicts; `lines` are mrkdwn already."""
    return dicts(lines_blocks(lines, monospace=monospace))


def dicts(blocks: Sequence[Block]) -> list[dict[str, Any]]:
    return [block.to_dict() for block in blocks]


# --- the job's thread ---------------------------------------------------------------


def parent(job: Job, headline: str) -> list[dict[str, Any]]:
    """The channel message that stands for one deploy; `chat.update` keeps it current.
    `headline` is mrkdwn already (messages.slack_headline)."""
    context = f"job {job.short_id} · requested by {mention(job.requester)}"
    blocks: list[Block] = [
        SectionBlock(text=MarkdownTextObject(text=fit(f"*{headline}*", SECTION_MAX))),
        ContextBlock(elements=[MarkdownTextObject(text=context)]),
    ]
    if job.state is JobState.SUCCEEDED:  # ready: it can be destroyed from here
        blocks.append(ActionsBlock(block_id="vm", elements=[destroy_button(job)]))
    return dicts(blocks)


def build_parent(build: Build, headline: str) -> list[dict[str, Any]]:
    """The channel message that stands for one template build (`headline`: mrkdwn)."""
    return dicts(
        [
            SectionBlock(text=MarkdownTextObject(text=fit(f"*{headline}*", SECTION_MAX))),
            ContextBlock(elements=[MarkdownTextObject(text=build_context(build))]),
        ]
    )


def build_approval_request(build: Build) -> list[dict[str, Any]]:
    """The card asking approvers for a template build: the same buttons as a deploy's
    (their value is the build's id; the click looks its kind up: bot/kinds/)."""
    summary = SectionBlock(
        block_id="summary",
        text=MarkdownTextObject(text=fit(build_approval_summary(build), SECTION_MAX)),
    )
    buttons = ActionsBlock(
        block_id="decision",
        elements=[
            ButtonElement(text="Approve", action_id=APPROVE, value=build.id, style="primary"),
            ButtonElement(text="Reject", action_id=REJECT, value=build.id, style="danger"),
        ],
    )
    return dicts([summary, buttons])


def build_approval_decided(build: Build, outcome: str) -> list[dict[str, Any]]:
    summary = SectionBlock(
        block_id="summary",
        text=MarkdownTextObject(text=fit(build_approval_summary(build), SECTION_MAX)),
    )
    return dicts([summary, _outcome(outcome)])


def _outcome(outcome: str) -> ContextBlock:
    """The decision under a card (a reason of any length, cut to fit)."""
    return ContextBlock(elements=[MarkdownTextObject(text=fit(outcome, SECTION_MAX))])


def destroy_button(job: Job, label: str = "Destroy") -> ButtonElement:
    """Destroy, after Slack asks "are you sure?" (the core checks who may)."""
    confirm = ConfirmObject(
        title=fit(f"Destroy {job.name}?", 100),
        text=fit(destroy_confirm(job), 300),
        confirm="Destroy",
        deny="Keep it",
    )
    return ButtonElement(
        text=label, action_id=DESTROY, value=job.id, style="danger", confirm=confirm
    )


def lease_reminder(job: Job, text: str, step: str) -> list[dict[str, Any]]:
    """A lease reminder by direct message (`text`: mrkdwn) with Extend and Destroy now."""
    extend = ButtonElement(
        text=fit(f"Extend by {step}", 75), action_id=LEASE_EXTEND, value=job.id, style="primary"
    )
    buttons = ActionsBlock(block_id="lease", elements=[extend, destroy_button(job, "Destroy now")])
    return dicts([SectionBlock(text=MarkdownTextObject(text=fit(text, SECTION_MAX))), buttons])


# --- /deploy list -------------------------------------------------------------------


def vm_list(page: VMPage, me: str, now: datetime, zone: tzinfo = UTC) -> list[dict[str, Any]]:
    """One page of VMs: a row each (a Destroy button on the ready ones) and Previous /
    Next, lease ends in the reader's `zone`. 10 rows a page keep it far under Slack's 50
    blocks."""
    if not page.jobs:
        return answer([escape(list_empty(page, me))])
    title = escape(list_title(page, me))
    blocks: list[Block] = [SectionBlock(text=MarkdownTextObject(text=f"*{title}*"))]
    for job in page.jobs:
        row = fit(list_row(job, now, zone), SECTION_MAX)
        button = destroy_button(job) if job.state is JobState.SUCCEEDED else None
        blocks.append(SectionBlock(text=MarkdownTextObject(text=row), accessory=button))
    turns = [("Previous", page.page - 1), ("Next", page.page + 1)]
    buttons = [
        ButtonElement(
            text=label,
            action_id=f"{LIST_PAGE}_{label.lower()}",
            value=json.dumps({"user": page.requester, "page": number}),
        )
        for label, number in turns
        if 1 <= number <= page.pages
    ]
    if buttons:
        blocks.append(ActionsBlock(block_id="pages", elements=buttons))
    return dicts(blocks[:MESSAGE_BLOCKS_MAX])


# --- approvals ----------------------------------------------------------------------


def approval_request(job: Job) -> list[dict[str, Any]]:
    summary = SectionBlock(
        block_id="summary",
        text=MarkdownTextObject(text=fit(approval_summary(job), SECTION_MAX)),
    )
    buttons = ActionsBlock(
        block_id="decision",
        elements=[
            ButtonElement(text="Approve", action_id=APPROVE, value=job.id, style="primary"),
            ButtonElement(text="Reject", action_id=REJECT, value=job.id, style="danger"),
        ],
    )
    return dicts([summary, buttons])


def destroy_request(job: Job) -> list[dict[str, Any]]:
    """The card asking approvers for a destroy: the same buttons as a deploy's."""
    summary = SectionBlock(
        block_id="summary",
        text=MarkdownTextObject(text=fit(destroy_summary(job), SECTION_MAX)),
    )
    buttons = ActionsBlock(
        block_id="decision",
        elements=[
            ButtonElement(text="Approve", action_id=APPROVE, value=job.id, style="danger"),
            ButtonElement(text="Reject", action_id=REJECT, value=job.id),
        ],
    )
    return dicts([summary, buttons])


def destroy_decided(job: Job, outcome: str) -> list[dict[str, Any]]:
    summary = SectionBlock(
        block_id="summary",
        text=MarkdownTextObject(text=fit(destroy_summary(job), SECTION_MAX)),
    )
    return dicts([summary, _outcome(outcome)])


def approval_decided(job: Job, outcome: str) -> list[dict[str, Any]]:
    """The request with its buttons replaced by who decided and when."""
    summary = SectionBlock(
        block_id="summary",
        text=MarkdownTextObject(text=fit(approval_summary(job), SECTION_MAX)),
    )
    return dicts([summary, _outcome(outcome)])


def reject_modal(job_id: str, noun: str, metadata: dict[str, str]) -> View:
    reason = InputBlock(
        block_id="reason",
        label=FORM_LABELS["reason"],
        element=PlainTextInputElement(action_id="reason", multiline=True, max_length=500),
    )
    return View(
        type="modal",
        callback_id=REJECT_VIEW,
        title=REJECT_TITLE,
        submit="Reject",
        close="Cancel",
        private_metadata=json.dumps({**metadata, "job_id": job_id}),
        blocks=[
            SectionBlock(text=MarkdownTextObject(text=reject_question(job_id, noun))),
            reason,
        ],
    )


# --- simple modals --------------------------------------------------------------------


def loading_modal(callback_id: str, title: str, metadata: str) -> View:
    """Opened at once (a trigger id lives 3 s); filled by views.update after look-ups."""
    return View(
        type="modal",
        callback_id=callback_id,
        title=title,
        close="Cancel",
        private_metadata=metadata,
        blocks=[SectionBlock(text=PlainTextObject(text=FORM_LOADING))],
    )


def select(
    action_id: str,
    options: Sequence[Option],
    *,
    initial: str | None = None,
    placeholder: str = "Choose…",
) -> StaticSelectElement:
    chosen = next((o for o in options if o.value == initial), None)
    return StaticSelectElement(
        action_id=action_id,
        placeholder=placeholder,
        options=list(options)[:SELECT_MAX],
        initial_option=chosen,
    )


def header(text: str) -> HeaderBlock:
    return HeaderBlock(text=fit(text, 150))
