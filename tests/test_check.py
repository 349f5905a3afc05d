"""`deploybot check` against the fake Proxmox, as a separate process: a token lacking a
privilege is reported by name with its path and fix (exit 1); a full token passes
(exit 0); --json says the same for machines; a refused token and a missing template
are problems too. No output ever holds the token's secret."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import aiohttp
import pytest
import trustme

from tests.support.fakepve import testing
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, Tls
from tests.support.fakepve.testing import config_text, run_deploybot, start_fake

pve_schema = testing.pve_schema
pve_tls = testing.pve_tls


def write_config(tmp_path: Path, fake: FakePVE, extra: str = "") -> Path:
    path = tmp_path / "deploybot.toml"
    text = config_text(fake, tmp_path, None)
    # Backend settings go into the [[backends]] table, before the first [[subnets]].
    head, sep, tail = text.partition("\n[[subnets]]")
    path.write_text(head + extra + sep + tail, encoding="utf-8")
    return path


async def check(fake: FakePVE, tmp_path: Path, *args: str, extra: str = "") -> tuple[int, str]:
    code, output = await run_deploybot(
        fake, write_config(tmp_path, fake, extra), tmp_path, "check", *args
    )
    log = (tmp_path / "deploybot.log").read_text(encoding="utf-8")
    assert fake.token_secret not in output + log
    assert "Traceback" not in output
    return code, output


async def test_a_token_lacking_vm_clone_is_reported_by_name(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    async with start_fake(pve_schema, pve_tls) as fake:
        fake.acl.revoke("VM.Clone")
        code, output = await check(fake, tmp_path)
    assert code == 1, output
    problems = [line for line in output.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1, output
    assert "pve: privilege VM.Clone on /vms/" in problems[0]
    assert "root@pam!deploybot lacks it, needed to copy the template" in problems[0]
    assert "fix: grant a role with VM.Clone" in output
    assert "1 problem(s)." in output
    assert fake.sent("GET", "/access/permissions")


async def test_a_full_token_passes_every_check(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    extra = 'storage = "local-lvm"\nbridge = "vmbr0"\n'
    async with start_fake(pve_schema, pve_tls) as fake:
        code, output = await check(fake, tmp_path, extra=extra)
    assert code == 0, output
    assert "PROBLEM" not in output
    for name in ("connection", "template ubuntu-24.04", "storage local-lvm", "network vmbr0"):
        assert f"ok       pve: {name}" in output, output
    assert "ok       pve: privileges" in output
    assert "All checks passed." in output


async def test_json_lists_each_check(pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path) -> None:
    async with start_fake(pve_schema, pve_tls) as fake:
        fake.acl.revoke("Datastore.AllocateSpace")
        fake.acl.revoke("VM.PowerMgmt")
        code, output = await check(fake, tmp_path, "--json")
    assert code == 1
    answer = json.loads(output)
    assert answer["ok"] is False
    failed = {c["name"] for c in answer["checks"] if not c["ok"]}
    assert failed == {
        "pve: privilege VM.PowerMgmt on /vms",
        "pve: privilege Datastore.AllocateSpace on /storage/local-lvm",
    }
    assert all(c["fix"] for c in answer["checks"] if not c["ok"])


async def test_a_refused_token_and_a_missing_template(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    async with start_fake(pve_schema, pve_tls) as fake:
        config = write_config(tmp_path, fake).read_text(encoding="utf-8")
        (tmp_path / "deploybot.toml").write_text(
            config.replace('template = "ubuntu-24.04"', 'template = "no-such"'), encoding="utf-8"
        )
        code, output = await run_deploybot(fake, tmp_path / "deploybot.toml", tmp_path, "check")
        assert code == 1, output
        assert "PROBLEM  pve: template no-such: not a template there" in output
        (tmp_path / "deploybot.toml").write_text(
            config.replace('token_id = "deploybot"', 'token_id = "other"'), encoding="utf-8"
        )
        code, output = await run_deploybot(fake, tmp_path / "deploybot.toml", tmp_path, "check")
    assert code == 1, output
    assert "PROBLEM  pve: connection: node list: the API token root@pam!other was refused" in output
    assert fake.token_secret not in output


async def test_the_fakes_revoke_control(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    """`/_fake/revoke` (for a fake run by hand) takes a privilege away on one path."""
    context = ssl.create_default_context(cafile=str(pve_tls.ca_path))
    async with start_fake(pve_schema, pve_tls) as fake, aiohttp.ClientSession() as session:
        url = f"https://127.0.0.1:{fake.port}/_fake/revoke"
        body = {"privilege": "VM.Clone", "path": "/"}
        async with session.post(url, json=body, ssl=context) as answer:
            assert answer.status == 200
        async with session.post(url, json={}, ssl=context) as answer:
            assert answer.status == 400
    assert "VM.Clone" not in fake.acl.effective("/vms/9000")
    assert "VM.Allocate" in fake.acl.effective("/vms/9000")


async def test_an_untrusted_certificate_is_named_with_its_subject(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))  # a CA that did not sign the fake's
    async with start_fake(pve_schema, pve_tls) as fake:
        config = write_config(tmp_path, fake).read_text(encoding="utf-8")
        (tmp_path / "deploybot.toml").write_text(
            config.replace(str(fake.tls.ca_path), str(other)), encoding="utf-8"
        )
        code, output = await run_deploybot(fake, tmp_path / "deploybot.toml", tmp_path, "check")
    assert code == 1, output
    line = next(line for line in output.splitlines() if "pve: connection" in line)
    assert line.startswith("PROBLEM"), output
    assert "is not trusted" in line and f"by ca_bundle {other}" in line
    assert "the server presents a certificate for " in line and ", issued by " in line
    assert "Traceback" not in output


async def test_a_backend_without_its_secret_is_a_problem_not_a_crash(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    extra = 'token_secret_env = "DEPLOYBOT_TEST_UNSET_SECRET"\n'
    async with start_fake(pve_schema, pve_tls) as fake:
        code, output = await check(fake, tmp_path, extra=extra)
    assert code == 1, output
    assert "PROBLEM  pve: set-up: backend pve: no Proxmox credentials" in output
    assert "$DEPLOYBOT_TEST_UNSET_SECRET" in output
    assert not fake.requests  # nothing was asked of the API without credentials


async def test_privileges_that_could_not_be_checked_are_a_problem_not_ok(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path
) -> None:
    """Issue 25, item 16: with the default template missing, the privileges (VM.Allocate
    revoked here) cannot be asked; that is said as a problem, never "ok"."""
    async with start_fake(pve_schema, pve_tls) as fake:
        fake.acl.revoke("VM.Allocate")
        config = write_config(tmp_path, fake).read_text(encoding="utf-8")
        (tmp_path / "deploybot.toml").write_text(
            config.replace('template = "ubuntu-24.04"', 'template = "no-such"'), encoding="utf-8"
        )
        code, output = await run_deploybot(fake, tmp_path / "deploybot.toml", tmp_path, "check")
    assert code == 1, output
    assert "ok       pve: privileges" not in output
    line = next(x for x in output.splitlines() if "pve: privileges" in x)
    assert line.startswith("PROBLEM  pve: privileges: not checked: template 'no-such' does not")
    assert "run `deploybot check` again" in output
    assert "2 problem(s)." in output, output
    assert fake.token_secret not in output and "Traceback" not in output


@pytest.mark.parametrize(
    ("release", "revoke", "named"),
    [
        ("8.2", ["VM.Monitor"], "VM.Monitor"),
        ("9.0", ["VM.GuestAgent.FileRead", "VM.GuestAgent.Unrestricted"], "VM.GuestAgent.FileRead"),
    ],
)
async def test_the_guest_agents_file_read_privilege_of_the_release_is_named(
    pve_schema: ApiSchema, pve_tls: Tls, tmp_path: Path, release: str, revoke: list[str], named: str
) -> None:
    """Issue 28: the SSH host keys are read through the agent's file-read, whose
    privilege changed with PVE 9.0 (qemu-server's Agent.pm)."""
    async with start_fake(pve_schema, pve_tls, release=release) as fake:
        for privilege in revoke:
            fake.acl.revoke(privilege)
        code, output = await check(fake, tmp_path)
    assert code == 1, output
    problems = [line for line in output.splitlines() if line.startswith("PROBLEM")]
    assert any(
        f"privilege {named} on /vms" in p and "read the SSH host keys" in p for p in problems
    ), output
