"""Twenty database outages under two live `deploybot serve --http` replicas.

Two replicas on one PostgreSQL (the tests' stoppable cluster), behind the fake Slack,
with a short lease (`[ownership] lease_s = 3`), started once and kept for every round;
on either hypervisor (the test's parameter): the fake Proxmox server, or the built-in
simulator, both replicas sharing one `state_file` (backends/sim/state.py). Each round
asks a few deploys of them in turn, and at a random moment while they run (when a
randomly chosen one of them reaches a randomly chosen step, as its Slack headline shows)
stops PostgreSQL (`pg_ctl stop -m fast`) for a random length: half the rounds shorter
than the lease, half longer. A /deploy sent during the outage is answered within Slack's
3 s: in a long round (once /readyz says not ready) refused and never carried out; in a
short one refused, or acknowledged and then carried out like the others (see `outage`).
Then the database comes back, and once every job of the round is final:

* every job ended exactly once: final, cloned at most once, no step after its rollback
  began, one outcome in its Slack thread and one by direct message; a failed one names
  the database as the cause (bot/ownership/recovery.interrupted_by);
* no job is left `running` or `rolling_back`;
* no takeover of a live runner's work (both replicas live throughout, so none is
  allowed): a job whose owner changed from one replica to the other, when the first
  did not hand it back (see `takeovers`);
* no orphan VM: the hypervisor's VMs of ours (tagged `deploybot-...`: by the fake
  Proxmox's API, or in the simulator's state file) are exactly the succeeded jobs' VMs;
* every deploy acknowledged with 200 became one job; every refused one none.

The test goes through every round and then fails with what each round broke (a table
and the details), so one run shows the whole picture. DEPLOYBOT_OUTAGE_ROUNDS sets the
rounds on the fake Proxmox (default 20), DEPLOYBOT_OUTAGE_SIM_ROUNDS on the simulator
(default 6: the same rounds, to keep CI short), DEPLOYBOT_OUTAGE_SEED replays a run (its
seed is printed).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bot.models.ids import SHORT_ID_LENGTH
from handlers.messages.slack import STORE_NOT_ANSWERING
from handlers.messages.text import escape
from tests.support.deployer import TEST_KEY
from tests.support.fakepve.process import FakePVE, config_env, fake_pve
from tests.support.postgres import PASSWORD, PASSWORD_ENV, start_again, stop_fast
from tests.support.replicas import (
    SLACK,
    SLACK_STEPS,
    Proc,
    SlackThread,
    _reap,
    command,
    get,
    mentions,
    parents,
    rows,
    serve,
    slack,
    until,
    until_or_none,
)
from tests.support.slack.bot import CHANNEL

__all__ = ["_reap", "fake_pve", "slack"]  # fixtures, used by name
ROUNDS = {
    "proxmox": int(os.environ.get("DEPLOYBOT_OUTAGE_ROUNDS", "20")),
    "sim": int(os.environ.get("DEPLOYBOT_OUTAGE_SIM_ROUNDS", "6")),
}
SEED = int(os.environ.get("DEPLOYBOT_OUTAGE_SEED", "20260126"))
LEASE_S = 3.0
LEASE = f"\n[ownership]\nlease_s = {LEASE_S:g}\ntick_s = 0.5\n"  # tick_s * 3 <= lease_s
DEPLOYS = 4  # per round
SHORT_S = (1.0, 2.0)  # outage lengths shorter than the lease ...
LONG_S = (LEASE_S + 1, LEASE_S + 4)  # ... and longer
SETTLE_S = 60  # a round's jobs final (and told) within this of the database's return
FINAL = ("succeeded", "failed")
WORKING = ("running", "rolling_back")
STARTED = re.compile(r"runner (\S+) \(\w+, pid (\d+)\) started")
TAKING = re.compile(r"job (\S+): taking over from runner (\S+)")
HANDING = re.compile(r"job (\S+): held by this runner but .*; handing it back")
# The simulator's deploys take about as long as the fake Proxmox's (~2 s); its guests'
# addresses are outside 127.0.0.0/8, so it answers their SSH probe itself (backends/sim/).
SIM_CONFIG = """
database = "{tmp}/jobs.db"
log_file = "{tmp}/bot.log"

[[backends]]
kind = "sim"
name = "sim"
time_scale = 0.2
state_file = "{state}"

