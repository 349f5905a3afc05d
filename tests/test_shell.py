"""The local chat, in-process: a requester, an approver, and the thread they see."""

from __future__ import annotations

import io
from pathlib import Path

from backends.sim import SimBackend
from bot.app.runtime import running_deployer
from handlers.terminal import Shell, TerminalThread
from tests.support.deployer import make_settings


async def test_request_approve_and_watch_the_thread(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, approval={"approvers": ["alice", "bob"], "always": True})
    out = io.StringIO()
    sim = SimBackend("sim", time_scale=0.001)
    async with running_deployer(settings, TerminalThread(out), backends={"sim": sim}) as d:
        shell = Shell(d, "alice", out)
        await shell.handle("/deploy web01 10.0.0.50")
        job_id = (await d.history(1))[0].id
        short = job_id[:8]  # what the thread shows, and what people type
        await shell.handle(f"approve {short}")
        assert "You cannot approve or reject your own request" in out.getvalue()
        await shell.handle("as bob")
        await shell.handle(f"approve {short}")
        await d.drain()
        await shell.handle(f"/deploy status {short}")
        await shell.handle("/deploy templates")
        await shell.handle("/deploy web02 10.0.0.500")
        await shell.handle("/deploy")
    text = out.getvalue()
    assert f"┌ web01 10.0.0.50 on sim: awaiting approval (job {job_id})" in text
    assert f"[web01 {short}] approved; queued." in text
    assert f"[web01 {short}]     ssh ubuntu@10.0.0.50" in text
    assert "└ web01 10.0.0.50 on sim: ready" in text
    assert f"bot: Job {job_id}: web01 10.0.0.50 on sim: ready (requested by alice)" in text
    assert "approved by bob at" in text
    assert "bot: sim: ubuntu-24.04 (ubuntu), debian-12 (debian), rocky-9 (el9)" in text
    assert "bot: `10.0.0.500` is not an IPv4 address" in text
    assert "bot: Tell me what to deploy." in text
    assert "Traceback" not in text


async def test_reject_and_cancel_from_the_shell(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, approval={"approvers": ["bob"], "always": True})
    out = io.StringIO()
    async with running_deployer(settings, TerminalThread(out), backends={"sim": SimBackend()}) as d:
        shell = Shell(d, "alice", out)
        await shell.handle("/deploy web01 10.0.0.50")
        await shell.handle("/deploy web02 10.0.0.51")
        first, second = [j.id for j in reversed(await d.history(2))]
        await shell.handle(f"cancel {second}")
        shell.user = "bob"
        await shell.handle(f"reject {first} use the staging subnet")
        await shell.handle("history")
    text = out.getvalue()
    assert f"bot: Job {second} cancelled before it started; nothing was built." in text
    assert "rejected: use the staging subnet. Change the request and ask again." in text
    assert f"bot: Job {first}: rejected; alice has been told why." in text
