"""What the backends say when their endpoint cannot be used as configured: a name that
does not resolve, a certificate that is not trusted. Both are permanent (a retry meets
the same configuration) and both say what to change, in the same words for every
backend, so that an operator reading the start-up error or a requester reading a refusal
knows which setting to look at.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import TypeVar

E = TypeVar("E", bound=BaseException)
UNTRUSTED = "is not trusted"  # in tls_advice's messages; `deploybot check` looks for it


def unresolved(backend: str, host: str, exc: socket.gaierror) -> str:
    """`host` did not resolve. EAI_AGAIN (no DNS server answered) is reported too: it
    is the machine's DNS that needs fixing then, and the message says so."""
    if exc.errno == socket.EAI_AGAIN:
        why = "no DNS server answered"
        check = f"check `host` in [[backends]] {backend} and this machine's DNS settings"
    else:
        why = str(exc.strerror or exc).strip() or "unknown name"
        check = f"check `host` in [[backends]] {backend}"
    return f"{host} cannot be resolved ({why}): {check}"


def tls_advice(backend: str, where: str, ca_bundle: Path | str | None, exc: ssl.SSLError) -> str:
    """A refused TLS handshake, with the advice that fits what is configured: setting a
    `ca_bundle` only helps when none is set or the one set is not the signer; a key too
    small for OpenSSL (vcsim's built-in certificate) is fixed on the server only."""
    reason = str(getattr(exc, "reason", "") or "")
    verify = str(getattr(exc, "verify_message", "") or "")
    # OpenSSL 3 says "EE certificate key too weak" in verification, "ee key too small"
    # where it does not verify; either way no CA bundle changes it.
    if "KEY_TOO_SMALL" in reason or "key too weak" in verify or "too small" in str(exc):
        return (
            f"the certificate of {where} has a key too small for this machine's OpenSSL: "
            "give the server a certificate with a 2048-bit RSA key or larger "
            "(see docs/backends.md)"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = exc.verify_message or reason or "verification failed"
        if ca_bundle:
            return (
                f"the certificate of {where} {UNTRUSTED} ({detail}) by ca_bundle "
                f"{ca_bundle}: check that it holds the CA that signed the server's "
                f"certificate and that `host` in [[backends]] {backend} is a name in it"
            )
        return (
            f"the certificate of {where} {UNTRUSTED} ({detail}): set ca_bundle = "
            f'"/path/to/ca.pem" in [[backends]] {backend} (see docs/backends.md)'
        )
    return f"the TLS handshake with {where} failed ({reason or exc}): check its certificate"


def presented_certificate(host: str, port: int, timeout_s: float = 10.0) -> str | None:
    """Whom the certificate `host:port` presents names, and its issuer, read without
    verifying it (nothing is sent over the connection): what an operator needs to find
    the CA for `ca_bundle`. None when it cannot be read."""
    # cryptography comes with asyncssh; ssl alone does not decode an unverified peer.
    from cryptography import x509

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        if der is None:
            return None
        cert = x509.load_der_x509_certificate(der)
    except (OSError, ValueError):
        return None
    subject, issuer = cert.subject.rfc4514_string(), cert.issuer.rfc4514_string()
    return f"the server presents a certificate for {subject or '(no subject)'}, issued by {issuer}"


def cause(exc: BaseException, kind: type[E]) -> E | None:
    """The first `kind` among the causes of `exc` (requests wraps urllib3, which wraps
    the socket's error, and keeps some of them as `.reason` rather than as a cause)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, kind):
            return item
        reason = getattr(item, "reason", None)
        todo += [item.__cause__, item.__context__]
        todo += [reason] if isinstance(reason, BaseException) else []
        todo += [a for a in item.args if isinstance(a, BaseException)]
    return None


def nic_model_choice(value: object, allowed: tuple[str, ...], hypervisor: str) -> str:
    """A `nic_model` in an OS profile that deploybot cannot set on this hypervisor."""
    return (
        f"{value!r} is not a NIC model deploybot sets on {hypervisor}: use one of "
        f"{', '.join(allowed)}, or leave nic_model out to keep the template's own NIC"
    )


def unknown_profile(template: str, profile: str, profiles: list[str]) -> str:
    """`template_os` sends a template to a profile that does not exist."""
    return (
        f"template_os sends template {template!r} to OS profile {profile!r}, which is "
        f"neither in os_profiles nor a guest OS family ({', '.join(profiles)}): add "
        f"[backends.os_profiles.{profile}] or correct the name"
    )


def nic_needs_tools(backend: str, template: str, nic: str, why: str, profile: str) -> str:
    """A template whose guest has no VMware Tools, deployed with a vmxnet NIC: the guest
    has no driver for it and boots without network. Permanent: the template must change,
    or the profile's NIC model."""
    return (
        f"template {template} on {backend} would get a {nic} NIC ({why}), which needs "
        "VMware Tools in the guest, but vSphere reports no Tools installed in the template: "
        "its VM would boot without network. Install open-vm-tools in the template and boot "
        "it once, so that vSphere records them (deploybot also needs them to read the "
        f'guest\'s address), or set nic_model = "e1000e" in [backends.os_profiles.{profile}] '
        f"of backend {backend}."
    )


def privilege_missing(account: str, step: str) -> str:
    """A privilege a deploy step needs that the account lacks (`deploybot check` names
    the privilege and its path before this)."""
    return f"{account} lacks it, needed to {step}"


def privilege_fix(account: str, privilege: str, where: str) -> str:
    """How to grant it. Proxmox (an ACL path): a role holding it, on the path, for the
    token and its user (with privilege separation a token holds at most what its user
    holds). vSphere (an inventory object): the role of the account there."""
    if not where.startswith("/"):
        return (
            f"add {privilege} to the role {account} has on {where} (vSphere Client: "
            "Administration > Roles; the permission may propagate from the datacenter)"
        )
    if "!" in account:
        user = account.split("!")[0]
        return (
            f"grant a role with {privilege} on {where} to the token and its user, e.g. "
            f"`pveum acl modify {where} --tokens '{account}' --roles ROLE` and "
            f"`pveum acl modify {where} --users {user} --roles ROLE`"
        )
    return (
        f"grant a role with {privilege} on {where}: "
        f"`pveum acl modify {where} --users {account} --roles ROLE`"
    )
