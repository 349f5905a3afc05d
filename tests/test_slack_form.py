"""`/deploy` alone: the modal opens at once, fills from discovery, checks fields, deploys."""

from __future__ import annotations

import json
from pathlib import Path

from backends.base import Template
from backends.sim import SimBackend
from bot.models import JobState
from tests.support.deployer import SIM_SCALE
from tests.support.slack.bot import ALICE, CHANNEL, block, is_reply, open_form, slack_bot, state

KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGvFv0mBq3ZkBUnh3BwrQ8QlUjcB1uWs6KmRZVb0iCq0 alice@laptop"
)


async def test_the_form_fills_in_and_states_the_clone_kind_before_submit(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        view_id = await open_form(h)
        view = h.fake.views[view_id]
        templates = [o["value"] for o in block(view, "template")["element"]["options"]]
        assert templates == ["sim|ubuntu-24.04", "sim|debian-12", "sim|rocky-9"]
        storage = [o["text"]["text"] for o in block(view, "storage")["element"]["options"]]
        assert storage == ["local-lvm (380 GiB free)", "bulk-nfs (2,900 GiB free)"]
        assert "fast linked clone" in json.dumps(view["blocks"])
        assert block(view, "upgrade")["element"].get("initial_options") is None

        chosen = state(view, storage="bulk-nfs")
        await h.choose(view_id, chosen, "storage")
        await h.settle()
        updated = json.dumps(h.fake.views[view_id]["blocks"])
        assert "*full copy: minutes, not seconds*" in updated


async def test_field_errors_come_back_on_their_blocks(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        view_id = await open_form(h)
        view = h.fake.views[view_id]
        missing = await h.submit(view_id, state(view))
        answer = json.loads(missing.body)
        assert answer["response_action"] == "errors"
        assert set(answer["errors"]) == {"name"}  # an empty address: the next free one
        assert answer["errors"]["name"] == "VM name is required."

        bad = state(view, name="web01", address="10.9.9.9", keys="ssh-rsa notbase64!")
        errors = json.loads((await h.submit(view_id, bad)).body)["errors"]
        assert set(errors) == {"keys"} and "base64" in errors["keys"]
        bad = state(view, name="web01", address="10.9.9.9")
        errors = json.loads((await h.submit(view_id, bad)).body)["errors"]
        assert (
            set(errors) == {"address"} and "not in a subnet deploybot may use" in errors["address"]
        )
        await h.settle()
        assert await h.deployer.history() == []
        assert len(await h.deployer.store.audit.events()) == 3


async def test_a_submitted_form_deploys_with_saved_key_and_an_explicit_no_upgrade(
    tmp_path: Path,
) -> None:
    async with slack_bot(tmp_path) as h:
        await h.command(f"key {KEY}")
        await h.settle()
        view_id = await open_form(h)
        view = h.fake.views[view_id]
        assert block(view, "keys")["element"]["initial_value"] == KEY  # prefilled
        chosen = state(view, name="web01", address="10.0.0.50", storage="bulk-nfs", memory="4096")
        response = await h.submit(view_id, chosen)
        assert response.status == 200 and response.body == ""
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.50"))
        await h.settle()
        job = (await h.deployer.history(1))[0]
        assert job.state is JobState.SUCCEEDED and job.origin == CHANNEL
        assert job.request.upgrade is False and job.request.ssh_keys == (KEY,)
        assert (job.request.storage, job.request.memory_mib) == ("bulk-nfs", 4096)
        again = await h.submit(view_id, chosen)  # Slack redelivers the submission
        await h.settle()
        assert again.status == 200 and len(await h.deployer.history()) == 1


async def test_a_form_without_an_address_deploys_on_the_next_free_one(tmp_path: Path) -> None:
    async with slack_bot(tmp_path) as h:
        view_id = await open_form(h)
        chosen = state(h.fake.views[view_id], name="web01", keys=KEY)
        assert (await h.submit(view_id, chosen)).status == 200
        await h.fake.wait_for(is_reply("ssh ubuntu@10.0.0.100"))
        await h.settle()
        job = (await h.deployer.history(1))[0]
        assert job.address == "10.0.0.100" and job.request.picked


async def test_a_name_in_flight_is_a_field_error(tmp_path: Path) -> None:
    approval = {"approvers": ["UBOB00001"], "always": True}
    async with slack_bot(tmp_path, approval=approval) as h:
        await h.command("web01 10.0.0.50")
        await h.settle()
        view_id = await open_form(h)
        chosen = state(h.fake.views[view_id], name="web01", address="10.0.0.50")
        errors = json.loads((await h.submit(view_id, chosen)).body)["errors"]
        assert "already being deployed" in errors["name"]
        assert "already taken" in errors["address"]


class ManyTemplates(SimBackend):
    async def templates(self) -> list[Template]:
        return [Template(f"img-{n:03d}-{'x' * 80}", "ubuntu") for n in range(150)]


async def test_over_a_hundred_templates_use_an_external_select(tmp_path: Path) -> None:
    sim = ManyTemplates("sim", time_scale=SIM_SCALE)
    async with slack_bot(tmp_path, backend=sim) as h:
        view_id = await open_form(h)
        element = block(h.fake.views[view_id], "template")["element"]
        assert element["type"] == "external_select"
        everything = json.loads((await h.suggest(view_id, "template", "")).body)["options"]
        assert len(everything) == 100
        assert all(len(o["text"]["text"]) <= 75 for o in everything)
        found = json.loads((await h.suggest(view_id, "template", "img-12")).body)["options"]
        assert [o["value"][:11] for o in found] == [f"sim|img-12{n}" for n in range(10)]
        assert ALICE