[[subnets]]
cidr = "10.20.0.0/24"
gateway = "10.20.0.1"

[defaults]
ssh_keys = ["{key}"]
backend = "sim"

[timeouts]
retry_initial_s = 0.01
retry_max_s = 0.1
"""


@dataclass
class Hypervisor:
    """What the replicas deploy on, as the test sees it."""

    kind: str
    config_env: Callable[[Path], dict[str, str]]  # a replica's env, its config written
    subnet: str  # the round's addresses: this and a host number
    ours: Callable[[], dict[str, str]]  # id -> name of every VM tagged as deploybot's


def on_proxmox(fake: FakePVE) -> Hypervisor:
    def ours() -> dict[str, str]:
        tagged = [vm for vm in fake.vms() if "deploybot-" in str(vm.get("tags"))]
        return {str(vm["vmid"]): str(vm["name"]) for vm in tagged}

    return Hypervisor("proxmox", lambda tmp: config_env(tmp, fake), "127.0.10.", ours)


def on_sim(state: Path) -> Hypervisor:
    def env(tmp: Path) -> dict[str, str]:
        path = tmp / "deploybot.toml"
        path.write_text(SIM_CONFIG.format(tmp=tmp, state=state, key=TEST_KEY))
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEPLOYBOT_")}
        return {**env, "DEPLOYBOT_CONFIG": str(path)}

    def ours() -> dict[str, str]:
        """The VMs the file holds (both replicas live: no task of a dead one to settle)."""
        vms = json.loads(state.read_text())["vms"] if state.exists() else []
        tagged = [vm for vm in vms if any(t.startswith("deploybot-") for t in vm["tags"])]
        return {str(vm["vm_id"]): str(vm["name"]) for vm in tagged}

    return Hypervisor("sim", env, "10.20.0.", ours)


@pytest.fixture(params=["proxmox", "sim"])
def hypervisor(request: pytest.FixtureRequest, tmp_path: Path) -> Hypervisor:
    if request.param == "proxmox":
        return on_proxmox(request.getfixturevalue("fake_pve"))
    return on_sim(tmp_path / "sim.json")


def replica(tmp: Path, hv: Hypervisor, slack: SlackThread, url: str, name: str) -> Proc:
    """A `serve --http` replica on `url` with the short lease (test_database_outage's
    `replica`, whose lease is long)."""
    env = {**hv.config_env(tmp), PASSWORD_ENV: PASSWORD}
    config = Path(env["DEPLOYBOT_CONFIG"])
    text = config.read_text().replace(f'"{tmp}/jobs.db"', f'"{url}"')
    config.write_text(text + LEASE + SLACK.format(url=slack.fake.url))
    return serve(env, tmp, name)


def runner_id(proc: Proc, slack: SlackThread) -> str:
    def said() -> str | None:
        with proc.lock:
            found = [STARTED.search(line) for line in proc.lines]
        ids = [m.group(1) for m in found if m and int(m.group(2)) == proc.popen.pid]
        return ids[0] if ids else None

    return str(until(said, slack, f"{proc.name}'s runner id", within_s=30))


@dataclass
class Round:
    number: int
    kind: str  # "short" or "long" (than the lease)
    planned_s: float
    names: list[str] = field(default_factory=list)  # acknowledged deploys
    refused: list[str] = field(default_factory=list)
    late: str = ""  # a command acknowledged during a short outage (it must run)
    outage_s: float = 0.0  # as it was: the planned length, longer if /readyz was slow
    readyz_s: float = 0.0  # from the stop to the first 503
    settle_s: float = 0.0  # from the database's return to every job final and told
    ready_s: float = 0.0  # from the database's return to both replicas' /readyz ready
    took_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    broken: dict[str, list[str]] = field(default_factory=dict)

    def fail(self, invariant: str, detail: str) -> None:
        self.broken.setdefault(invariant, []).append(detail)


def outcome_count(slack: SlackThread, name: str, job_id: str) -> tuple[int, int]:
    """How many times the job's outcome was said in its Slack thread(s), and by direct
    message: a parent posted once its job ended carries the outcome itself."""
    fake = slack.fake
    in_thread = 0
    for ts in parents(slack).get(name, []):
        posted = next(
            c
            for c in fake.called("chat.postMessage", channel=CHANNEL)
            if c.answer.get("ts") == ts and "thread_ts" not in c.args
        )
        said = [posted.text, *fake.thread(CHANNEL, ts)]
        in_thread += sum(t.count("ready in ") + t.count("failed at ") for t in said)
    short = job_id[:SHORT_ID_LENGTH]
    dms = [
        c.text
        for c in fake.called("chat.postMessage")
        if c.args.get("channel") != CHANNEL and f"{name} " in c.text and short in c.text
    ]
    told = sum(1 for t in dms if " is ready: " in t or " failed at " in t)
    return in_thread, told


def events(url: str, job_id: str) -> list[tuple[str, str]]:
    found = rows(url, "SELECT step, phase FROM job_events WHERE job_id = %s ORDER BY id", (job_id,))
    return [(str(s), str(p)) for s, p in found]


def owners(url: str, names: list[str]) -> dict[str, str]:
    found = rows(url, "SELECT name, owner FROM jobs WHERE name = ANY(%s)", (names,))
    return {str(n): str(o or "") for n, o in found}


def said(procs: list[Proc], pattern: re.Pattern[str]) -> list[tuple[str, str, str]]:
    """(replica, first group, second group or "") of every line matching `pattern`."""
    found = []
    for proc in procs:
        with proc.lock:
            lines = list(proc.lines)
        for line in lines:
            m = pattern.search(line)
            if m:
                found.append((proc.name, m.group(1), m.group(2) if m.lastindex == 2 else ""))
    return found


def takeovers(
    procs: list[Proc],
    runners: dict[str, str],
    ids: dict[str, str],
    before: dict[str, str],
    after: dict[str, str],
) -> list[str]:
    """Jobs a replica took from the other, live one, which had not handed them back.

    Two views of one thing, both reported: the taker's log line ("job J: taking over
    from runner R", bot/ownership/claims.py `_take_over`) naming another replica's runner, and
    the store's `owner` of the job, as seen just before the outage and once it is final
    (a final job keeps its owner). A job its owner handed back ("held by this runner
    but ...; handing it back": its task ended without a final state) may be recovered
    by the other replica: that is not a takeover of live work. `runners`: replica name
    -> its runner id; `ids`: job id -> name; `before`, `after`: job name -> owner.
    """
    handed = {job for _r, job, _x in said(procs, HANDING)}
    found = []
    for taker, job, previous in said(procs, TAKING):
        if job in ids and previous != runners[taker] and job not in handed:
            found.append(f"{ids[job]} ({job}): {taker} took it from {previous} (log)")
    by_id = {name: job for job, name in ids.items()}
    for name, first in before.items():
        last = after.get(name, "")
        if first and last and last != first and by_id.get(name) not in handed:
            note = f"{name} ({by_id.get(name)}): owner {first} before the outage, {last} at the end"
            found.append(note + " (store)")
    return found


def judge(url: str, slack: SlackThread, hv: Hypervisor, r: Round) -> None:
    """Check the round's invariants, recording what is broken in `r`."""
    jobs = {
        str(n): (str(i), str(s), str(e or ""), str(v or ""))
        for i, n, s, e, v in rows(
            url,
            "SELECT id, name, state, error, vm_id FROM jobs WHERE name = ANY(%s)",
            (r.names + r.refused,),
        )
    }
    for name in r.refused:
        if name in jobs:
            r.fail("refused, yet run", f"{name}: {jobs[name][1]}")
    for name in r.names:
        if name not in jobs:
            r.fail("acknowledged, no job", name)
            continue
        job_id, state, error, _vm = jobs[name]
        r.outcomes[state] = r.outcomes.get(state, 0) + 1
        if state not in FINAL:
            r.fail("not final", f"{name} ({job_id}) {state}")
            continue
        if state == "failed" and "database" not in error:
            r.fail("failure not naming the database", f"{name}: {error!r}")
        steps = events(url, job_id)
        clones = steps.count(("clone", "started"))
        if clones > 1:
            r.fail("ran twice", f"{name} cloned {clones} times")
        rollback = next((i for i, e in enumerate(steps) if e[0] == "rollback"), None)
        if rollback is not None:
            after = [e for e in steps[rollback:] if e[1] in ("started", "finished")]
            if after:
                r.fail("two runners on one job", f"{name}: steps after its rollback: {after}")
        thread, dm = outcome_count(slack, name, job_id)
        if (thread, dm) != (1, 1):
            r.fail("not told exactly once", f"{name}: {thread} in its thread, {dm} by DM")
    working = rows(url, "SELECT name, state FROM jobs WHERE state = ANY(%s)", (list(WORKING),))
    for name, state in working:
        r.fail("left working", f"{name} {state}")
    ours = hv.ours()
    succeeded = {str(v) for (v,) in rows(url, "SELECT vm_id FROM jobs WHERE state = 'succeeded'")}
    for vm in sorted(set(ours) - succeeded):
        r.fail("orphan VM", f"{vm} ({ours[vm]})")
    for vm in sorted(succeeded - set(ours)):
        r.fail("VM lost", vm)


def address(hv: Hypervisor, r: Round, i: int) -> str:
    """The i-th address of round r in the hypervisor's subnet, each used once."""
    return f"{hv.subnet}{10 + r.number * (DEPLOYS + 1) + i}"


def outage(r: Round, hv: Hypervisor, workdir: Path, watched: Proc, slack: SlackThread) -> None:
    """PostgreSQL stopped for the round's length, a /deploy sent to `watched` meanwhile.

    /readyz notices an outage only after a few seconds (`readyz_s` says how many), more
    than a short round lasts: a long round waits for it and then asks, and the command
    must be refused; a short one asks at once (Slack's request in a thread of its own,
    so the outage ends on time), and the command must be answered within 3 s, either
    refused (and never run) or acknowledged (and then run, and told, once).
    """
    extra = f"r{r.number:02d}x"
    stopped = time.monotonic()
    stop_fast(workdir)
    try:
        with ThreadPoolExecutor(1) as pool:
            if r.kind == "short":
                asked = pool.submit(command, watched, slack, f"{extra} {address(hv, r, DEPLOYS)}")

            def not_ready() -> bool:
                return get(watched, "/readyz")[0] == 503

            if r.kind == "long" and not until_or_none(not_ready, slack, within_s=15):
                r.fail("/readyz ready during the outage", watched.name)
            if r.kind == "long":
                asked = pool.submit(command, watched, slack, f"{extra} {address(hv, r, DEPLOYS)}")
            while time.monotonic() - stopped < r.planned_s:  # the outage's length
                if not r.readyz_s and not_ready():
                    r.readyz_s = time.monotonic() - stopped
                time.sleep(0.1)  # the scenario (how long the database is away), not a sync
            start_again(workdir)
            r.outage_s = time.monotonic() - stopped
            status, body, took = asked.result()
    finally:
        if not (workdir / "data" / "postmaster.pid").exists():
            start_again(workdir)
    refusal = body.get("text") == escape(STORE_NOT_ANSWERING)
    if status != 200 or took >= 3:
        r.fail("not answered within 3 s", f"{extra}: {status} after {took:.1f} s: {body}")
    elif refusal:
        r.refused.append(extra)
    elif body or r.kind == "long":
        r.fail("not refused", f"{extra}: {body}")
    else:
        r.names.append(extra)  # acknowledged: it must be run and told like the others
        r.late = extra


def one_round(
    r: Round,
    hv: Hypervisor,
    url: str,
    workdir: Path,
    procs: list[Proc],
    slack: SlackThread,
    rng: random.Random,
) -> dict[str, str]:
    """Deploys, an outage at a random moment, the database back, every job final; the
    owners of the round's jobs just before the outage."""
    for i in range(DEPLOYS):
        name = f"r{r.number:02d}{'abcdefgh'[i]}"
        status, body, _s = command(procs[i % 2], slack, f"{name} {address(hv, r, i)}")
        if status == 200 and not body:  # acknowledged; the answer comes by response_url
            r.names.append(name)
        else:
            r.fail("deploy not acknowledged", f"{name}: {status} {body}")
    # The moment: one of the round's jobs reaches a step (its headline shows it).
    target, label = rng.choice(r.names), rng.choice(SLACK_STEPS)
    shows = mentions(slack.fake, target, label)
    until_or_none(lambda: any(shows(c) for c in slack.fake.calls), slack, within_s=30)
    before = owners(url, r.names)
    outage(r, hv, workdir, procs[rng.randrange(2)], slack)
    back = time.monotonic()

    def settled() -> bool:
        found = rows(url, "SELECT name, id, state FROM jobs WHERE name = ANY(%s)", (r.names,))
        if len(found) < len(r.names) or any(s not in FINAL for _n, _i, s in found):
            return False
        return all(outcome_count(slack, str(n), str(i)) >= (1, 1) for n, i, _s in found)

    until_or_none(settled, slack, within_s=SETTLE_S)
    r.settle_s = time.monotonic() - back
    # The next round's deploys go to replicas that see the database again (a deploy
    # asked while /readyz says not ready is refused, rightly).
    if not until_or_none(lambda: all(get(p, "/readyz")[0] == 200 for p in procs), slack, 30):
        r.fail("/readyz not ready again", "30 s after the database came back")
    r.ready_s = time.monotonic() - back
    return before


def table(done: list[Round]) -> str:
    lines = ["round kind   outage  503 at  settle   ready   took  during  outcomes / broken"]
    for r in done:
        during = "ack" if r.late else "refused" if r.refused else "?"
        readyz = f"{r.readyz_s:6.1f}s" if r.readyz_s else "      -"
        outcomes = ", ".join(f"{n} {s}" for s, n in sorted(r.outcomes.items()))
        broken = "; ".join(f"{k} x{len(v)}" for k, v in r.broken.items()) or "ok"
        lines.append(
            f"{r.number:>5} {r.kind:5} {r.outage_s:6.1f}s {readyz} "
            f"{r.settle_s:6.1f}s {r.ready_s:6.1f}s {r.took_s:5.1f}s  {during:7} "
            f"{outcomes} / {broken}"
        )
    return "\n".join(lines)


def test_outages_under_two_live_replicas(
    tmp_path: Path,
    hypervisor: Hypervisor,
    slack: SlackThread,
    stoppable_pg: tuple[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, workdir = stoppable_pg
    hv, rounds = hypervisor, ROUNDS[hypervisor.kind]
    assert 10 + rounds * (DEPLOYS + 1) < 255, f"more rounds than addresses in {hv.subnet}0/24"
    rng = random.Random(SEED)
    began = time.monotonic()
    procs = [replica(tmp_path, hv, slack, url, f"replica{i}") for i in range(2)]
    runners = {proc.name: runner_id(proc, slack) for proc in procs}
    kinds = ["short", "long"] * (rounds // 2) + ["short"] * (rounds % 2)
    rng.shuffle(kinds)
    done: list[Round] = []
    for number, kind in enumerate(kinds):
        low, high = SHORT_S if kind == "short" else LONG_S
        r = Round(number, kind, rng.uniform(low, high))
        start = time.monotonic()
        before = one_round(r, hv, url, workdir, procs, slack, rng)
        judge(url, slack, hv, r)
        found = rows(url, "SELECT id, name FROM jobs WHERE name = ANY(%s)", (r.names,))
        ids = {str(i): str(n) for i, n in found}  # this round's jobs only
        for taken in takeovers(procs, runners, ids, before, owners(url, r.names)):
            r.fail("takeover of live work", taken)
        r.took_s = time.monotonic() - start
        done.append(r)
    for proc in procs:
        proc.popen.send_signal(signal.SIGTERM)
    stopped = [proc.popen.wait(timeout=60) for proc in procs]
    for proc in procs:  # what each said, to read after a failure
        (tmp_path / f"{proc.name}.out").write_text("".join(proc.lines))
    report = table(done)
    with capsys.disabled():
        print(
            f"\noutages under two live replicas on {hv.kind}: {len(done)} rounds, seed {SEED} "
            f"(DEPLOYBOT_OUTAGE_SEED), lease {LEASE_S:g} s, {DEPLOYS} deploys a round, "
            f"{time.monotonic() - began:.0f} s in all\n{report}"
        )
    details = [
        f"round {r.number} ({r.kind}, {r.outage_s:.1f} s): {invariant}: {'; '.join(what)}"
        for r in done
        for invariant, what in r.broken.items()
    ]
    if stopped != [0, 0]:
        details.append(f"replicas exited {stopped} on SIGTERM")
    if details:
        errors = [line for p in procs for line in p.lines if " ERROR " in line]
        pytest.fail(
            f"seed {SEED} (the replicas' output: {tmp_path}/replica*.out):\n"
            + "\n".join(details)
            + "\nreplicas' errors:\n"
            + "".join(errors[:20])
        )
