"""Download an upstream image (or a package file) and keep it only once it is verified.

The file is streamed with aiohttp into a temporary file in the cache folder while it is
hashed; it is renamed into the content-addressed cache (`<cache>/<algorithm>/<digest>`)
only when its length and digest are the expected ones. A wrong digest or a truncated
download removes the temporary file and raises `FetchError`: nothing half-downloaded is
ever found in the cache. A file already cached under the expected digest is hashed again
and reused without a download. Proxies from the environment are ignored (trust_env off):
the bot fetches from where the profile says.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from yarl import URL

from bot.models.errors import UserError

log = logging.getLogger(__name__)

CHUNK = 1 << 20
MAX_SUMS_BYTES = 1 << 20  # a checksum file is small; a bigger answer is not one
_HEX = {"sha256": 64, "sha512": 128}


class FetchError(UserError):
    """The image or checksum could not be fetched or did not verify; says what to do."""


@dataclass(frozen=True)
class Expected:
    """A digest a file must have: algorithm and lowercase hex."""

    algorithm: str
    hexdigest: str

    @classmethod
    def parse(cls, value: str) -> Expected:
        algorithm, _, hexdigest = value.partition(":")
        return cls(algorithm, hexdigest.lower())

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hexdigest}"


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 30
    total_s: float = 3600


def shown(url: str) -> str:
    """`url` as logs and messages show it: without a user or password in it."""
    parsed = URL(url)
    return str(parsed.with_user(None)) if parsed.user or parsed.password else url


def cached_path(cache_dir: Path, expected: Expected) -> Path:
    return cache_dir / expected.algorithm / expected.hexdigest


def parse_sums(text: str, file_name: str, algorithm: str) -> str | None:
    """The digest a checksum file gives `file_name`: GNU lines (`HASH  name`, `HASH *name`)
    or BSD lines (`SHA256 (name) = HASH`); None when no line names the file."""
    size = _HEX[algorithm]
    bsd = re.compile(rf"^{algorithm.upper()} \((.+)\) = ([0-9a-fA-F]{{{size}}})$")
    gnu = re.compile(rf"^([0-9a-fA-F]{{{size}}}) [ *](.+)$")
    for raw in text.splitlines():
        line = raw.strip()
        if match := bsd.match(line):
            name, digest = match.group(1), match.group(2)
        elif match := gnu.match(line):
            digest, name = match.group(1), match.group(2)
        else:
            continue
        if name.removeprefix("./") == file_name:
            return digest.lower()
    return None


def _session(timeouts: Timeouts) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(
        total=timeouts.total_s, sock_connect=timeouts.connect_s, sock_read=timeouts.connect_s
    )
    return aiohttp.ClientSession(timeout=timeout, trust_env=False)


async def expected_from_sums(
    sums_url: str, file_name: str, algorithm: str, timeouts: Timeouts = Timeouts()
) -> Expected:
    """Read the checksum file and return the digest it gives `file_name`."""
    label = shown(sums_url)
    try:
        async with _session(timeouts) as session, session.get(sums_url) as response:
            if response.status != 200:
                raise FetchError(
                    f"the checksum file {label} answered HTTP {response.status}: check "
                    "the profile's checksum_url"
                )
            body = await response.content.read(MAX_SUMS_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("fetching %s failed: %s", label, repr(exc).replace(sums_url, label))
        raise FetchError(
            f"could not read the checksum file {label} ({type(exc).__name__}): check the "
            "URL and that this host can reach it"
        ) from None
    if len(body) > MAX_SUMS_BYTES:
        raise FetchError(f"{label} is larger than 1 MiB: not a checksum file")
    digest = parse_sums(body.decode("utf-8", "replace"), file_name, algorithm)
    if digest is None:
        raise FetchError(
            f"the checksum file {label} has no {algorithm} line for {file_name}: check "
            "the profile's url, checksum_url and checksum_algorithm"
        )
    return Expected(algorithm, digest)


def _hash_file(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with path.open("rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cached(path: Path, expected: Expected) -> bool:
    if not path.is_file():
        return False
    if _hash_file(path, expected.algorithm) == expected.hexdigest:
        return True
    log.warning("cached %s does not match its digest: removed, downloading again", path)
    path.unlink(missing_ok=True)
    return False


def _write(file: int, digest: hashlib._Hash, chunk: bytes) -> None:
    digest.update(chunk)
    os.write(file, chunk)


async def fetch_verified(
    url: str, expected: Expected, cache_dir: Path, timeouts: Timeouts = Timeouts()
) -> Path:
    """The verified file from `url` in the cache (downloaded unless already there)."""
    label = shown(url)
    final = cached_path(cache_dir, expected)
    if await asyncio.to_thread(_cached, final, expected):
        log.info("image cache: %s is %s, reused", label, final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=".partial-")
    part = Path(name)
    try:
        digest = hashlib.new(expected.algorithm)
        received = 0
        try:
            async with _session(timeouts) as session, session.get(url) as response:
                if response.status != 200:
                    raise FetchError(
                        f"{label} answered HTTP {response.status}: check the profile's url"
                    )
                length = response.content_length
                async for chunk in response.content.iter_chunked(CHUNK):
                    await asyncio.to_thread(_write, fd, digest, chunk)
                    received += len(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "downloading %s failed after %d bytes: %s",
                label, received, repr(exc).replace(url, label),
            )  # fmt: skip
            raise FetchError(
                f"the download of {label} failed after {received} bytes ({type(exc).__name__}); "
                "nothing was kept: try again"
            ) from None
        if length is not None and received != length:
            raise FetchError(
                f"the download of {label} was cut short ({received} of {length} bytes); nothing "
                "was kept: try again"
            )
        if digest.hexdigest() != expected.hexdigest:
            log.warning(
                "%s: %s:%s, expected %s", label, expected.algorithm, digest.hexdigest(), expected
            )
            raise FetchError(
                f"{label} does not match its checksum (expected {expected}, got "
                f"{expected.algorithm}:{digest.hexdigest()}); it was deleted and will not be "
                "used. The upstream file or the checksum changed: check the profile"
            )
        await asyncio.to_thread(os.fsync, fd)
        os.fchmod(fd, 0o644)
        os.close(fd)
        fd = -1
        os.replace(part, final)
        log.info(
            "image cache: %s verified (%s), %d bytes, kept as %s", label, expected, received, final
        )
        return final
    finally:
        if fd != -1:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)  # renamed away when it verified
