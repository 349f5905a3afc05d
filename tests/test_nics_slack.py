"""Several NICs from Slack (issue 29): the form's optional "More NICs" field takes the
same `+` words and `mac2=` as the text, its mistakes come back on that field, and the
ready message, status and history show every NIC's address."""

from __future__ import annotations

import json
from pathlib import Path

from bot.models import JobState
from handlers.messages.reports import history_line
from tests.support.slack.bot import block, is_reply, open_form, slack_bot, state

KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGvFv0mBq3ZkBUnh3BwrQ8QlUjcB1uWs6KmRZVb0iCq0 alice@laptop"
)
SUBNETS = [
    {"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "name": "lab", "pool": "10.0.0.100-10.0.0.199"},
    {"cidr": "10.0.20.0/24", "gateway": "10.0.20.1", "name": "lab20"},
]
MAC = "52:54:00:12:34:56"


async def test_the_form_takes_more_nics_and_refuses_mistakes_on_that_field(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path, subnets=SUBNETS) as h:
        view_id = await open_form(h)
        view = h.fake.views[view_id]
        assert "+lab20" in block(view, "nics")["hint"]["text"]
        for typed, said in (
            ("+10.0.0.7", "NIC 2 (10.0.0.7) is in lab like NIC 1"),
            ("web02", "`web02`: give +ADDRESS or +SUBNET per NIC"),
            ("+lab20 mac2=zz", "mac2=zz: 'zz' is not a MAC address"),
        ):
            bad = state(view, name="web01", address="10.0.0.50", keys=KEY, nics=typed)
            errors = json.loads((await h.submit(view_id, bad)).body)["errors"]
            assert set(errors) == {next(b for b in errors if b.startswith("nics"))}, errors
            assert said in next(iter(errors.values())), errors
        chosen = state(view, name="web01", address="10.0.0.50", keys=KEY, nics=f"+lab20 mac2={MAC}")
        assert (await h.submit(view_id, chosen)).status == 200
        ready = await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        assert f"net1 10.0.20.2/24 (lab20, MAC {MAC})" in json.dumps(ready.args)
        await h.settle()
        job = (await h.deployer.history(1))[0]
        assert job.state is JobState.SUCCEEDED
        assert [str(n.address) for n in job.request.nics] == ["10.0.20.2/24"]
        assert job.request.nics[0].mac == MAC
        assert " 10.0.0.50 +1 " in history_line(job)
        await h.command(f"status {job.id}")
        shown = await h.fake.wait_for(is_reply("NICs: net0 10.0.0.50/24 (lab), net1 10.0.20.2/24"))
        assert shown is not None
