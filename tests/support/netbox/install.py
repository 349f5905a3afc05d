"""Installs the real NetBox (PyPI's `netbox` package) that the NetBox tests run against.

`make netbox` runs this with the network (CI: `.ci/run`, before `unshare -n`); `make test`
never installs anything, so the tests find the venv here or skip (fail under
DEPLOYBOT_REQUIRE_NETBOX=1). NetBox 4.7 needs Python >= 3.12 while deploybot runs on 3.11,
so NetBox gets a venv of its own, kept in the user's cache (not in the work tree) so that
every worktree and every run shares one install, keyed by the pinned version.

Standard library only: it runs under whichever python3 calls it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "4.7.3"
# Written last, so a venv whose pip install was interrupted is rebuilt, not trusted.
COMPLETE_MARKER = ".deploybot-complete"


def cache_dir() -> Path:
    """Where NetBox's venv and its migrated database dump are kept between runs."""
    base = os.environ.get("DEPLOYBOT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deploybot"
    )
    return Path(base) / f"netbox-{VERSION}"


def venv_dir() -> Path:
    return cache_dir() / "venv"


def installed() -> bool:
    venv = venv_dir()
    return (venv / COMPLETE_MARKER).exists() and (venv / "bin" / "gunicorn").exists()


def _is_312_or_newer(python: str) -> bool:
    check = "import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)"
    try:
        return subprocess.run([python, "-c", check], capture_output=True).returncode == 0
    except OSError:
        return False


def find_python() -> str | None:
    """A Python >= 3.12: $NETBOX_PYTHON, then PATH, then pyenv's versions (a pyenv shim
    on PATH fails when the version it points at is not installed, hence the check)."""
    candidates = [os.environ.get("NETBOX_PYTHON", "")]
    candidates += [shutil.which(name) or "" for name in ("python3.12", "python3.13", "python3")]
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.1[2-9]*/bin/python3"))
    for python in candidates:
        if python and _is_312_or_newer(python):
            return python
    return None


def install() -> Path:
    """Create the venv and `pip install netbox==VERSION` into it, unless already done."""
    venv = venv_dir()
    if installed():
        print(f"NetBox {VERSION} already installed in {venv}")
        return venv
    python = find_python()
    if python is None:
        raise SystemExit("NetBox needs Python >= 3.12 (set NETBOX_PYTHON to one)")
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    # NetBox pins each of its direct dependencies (==) itself; psycopg[c] compiles against
    # Debian's libpq-dev with gcc.
    subprocess.run([*pip, f"netbox=={VERSION}"], check=True)
    (venv / COMPLETE_MARKER).write_text(VERSION + "\n")
    print(f"NetBox {VERSION} installed in {venv}")
    return venv


if __name__ == "__main__":
    install()
    sys.exit(0)
