"""What the tests share, grouped by concern; the tests themselves are tests/test_*.py.

deployer: fast settings on real SQLite files, a recording Progress, one deploy run to its end
store: jobs and stores for the store's contract on both engines; a held SQLite lock
cli, crash, replicas: deploybot run as real processes (one shell, several `serve`)
ownership: runners sharing one database under an injected clock
slack/: the fake Slack Web API (fake_api) and a bot on it with signed requests (bot)
postgres: a PostgreSQL cluster of the tests' own
proxmox, fakepve/: the fake Proxmox API (its own package) and the backend on it
vsphere/: VMware's vcsim built from Debian's sources, a lab, a deployer on it
netbox/: a real NetBox on 127.0.0.1
realguest/, images, cloudinit_guest, jumphost: real guests under QEMU, template images,
    Debian's cloud-init offline, an SSH jump host
contract: the Backend contract as tests every backend's test file imports
reference: ../shared/reference/, skipped on a laptop and required in CI
workers/: scripts the tests start as separate processes (`python -m tests.support.workers.X`)
"""
