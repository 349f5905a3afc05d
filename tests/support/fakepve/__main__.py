"""Run the fake Proxmox VE API on its own, for the demo in docs/backends.md and the
benchmark.

    .venv/bin/python -m tests.support.fakepve --port 8006 --ssh-port 2222

It prints its URL, the CA bundle to trust, the API token and a deploybot config snippet,
then serves until interrupted. It listens on 127.0.0.0/8 only; guests whose address is in
127.0.0.0/8 answer SSH on `--ssh-port` once booted.

With `--real-guests` its VMs are real QEMU guests (`realvm`, the image of `make
guest-image`): deploy to 10.0.0.0/24 with `template=debian-12`; the jump host leads
ADDRESS:22 to each guest's sshd.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from tests.support.fakepve.cluster import Timings
from tests.support.fakepve.realvm import RealMachines
from tests.support.fakepve.schema import ApiSchema
from tests.support.fakepve.server import FakePVE, make_tls
from tests.support.fakepve.testing import config_text
from tests.support.realguest import image
from tests.support.reference import REFERENCE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.fakepve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help="a 127.0.0.0/8 address")
    parser.add_argument("--port", type=int, default=8006)
    parser.add_argument("--release", default="8.2", help="PVE release to claim, e.g. 7.4")
    parser.add_argument("--ssh-port", type=int, default=2222, help="guest sshd port (0: none)")
    parser.add_argument(
        "--no-jump", action="store_true", help="no jump host (guests then need 127.x addresses)"
    )
    parser.add_argument("--schema", type=Path, default=REFERENCE / "pve-api-subset.json")
    parser.add_argument("--state-dir", type=Path, help="for the CA bundle (default: a temp dir)")
    parser.add_argument("--write-config", type=Path, help="write a deploybot.toml for it here")
    parser.add_argument("--token-secret", help="default: random")
    parser.add_argument("--password", help="root@pam's password (default: random)")
    parser.add_argument(
        "--revoke-privilege",
        action="append",
        default=[],
        metavar="PRIV",
        help="the token lacks this privilege everywhere (repeatable; see `deploybot check`)",
    )
    parser.add_argument("--auth-fail-delay-s", type=float, default=3.0)
    parser.add_argument(
        "--real-guests",
        action="store_true",
        help="VMs are QEMU guests of the `make guest-image` image (needs the jump host)",
    )
    for name, default in vars(Timings()).items():
        if isinstance(default, float):
            parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=default)
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace, state_dir: Path) -> None:
    if not args.schema.exists():
        sys.exit(f"{args.schema} is missing: pass --schema PATH to pve-api-subset.json")
    schema = ApiSchema(json.loads(args.schema.read_text(encoding="utf-8")))
    durations = {k: getattr(args, k) for k, v in vars(Timings()).items() if isinstance(v, float)}
    timings = Timings(**durations)
    machines, folder = None, None
    if args.real_guests:
        disk = image.built()
        if disk is None or args.no_jump:
            sys.exit(f"--real-guests needs the jump host and a guest image in {image.image_dir()}")
        folder = Path(tempfile.mkdtemp(prefix="pvg-"))  # short: QEMU's unix sockets
        machines = RealMachines.factory(disk, folder)
        args.ssh_port = 0  # no simulated sshd: the guests' own, through the jump host
    fake = FakePVE(
        schema,
        make_tls(state_dir),
        timings=timings,
        release=args.release,
        ssh_port=args.ssh_port or None,
        jump_dir=None if args.no_jump else state_dir,
        token_secret=args.token_secret,
        password=args.password,
        auth_fail_delay_s=args.auth_fail_delay_s,
        record_session=False,
        machines=machines,
    )
    for privilege in args.revoke_privilege:
        fake.acl.revoke(privilege)
    await fake.start(args.host, args.port)
    print(f"fake Proxmox VE {args.release} listening on {fake.url}")
    print(f"  CA bundle:   {fake.tls.ca_path}")
    print(f"  API token:   {fake.token_id}  (secret {fake.token_secret})")
    print(f"  password:    {fake.user} / {fake.password}")
    templates = [vm.config["name"] for vm in fake.cluster.vms.values() if vm.template]
    print(f"  templates:   {', '.join(templates)}")
    if args.ssh_port:
        print(f"  guest sshd:  port {args.ssh_port} on guest addresses in 127.0.0.0/8")
    if fake.jump is not None:
        print(f"  jump host:   {fake.jump.user}@{fake.jump.host}:{fake.jump.port} (SSH checks)")
    config = config_text(fake, state_dir, args.ssh_port)
    if args.write_config:
        args.write_config.write_text(config, encoding="utf-8")
        print(f"  config:      {args.write_config} (export DEPLOYBOT_CONFIG={args.write_config})")
    else:
        print(f"\ndeploybot.toml:\n{config}")
    print(f"\nexport PVE_TOKEN_SECRET={fake.token_secret}", flush=True)
    stop = asyncio.Event()  # SIGTERM too ends it cleanly: real guests' QEMUs end with it
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await fake.close()  # the real guests' QEMUs end with it
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    args = parse_args()
    with contextlib.ExitStack() as stack:
        state_dir = args.state_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="fakepve-"))
        )
        state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args, state_dir))


if __name__ == "__main__":
    main()
