"""What the vSphere backend says when it cannot be used as configured (issue 11, item 6):
a refused password, a certificate not trusted by the CA given or by none, a network
that is an uplink portgroup. All permanent, all naming the setting to check."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from backends.base import CloneSpec, PermanentError
from backends.vsphere import create
from backends.vsphere.config import Config
from bot.app.runtime import make_backend, running_deployer
from bot.models.errors import RequestInvalid
from bot.requests.admission import problems_at_start
from bot.requests.grammar import parse
from bot.requests.parsed import DeployArgs
from tests.support.deployer import Recorder, make_settings
from tests.support.vsphere.simulator import (
    PASSWORD,
    PASSWORD_ENV,
    TEMPLATE,
    Simulated,
    TlsFiles,
    Vcsim,
    make_tls,
    vcenter_fixture,  # noqa: F401
    vcsim_binary_fixture,  # noqa: F401
    vcsim_tls_fixture,  # noqa: F401
)

USER = "deploybot@vsphere.local"


def never_try_again(message: str) -> None:
    assert "try again" not in message and "does not answer" not in message


async def test_a_refused_password_is_permanent_and_names_its_variable(
    vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path
) -> None:
    sim = Vcsim(vcsim_binary, vcsim_tls, tmp_path, esx=False, login=(USER, PASSWORD))
    right = create(Config.model_validate(sim.config(user=USER)), {PASSWORD_ENV: PASSWORD})
    wrong = create(Config.model_validate(sim.config(user=USER)), {PASSWORD_ENV: "not-it-93b1"})
    try:
        assert await right.is_vcenter()  # the right password does log in
        with pytest.raises(PermanentError) as refused:
            await wrong.templates()
    finally:
        await right.close()
        await wrong.close()
        sim.stop()
    assert not refused.value.retryable
    message = refused.value.message
    assert f"the password of {USER} was refused by 127.0.0.1:{sim.port}" in message
    assert f"check ${PASSWORD_ENV}" in message and "not-it-93b1" not in message
    never_try_again(message)


async def test_a_ca_bundle_that_is_not_the_signer_is_named(
    vcenter: Simulated, tmp_path: Path
) -> None:
    """With a ca_bundle given, "set ca_bundle" is no advice: the one given is wrong."""
    other = make_tls(tmp_path)
    backend = vcenter.sim.backend(ca_bundle=str(other.ca))
    try:
        with pytest.raises(PermanentError) as untrusted:
            await backend.templates()
    finally:
        await backend.close()
    message = untrusted.value.message
    assert f"by ca_bundle {other.ca}: check that it holds the CA" in message
    assert "set ca_bundle =" not in message
    assert "key too small" not in message
    never_try_again(message)


async def test_an_uplink_portgroup_is_neither_offered_nor_accepted(vcenter: Simulated) -> None:
    """vcsim's distributed switch has an uplink portgroup (`DC0_DVS-DVUplinks-<n>`), which
    carries the hosts' physical NICs: a VM's NIC does not belong there."""
    uplinks = [n for n in vcenter.sim.network_names() if "-DVUplinks-" in n]
    assert uplinks, "vcsim no longer creates an uplink portgroup"
    backend = vcenter.sim.backend()
    try:
        offered = [n.name for n in await backend.networks()]
        assert "DC0_DVPG0" in offered and uplinks[0] not in offered
        uplink = f"'{uplinks[0]}' on vcenter is an uplink portgroup"
        with pytest.raises(PermanentError, match=uplink):
            await backend.prepare_clone(CloneSpec("jvs0009", "web09", TEMPLATE, network=uplinks[0]))
    finally:
        await backend.close()


def args(text: str, network: str | None = None) -> DeployArgs:
    """A request as the Slack form makes it: only the form has a network field."""
    parsed = parse(text)
    assert isinstance(parsed, DeployArgs)
    return dataclasses.replace(parsed, network=network)


async def test_a_network_that_does_not_exist_is_refused_at_request_time(
    vcenter: Simulated, tmp_path: Path
) -> None:
    """Neither a configured network that is not there nor an uplink portgroup waits for
    the clone step to fail: the request is refused, and nothing is recorded."""
    entry = vcenter.sim.config(network="VM Netwrok")
    subnet = {"cidr": "127.0.20.0/24", "gateway": "127.0.20.1", "dns": ["127.0.20.2"]}
    defaults = {"backend": entry["name"], "template": TEMPLATE}
    settings = make_settings(tmp_path, backends=[entry], subnets=[subnet], defaults=defaults)
    backend = make_backend(settings.backends[0], {PASSWORD_ENV: PASSWORD})
    uplink = next(n for n in vcenter.sim.network_names() if "-DVUplinks-" in n)
    async with running_deployer(settings, Recorder(), backends={"vcenter": backend}) as deployer:
        with pytest.raises(RequestInvalid) as configured:
            await deployer.request_deploy(args("web01 127.0.20.50"), "alice")
        with pytest.raises(RequestInvalid) as requested:
            await deployer.request_deploy(args("web01 127.0.20.50", uplink), "alice")
        # A network that exists is taken, whatever the configuration says.
        await deployer.request_deploy(args("web02 127.0.20.51", "DC0_DVPG0"), "alice")
        assert [j.name for j in await deployer.history()] == ["web02"]
    message = configured.value.message
    assert "'VM Netwrok', the network of [[backends]] vcenter in the configuration" in message
    assert "ask an operator to correct it" in message and "DC0_DVPG0" in message
    assert f"{uplink!r} is not a network on vcenter" in requested.value.message
    assert uplink not in message


def weak_certificate(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 with a 1024-bit key, like vcsim's own."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = where / "weak.pem", where / "weak-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


async def test_a_key_too_small_gets_its_own_advice_and_no_ca_bundle_advice(
    tmp_path: Path,
) -> None:
    """The certificate is in the ca_bundle given, but its key is too small for OpenSSL:
    the advice is about the key, never "set ca_bundle" or "check the CA"."""
    cert_file, key_file = weak_certificate(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.set_ciphers("DEFAULT:@SECLEVEL=0")
    server_tls.load_cert_chain(cert_file, key_file)

    async def hang_up(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0, ssl=server_tls)
    port = server.sockets[0].getsockname()[1]
    entry = {"kind": "vsphere", "name": "weak", "host": "127.0.0.1", "port": port}
    config = Config.model_validate({**entry, "user": USER, "ca_bundle": str(cert_file)})
    backend = create(config, {"VSPHERE_PASSWORD": "p"})
    try:
        with pytest.raises(PermanentError) as refused:
            await backend.templates()
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()
    message = refused.value.message
    assert f"the certificate of 127.0.0.1:{port} has a key too small" in message
    assert "ca_bundle" not in message
    never_try_again(message)


async def test_what_an_operator_must_fix_is_found_at_start(
    vcenter: Simulated, vcsim_binary: Path, vcsim_tls: TlsFiles, tmp_path: Path
) -> None:
    """`deploybot serve` logs these at start: a misspelt network and a refused password
    (permanent); a backend that is right says nothing."""
    strict = Vcsim(vcsim_binary, vcsim_tls, tmp_path, esx=False, login=(USER, PASSWORD))
    backends = {
        "good": vcenter.sim.backend(name="good"),
        "misspelt": vcenter.sim.backend(name="misspelt", network="VM Netwrok"),
        "refused": create(
            Config.model_validate(strict.config(name="refused", user=USER)),
            {PASSWORD_ENV: "not-it-93b1"},
        ),
    }
    try:
        problems = await problems_at_start(backends)
    finally:
        for backend in backends.values():
            await backend.close()
        strict.stop()
    assert len(problems) == 2, problems
    misspelt, refused = problems
    assert misspelt.startswith("backend misspelt: its network 'VM Netwrok' does not exist")
    assert "DC0_DVPG0" in misspelt and "-DVUplinks-" not in misspelt
    assert refused.startswith(f"backend refused: the password of {USER} was refused")
