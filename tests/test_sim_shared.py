"""One simulator state file shared by several real processes, as several bots share one
Proxmox: deploys and destroys at once, one process SIGKILLed mid-work and one while it
holds the file's lock. No process fails on the file, no two VMs get one id, every VM a
process made is in the final state once (or gone, if it destroyed it), and the dead
process's lock and tasks hold up nobody."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from backends.sim import SimBackend
from tests.support.cli import KEPT, no_traceback
from tests.support.crash import (
    SEED,
    KillPoint,
    check_invariants,
    job_state,
    run_round,
    start_shell,
    write_config,
)

COUNT = 10  # VMs each churning process makes


def spawn(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *(str(a) for a in args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip


def final_state(state: Path) -> list[dict[str, object]]:
    """The VMs as a process opening the file now finds them (dead owners' tasks done)."""

    async def look() -> None:
        await SimBackend(time_scale=0.001, state_file=state).close()

    asyncio.run(look())
    vms: list[dict[str, object]] = json.loads(state.read_text())["vms"]
    return vms


def test_churning_processes_share_one_state_file_and_the_dead_block_nobody(
    tmp_path: Path,
) -> None:
    state = tmp_path / "sim.json"
    holder = spawn("-m", "tests.support.workers.sim", "hold", state)
    assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
    names = ("a", "b", "c", "victim")
    procs = {
        w: spawn("-m", "tests.support.workers.sim", "churn", state, w, str(COUNT)) for w in names
    }
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    holder.kill()  # with the lock held: the kernel lets it go
    holder.wait()
    victim = procs.pop("victim")
    assert victim.stdout is not None
    heard = [victim.stdout.readline() for _ in range(random.Random(SEED).randrange(2, COUNT))]
    victim.kill()  # somewhere in its next deploy or destroy, perhaps inside a write
    victim.wait()
    outputs = {w: p.communicate(timeout=300) for w, p in procs.items()}
    for worker, (_out, err) in outputs.items():
        assert procs[worker].returncode == 0, err
        assert "Traceback" not in err and "FileNotFoundError" not in err
    theirs = [line.split() for out, _ in outputs.values() for line in out.splitlines()]
    victims = [line.split() for line in heard]
    lines = theirs + victims
    made = [words[1] for words in lines if words[0] == "made"]
    assert len(made) == 3 * COUNT + sum(1 for words in victims if words[0] == "made")
    assert len(set(made)) == len(made), Counter(made).most_common(3)  # no id twice
    kept = {words[1] for words in lines if words[0] == "kept"}
    destroyed = {words[1] for words in lines if words[0] == "destroyed"}
    vms = final_state(state)
    ids = Counter(str(vm["vm_id"]) for vm in vms)
    assert all(n == 1 for n in ids.values()), ids.most_common(3)
    assert kept <= ids.keys() and not destroyed & ids.keys()
    survivors = {str(vm["vm_id"]) for vm in vms if str(vm["name"]).split("-")[0] in outputs}
    assert survivors == {words[1] for words in theirs if words[0] == "kept"}
    assert not any(vm["lock"] for vm in vms)  # the victim's task finished meanwhile


def test_deploy_and_destroy_processes_at_once_on_one_simulator(tmp_path: Path) -> None:
    """The real CLI: four one-shot deploys at once on one database and one simulator
    state file, then two destroys and a deploy at once."""
    config = tmp_path / "deploybot.toml"
    config.write_text(KEPT.format(tmp=tmp_path))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
    env["DEPLOYBOT_CONFIG"] = str(config)

    def at_once(*commands: tuple[str, ...]) -> None:
        procs = [spawn("-m", "handlers.entry", *c, "--user", "alice", env=env) for c in commands]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            no_traceback(result)
            assert proc.returncode == 0, out + err

    at_once(*(("deploy", f"web0{i}", f"10.0.0.5{i}") for i in range(1, 5)))
    vms = json.loads((tmp_path / "sim.json").read_text())["vms"]
    assert sorted(vm["name"] for vm in vms) == ["web01", "web02", "web03", "web04"]
    assert len({vm["vm_id"] for vm in vms}) == 4
    at_once(("destroy", "web01"), ("destroy", "web02"), ("deploy", "web05", "10.0.0.55"))
    vms = json.loads((tmp_path / "sim.json").read_text())["vms"]
    assert sorted(vm["name"] for vm in vms) == ["web03", "web04", "web05"]
    assert len({vm["vm_id"] for vm in vms}) == 3


def test_a_shell_takes_over_a_killed_shells_deploy_on_the_shared_simulator(
    tmp_path: Path,
) -> None:
    """The failover the state file is shared for: a long-lived shell is up when another
    shell starts a deploy and is SIGKILLed once its clone is made; the first takes the
    job over and rolls it back, which it can do only on a VM it sees (one another
    process made after it started)."""
    env = write_config(tmp_path, None)
    config = Path(env["DEPLOYBOT_CONFIG"])
    config.write_text(config.read_text() + "\n[ownership]\ntick_s = 0.2\n")
    survivor = start_shell(env, tmp_path)
    assert survivor.stdin is not None and survivor.stdout is not None
    watchdog = threading.Timer(120, survivor.kill)
    watchdog.start()
    try:
        for line in survivor.stdout:  # up, with the simulator loaded, before the deploy
            if "You are alice" in line:
                break
        killed = run_round(tmp_path, env, KillPoint(None, "✓ copy template"), "web01", "10.20.0.5")
        assert killed
        seen = []
        for line in survivor.stdout:
            seen.append(line)
            if "[web01 " in line and "run the same /deploy again" in line:
                break  # the last line of its failure
        survivor.stdin.close()
        rest = survivor.stdout.read()
        assert survivor.wait() == 0, "".join(seen) + rest
    finally:
        watchdog.cancel()
    told = "".join(seen)
    assert "Traceback" not in told + rest
    assert "destroy VM" in told, told  # it found the VM the dead shell made
    assert job_state(tmp_path, "web01") == "failed"
    assert json.loads((tmp_path / "sim.json").read_text())["vms"] == []
    check_invariants(tmp_path)
