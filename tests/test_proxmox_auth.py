"""ProxmoxBackend's connection: token and ticket auth (CSRF, renewal), TLS, the mapping
of every failure to backends.base errors, secrets kept out of messages and logs, and an
event loop that never waits for the network."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pydantic
import pytest

from backends.base import PermanentError, RetryableError, Unreachable
from backends.proxmox import create
from backends.proxmox.config import Config
from tests.support.fakepve import testing
from tests.support.fakepve.server import FakePVE
from tests.support.fakepve.testing import config_data, environ, make_backend

# The fake server's fixtures, shared by the Proxmox test modules.
pve = testing.pve
pve_schema = testing.pve_schema
pve_tls = testing.pve_tls

TICKET = "/access/ticket"


async def test_token_auth_needs_no_login(pve: FakePVE) -> None:
    backend = make_backend(pve)
    try:
        assert [p.name for p in await backend.placements()] == ["pve1", "pve2"]
    finally:
        await backend.close()
    assert pve.sent("POST", TICKET) == []
    assert backend.api.logins == 0


async def test_ticket_auth_logs_in_once_and_sends_csrf_on_writes(pve: FakePVE) -> None:
    backend = make_backend(pve, auth="password")
    try:
        await backend.placements()
        # A write: the fake refuses it (401) without the CSRFPreventionToken header.
        await backend.api.post("nodes/pve1/qemu/100/config", "write", description="ticket write")
    finally:
        await backend.close()
    assert len(pve.sent("POST", TICKET)) == 1
    writes = pve.sent("POST", "/nodes/{node}/qemu/{vmid}/config")
    assert [w.status for w in writes] == [200]


async def test_the_ticket_is_renewed_before_it_expires(pve: FakePVE) -> None:
    backend = make_backend(pve, auth="password")
    now = [1000.0]
    backend.api.clock = lambda: now[0]
    try:
        await backend.placements()
        now[0] += 3599
        await backend.placements()
        assert backend.api.logins == 1
        now[0] += 2  # past ticket_renew_s (one hour): renewed before the next request
        pve.advance_clock(3601)
        await backend.placements()
        assert backend.api.logins == 2
        pve.advance_clock(7100)  # the first ticket has expired on the server; ours has not
        await backend.placements()
    finally:
        await backend.close()
    assert len(pve.sent("POST", TICKET)) == 2
    assert all(r.status == 200 for r in pve.requests)


async def test_a_ticket_the_server_forgot_is_replaced(pve: FakePVE) -> None:
    backend = make_backend(pve, auth="password")
    try:
        await backend.placements()
        pve.advance_clock(7300)  # expired server-side while our clock says it is fresh
        assert [p.name for p in await backend.placements()] == ["pve1", "pve2"]
    finally:
        await backend.close()
    assert backend.api.logins == 2
    assert [r.status for r in pve.sent("GET", "/nodes")] == [200, 401, 200]


async def test_bad_credentials_are_a_clear_permanent_error(
    pve: FakePVE,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    bad_token = create(
        Config.model_validate(config_data(pve)), {"PVE_TOKEN_SECRET": "wrong-secret-123"}
    )
    bad_password = create(
        Config.model_validate(config_data(pve, "password")), {"PVE_PASSWORD": "wrong-pass-456"}
    )
    try:
        with pytest.raises(PermanentError) as token_error:
            await bad_token.placements()
        with pytest.raises(PermanentError) as password_error:
            await bad_password.placements()
    finally:
        await bad_token.close()
        await bad_password.close()
    token_message, password_message = token_error.value.message, password_error.value.message
    assert "the API token " in token_message and "was refused by 127.0.0.1:" in token_message
    assert "check $PVE_TOKEN_SECRET" in token_message
    assert "the password of " in password_message and "check $PVE_PASSWORD" in password_message
    for message in (token_message, password_message):
        assert "try again" not in message and "did not answer" not in message
    for secret in ("wrong-secret-123", "wrong-pass-456"):
        assert secret not in token_error.value.message + password_error.value.message
        assert secret not in caplog.text
        assert secret not in repr(bad_token.api.__dict__) + repr(bad_password.api.__dict__)


async def test_secrets_stay_out_of_logs_in_a_whole_life_cycle(
    pve: FakePVE,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    for auth in ("token", "password"):
        backend = make_backend(pve, auth=auth)
        try:
            await backend.templates()
            await backend.api.post("nodes/pve1/qemu/100/config", "write", description="x")
        finally:
            await backend.close()
    tickets = [r for r in pve.requests if r.template == TICKET]
    assert tickets, "the password backend logged in"
    for secret in (pve.token_secret, pve.password):
        assert secret not in caplog.text


def test_missing_secrets_name_the_variable(pve_tls: Any) -> None:
    data = {"kind": "proxmox", "name": "pve", "host": "127.0.0.1", "token_id": "deploybot"}
    config = Config.model_validate(data)
    with pytest.raises(PermanentError, match=r"set \$PVE_TOKEN_SECRET or \$PVE_PASSWORD"):
        create(config, {})
    with pytest.raises(PermanentError, match=r"\$MY_PW"):
        create(Config.model_validate({**data, "token_id": None, "password_env": "MY_PW"}), {})
    fallback = create(config, {"PVE_PASSWORD": "pw"})  # no token secret: password login
    assert not fallback.api._credentials.uses_token


def test_tls_options_are_checked(tmp_path: Path) -> None:
    data = {"kind": "proxmox", "name": "pve", "host": "127.0.0.1"}
    (tmp_path / "ca.pem").write_text("a CA bundle\n")
    with pytest.raises(pydantic.ValidationError, match="choose one"):
        Config.model_validate({**data, "ca_bundle": tmp_path / "ca.pem", "verify_tls": False})
    with pytest.raises(pydantic.ValidationError, match=r"missing\.pem does not exist"):
        Config.model_validate({**data, "ca_bundle": tmp_path / "missing.pem"})
    assert Config.model_validate(data).verify_tls


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
async def test_tls_is_verified_and_turning_it_off_is_logged(
    pve: FakePVE,
    caplog: pytest.LogCaptureFixture,
) -> None:
    untrusted = create(Config.model_validate(config_data(pve, ca_bundle=None)), environ(pve))
    with caplog.at_level(logging.WARNING):
        insecure = create(
            Config.model_validate(config_data(pve, ca_bundle=None, verify_tls=False)), environ(pve)
        )
    try:
        with pytest.raises(PermanentError, match=r"certificate of 127\.0\.0\.1:\d+ is not tr") as e:
            await untrusted.placements()
        assert 'set ca_bundle = "/path/to/ca.pem" in [[backends]] pve' in e.value.message
        assert [p.name for p in await insecure.placements()] == ["pve1", "pve2"]
    finally:
        await untrusted.close()
        await insecure.close()
    assert "TLS verification is OFF" in caplog.text


# --- error mapping ------------------------------------------------------------------------


async def test_server_errors_map_to_retryable_or_permanent(pve: FakePVE) -> None:
    backend = make_backend(pve, request_timeout_s=0.3)
    pve.inject("nodes", "error", status=595, message="no route to host")
    pve.inject("nodes", "delay", delay_s=1.0)
    pve.inject("nodes", "error", message="unexpected problem")
    pve.inject("resources", "lock_timeout")
    pve.inject(
        "version",
        "error",
        status=400,
        message="Parameter verification failed.",
        errors={"x": "bad"},
    )
    try:
        with pytest.raises(Unreachable, match="answered 595 no route to host"):
            await backend.placements()
        with pytest.raises(Unreachable, match="did not answer in time"):
            await backend.placements()
        with pytest.raises(PermanentError, match="unexpected problem") as permanent:
            await backend.placements()
        assert not permanent.value.retryable
        with pytest.raises(RetryableError, match="got timeout"):
            await backend.find_by_name("x")
        with pytest.raises(PermanentError, match=r"Parameter verification failed\. \(x: bad\)"):
            await backend.api.get("version")
    finally:
        await backend.close()


async def test_an_api_that_is_down_is_unreachable(pve: FakePVE) -> None:
    backend = make_backend(pve)
    await pve.close()
    try:
        with pytest.raises(Unreachable, match=r"cannot reach 127\.0\.0\.1:\d+"):
            await backend.placements()
    finally:
        await backend.close()


async def test_the_event_loop_never_waits_for_the_api(pve: FakePVE) -> None:
    """Slow answers never hold up the loop: a 5 ms ticker is never late by anything
    near the 0.5 s each answer takes (a busy machine may delay it by a hundred ms)."""
    backend = make_backend(pve)
    for _ in range(4):
        pve.inject("version", "delay", delay_s=0.5)
    loop = asyncio.get_running_loop()
    worst = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            before = loop.time()
            await asyncio.sleep(0.005)
            worst = max(worst, loop.time() - before - 0.005)

    tick = asyncio.create_task(ticker())
    try:
        answers = await asyncio.gather(*(backend.api.get("version") for _ in range(4)))
    finally:
        done.set()
        await tick
        await backend.close()
    assert {a["release"] for a in answers} == {"8.2"}
    assert worst < 0.4


async def test_proxy_variables_cannot_reroute_the_api(
    pve: FakePVE, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A *_PROXY variable must not send API traffic (or its login) anywhere else; here
    the "proxy" is a closed loopback port, so any use of it would fail the calls."""
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for auth in ("token", "password"):
        backend = make_backend(pve, auth=auth)
        try:
            assert [p.name for p in await backend.placements()] == ["pve1", "pve2"]
        finally:
            await backend.close()
