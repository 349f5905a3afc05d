"""The grammar of the text after `/deploy`.

    NAME [ADDRESS[/PREFIX]] [+ADDRESS|+SUBNET ...] [key=value ...]
                                                (no ADDRESS: the next free one; each `+`
                                                word a NIC more; mac=, mac2=: fixed MACs)
    help | status JOB | history [N] | cancel JOB | templates | approve JOB | reject JOB REASON
    destroy NAME|JOB | list [mine|all|@USER] [page=N] | lease extend NAME|JOB [LENGTH]
    known-hosts NAME|JOB | ssh-ca
    template build PROFILE [on=BACKEND] [node=N] [storage=S] [name=X] | template profiles
    migrate plan --from SOURCE --to TARGET [folder=F] [name=PATTERN] | migrate apply PLAN

JOB is a job id or any prefix of it of at least 4 characters (the service resolves it).
`parse` turns any text into a command or raises `UsageError` that says what was wrong and
shows the right form; nothing else escapes it (a hypothesis test holds it to that).
Values are converted here (sizes, booleans), so a typo is reported against the key the
person typed; rules that need the configuration (subnets, limits) live in
bot/requests/validation.py.
Keywords are recognised only in ASCII, and only ASCII is lower-cased, so no Unicode case
folding can turn a word into a keyword.
"""

from __future__ import annotations

import difflib
import re

from bot.leases.terms import parse_length
from bot.models import MIN_MEMORY_MIB, normal_mac
from bot.models.errors import UsageError
from bot.models.ids import JOB_REF_RE, MIN_JOB_REF
from bot.models.plans import PLAN_ID_RE
from bot.requests.parsed import (
    Approve,
    BuildTemplate,
    Cancel,
    Command,
    DeployArgs,
    Destroy,
    ExtendLease,
    Help,
    History,
    KnownHosts,
    ListVMs,
    MigrateApply,
    MigratePlan,
    Reject,
    SaveKey,
    ShowSettings,
    SshCa,
    Status,
    TemplateProfiles,
    Templates,
)

USAGE = (
    "/deploy NAME [ADDRESS[/PREFIX]] [+ADDRESS|+SUBNET ...] [template=T] [on=BACKEND|NODE] "
    "[storage=S] [subnet=S] [cpu=N] [mem=4G] [disk=+20G] [user=U] [upgrade=yes|no] "
    "[lease=7d|never] [mac=MAC] [mac2=MAC ...]"
)
# Each command's usage line, by the command's words (handlers/commands.py registers the
# commands under these names, and `help` lists these lines).
USAGES = {
    "deploy": USAGE,
    "help": "/deploy help",
    "status": "/deploy status JOB (or BUILD)",
    "history": "/deploy history [N]",
    "cancel": "/deploy cancel JOB (or BUILD)",
    "templates": "/deploy templates",
    "approve": "/deploy approve JOB (or BUILD)",
    "reject": "/deploy reject JOB (or BUILD) REASON",
    "key": "/deploy key ssh-ed25519 AAAA... [comment]",
    "settings": "/deploy settings",
    "destroy": "/deploy destroy NAME (or JOB)",
    "list": "/deploy list [mine|all|@USER] [page=N]",
    "known-hosts": "/deploy known-hosts NAME (or JOB)",
    "ssh-ca": "/deploy ssh-ca",
    "lease extend": "/deploy lease extend NAME [7d]",
    "template build": "/deploy template build PROFILE [on=BACKEND] [node=N] [storage=S] [name=X]",
    "template profiles": "/deploy template profiles",
    "migrate plan": "/deploy migrate plan --from SOURCE --to TARGET [folder=F] [name=PATTERN]",
    "migrate apply": "/deploy migrate apply PLAN",
}


def _by_first_word(usages: dict[str, str]) -> dict[str, str]:
    """The usage a mistake after a first word shows: every command that starts with it."""
    shown: dict[str, str] = {}
    for words, usage in usages.items():
        if words != "deploy":  # the deploy starts with the VM's name, not a keyword
            head = words.split()[0]
            shown[head] = f"{shown[head]} | {usage}" if head in shown else usage
    return shown


SUBCOMMAND_USAGE = _by_first_word(USAGES)
BUILD_KEYS = ("on", "node", "storage", "name")
MIGRATE_KEYS = ("from", "to", "folder", "name")
KEYS = (
    "template", "on", "storage", "subnet", "cpu", "mem", "disk", "user", "upgrade", "lease",
    "mac",
)  # fmt: skip
# `mac2=`, `mac3=` ...: the fixed MAC of the second, third ... NIC (`mac1=` is `mac=`).
_MAC_KEY_RE = re.compile(r"^mac([1-9][0-9]?)$")
MAX_NICS = 8  # NICs of one VM deploybot asks for (Proxmox counts net0-net31; nobody needs more)
BUILD_REF_RE = re.compile(rf"b[a-z0-9]{{{MIN_JOB_REF - 1},40}}")  # a template build's, alike
HISTORY_MAX = 100
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$", re.IGNORECASE)
_UNIT_MIB = {"m": 1, "g": 1024, "t": 1024 * 1024}
_EXAMPLE_REF = "j4k7tqa2"
_YES = {"yes", "y", "true", "on", "1"}
_NO = {"no", "n", "false", "off", "0"}


def fold(word: str) -> str:
    """Lower-case ASCII only: "\u212aey".lower() is "key" and "İ".lower() is "i" plus a
    combining dot, so a non-ASCII word is left as it is and matches no keyword."""
    return word.lower() if word.isascii() else word


def is_whole(text: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts "²", which int() refuses."""
    return text.isascii() and text.isdigit()


def parse(text: str) -> Command:
    """Parse the text after `/deploy`; raise `UsageError` for anything else."""
    words = text.split()
    if not words:
        raise UsageError("Tell me what to deploy.", USAGE)
    head = fold(words[0])
    if head in SUBCOMMAND_USAGE:
        return _subcommand(head, words[1:])
    return _deploy(words)


def _subcommand(head: str, rest: list[str]) -> Command:
    usage = SUBCOMMAND_USAGE[head]
    if head in ("help", "templates", "settings", "ssh-ca"):
        if rest:
            raise UsageError(f"`{head}` takes no arguments.", usage)
        if head == "help":
            return Help()
        if head == "ssh-ca":
            return SshCa()
        return Templates() if head == "templates" else ShowSettings()
    if head == "list":
        return _list(rest, usage)
    if head == "lease":
        return _lease(rest, usage)
    if head == "template":
        return _template(rest, usage)
    if head == "migrate":
        return _migrate(rest, usage)
    if head == "destroy":
        if len(rest) != 1:
            raise UsageError("Name one VM to destroy (or its job id), like web01.", usage)
        return Destroy(rest[0])
    if head == "known-hosts":
        if len(rest) != 1:
            raise UsageError("Name one VM (or its job id), like web01.", usage)
        return KnownHosts(rest[0])
    if head == "key":
        if not rest:
            raise UsageError("Paste your public key after `key` (the .pub line).", usage)
        return SaveKey(" ".join(rest))
    if head == "history":
        if len(rest) > 1:
            raise UsageError("`history` takes at most one number.", usage)
        if not rest:
            return History()
        if not is_whole(rest[0]) or not 1 <= int(rest[0]) <= HISTORY_MAX:
            raise UsageError(f"`{rest[0]}` is not a number from 1 to {HISTORY_MAX}.", usage)
        return History(int(rest[0]))
    if not rest:
        raise UsageError(f"`{head}` needs a job id (like {_EXAMPLE_REF}).", usage)
    # approve, reject, cancel and status take a template build's id too.
    job_id = _job_id(rest[0], usage, builds=head in ("approve", "reject", "cancel", "status"))
    if head == "reject":
        if len(rest) < 2:
            raise UsageError("Say why you reject it, so the requester can fix it.", usage)
        return Reject(job_id, " ".join(rest[1:]))
    if len(rest) > 1:
        raise UsageError(f"`{head}` takes only a job id.", usage)
    if head == "status":
        return Status(job_id)
    return Cancel(job_id) if head == "cancel" else Approve(job_id)


# A person: `@U123ABC` or `U123ABC` (a Slack member id, or a shell user name) or a Slack
# mention `<@U123ABC>` / `<@U123ABC|name>`.
_PERSON_RE = re.compile(r"^(?:<@([A-Za-z0-9._-]{1,64})(?:\|[^>]*)?>|@([A-Za-z0-9._-]{1,64}))$")
PAGE_MAX = 10_000


def _list(rest: list[str], usage: str) -> ListVMs:
    everyone, user, page = False, None, 1
    scoped = False
    for word in rest:
        key, sep, value = word.partition("=")
        if sep and fold(key) == "page":
            if not is_whole(value) or not 1 <= int(value) <= PAGE_MAX:
                raise UsageError(f"`{word}`: give a page number, like page=2.", usage)
            page = int(value)
            continue
        if scoped:
            raise UsageError("Say whose VMs once: mine, all or @someone.", usage)
        scoped = True
        person = _PERSON_RE.match(word)
        if fold(word) in ("mine", "all"):
            everyone = fold(word) == "all"
        elif person:
            user = person.group(1) or person.group(2)
        else:
            raise UsageError(f"`{word}`: list mine, all or @someone (a member id).", usage)
    return ListVMs(everyone, user, page)


def _lease(rest: list[str], usage: str) -> ExtendLease:
    if not rest or fold(rest[0]) != "extend" or not 2 <= len(rest) <= 3:
        raise UsageError("Say which VM's lease to extend, and by how much, like web01 7d.", usage)
    if len(rest) == 2:
        return ExtendLease(rest[1])
    try:
        length = parse_length(rest[2])
    except ValueError as exc:
        raise UsageError(f"{exc}.", usage) from None
    if not length:
        raise UsageError(f"`{rest[2]}`: extend by a length, like 7d.", usage)
    return ExtendLease(rest[1], length)


def _template(rest: list[str], usage: str) -> BuildTemplate | TemplateProfiles:
    action = fold(rest[0]) if rest else ""
    if action == "profiles":
        if len(rest) > 1:
            raise UsageError("`template profiles` takes no arguments.", usage)
        return TemplateProfiles()
    if action != "build":
        raise UsageError("Say `template build PROFILE` or `template profiles`.", usage)
    if len(rest) < 2 or "=" in rest[1]:
        raise UsageError(
            "Name the build profile first, like `template build debian-12` "
            "(`/deploy template profiles` lists them).",
            usage,
        )
    values: dict[str, str] = {}
    for word in rest[2:]:
        key, sep, value = word.partition("=")
        key = fold(key)
        if not sep:
            raise UsageError(
                f"`{word}` is not an option: options are key=value, after the profile.", usage
            )
        if key not in BUILD_KEYS:
            close = difflib.get_close_matches(key, BUILD_KEYS, n=1, cutoff=0.5)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise UsageError(
                f"`{key}` is not an option of `template build`.{hint} "
                f"Options: {', '.join(BUILD_KEYS)}.",
                usage,
            )
        if key in values:
            raise UsageError(f"`{key}` is given twice: keep one.", usage)
        if not value:
            raise UsageError(f"`{key}=` needs a value.", usage)
        values[key] = value
    return BuildTemplate(
        rest[1],
        on=values.get("on"),
        node=values.get("node"),
        storage=values.get("storage"),
        name=values.get("name"),
    )


def _migrate(rest: list[str], usage: str) -> MigratePlan | MigrateApply:
    action = fold(rest[0]) if rest else ""
    if action == "apply":
        if len(rest) != 2 or not PLAN_ID_RE.fullmatch(fold(rest[1])):
            raise UsageError(
                "Name the plan to apply by the id `migrate plan` answered, like m2k7tqa2bc.",
                usage,
            )
        return MigrateApply(fold(rest[1]))
    if action != "plan":
        raise UsageError(
            "Say `migrate plan --from SOURCE --to TARGET` or `migrate apply PLAN`.", usage
        )
    values = _migrate_options(rest[1:], usage)
    missing = [f"--{k}" for k in ("from", "to") if k not in values]
    if missing:
        raise UsageError(
            f"Name the {' and the '.join(missing)} backend, like --from vcenter --to pve.", usage
        )
    return MigratePlan(values["from"], values["to"], values.get("folder"), values.get("name"))


def _migrate_options(words: list[str], usage: str) -> dict[str, str]:
    """`--from X --to Y` (or from=X to=Y) and folder=F name=PATTERN."""
    values: dict[str, str] = {}
    pending: str | None = None
    for word in words:
        # A chat client's smart punctuation turns "--" into a dash: read it as typed.
        word = "--" + word[1:] if word[:1] in ("\u2013", "\u2014") else word
        if pending is not None:
            key, value, pending = pending, word, None
        elif word.startswith("--"):
            key, sep, value = word[2:].partition("=")
            if not sep:
                pending = fold(key)
                if pending not in MIGRATE_KEYS:
                    raise UsageError(_not_migrate_key(pending), usage)
                continue
        else:
            key, sep, value = word.partition("=")
            if not sep:
                raise UsageError(
                    f"`{word}` is not an option: say --from X, --to Y, folder=F or name=P.", usage
                )
        key = fold(key)
        if key not in MIGRATE_KEYS:
            raise UsageError(_not_migrate_key(key), usage)
        if key in values:
            raise UsageError(f"`{key}` is given twice: keep one.", usage)
        if not value:
            raise UsageError(f"`{key}` needs a value.", usage)
        values[key] = value
    if pending is not None:
        raise UsageError(f"`--{pending}` needs a value.", usage)
    return values


def _not_migrate_key(key: str) -> str:
    close = difflib.get_close_matches(key, MIGRATE_KEYS, n=1, cutoff=0.5)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return f"`{key}` is not an option of `migrate plan`.{hint} Options: {', '.join(MIGRATE_KEYS)}."


def _job_id(word: str, usage: str, *, builds: bool = False) -> str:
    """A job id or prefix; with `builds`, a template build's too."""
    job_id = fold(word).lstrip("#")
    if builds and BUILD_REF_RE.fullmatch(job_id):
        return job_id
    if not JOB_REF_RE.fullmatch(job_id):  # a whole job id, or its first MIN_JOB_REF or more
        raise UsageError(
            f"`{word}` is not a job id: they look like {_EXAMPLE_REF} (the first "
            f"{MIN_JOB_REF} or more characters of one are enough).",
            usage,
        )
    return job_id


def _deploy(words: list[str]) -> DeployArgs:
    name = words[0]
    if "=" in name or name.startswith("+"):
        raise UsageError("Start with the VM's name, then the address, then options.", USAGE)
    rest = words[1:]
    address = None
    if rest and "=" not in rest[0] and not rest[0].startswith("+"):
        address = rest.pop(0)
    more_nics = []
    for word in [w for w in rest if w.startswith("+")]:
        rest.remove(word)
        if not word[1:] or "=" in word:
            raise UsageError(
                "A `+` word gives one NIC more: its address or its subnet, like +10.0.20.5 "
                "or +lab20.",
                USAGE,
            )
        more_nics.append(word[1:])
    if len(more_nics) + 1 > MAX_NICS:
        raise UsageError(f"A VM gets at most {MAX_NICS} NICs: drop some `+` words.", USAGE)
    values: dict[str, object] = {}
    macs: dict[int, str] = {}
    for word in rest:
        key, sep, value = word.partition("=")
        key = fold(key)
        if not sep:
            raise UsageError(
                f"`{word}` is not an option: options are key=value, after NAME and ADDRESS "
                "(a NIC more is +ADDRESS or +SUBNET).",
                USAGE,
            )
        mac_key = _MAC_KEY_RE.fullmatch(key)
        if key not in KEYS and mac_key is None:
            raise UsageError(_unknown_key(key), USAGE)
        if key in values:
            raise UsageError(f"`{key}` is given twice: keep one.", USAGE)
        if not value:
            raise UsageError(f"`{key}=` needs a value.", USAGE)
        if key == "mac" or mac_key is not None:
            _mac(key, value, int(mac_key.group(1)) if mac_key else 1, len(more_nics) + 1, macs)
            values[key] = value
            continue
        values[key] = _convert(key, value)
    return DeployArgs(
        name=name,
        address=address,
        template=_opt_str(values.get("template")),
        on=_opt_str(values.get("on")),
        storage=_opt_str(values.get("storage")),
        cores=_opt_int(values.get("cpu")),
        memory_mib=_opt_int(values.get("mem")),
        disk_grow_gib=_opt_int(values.get("disk")),
        user=_opt_str(values.get("user")),
        upgrade=_opt_bool(values.get("upgrade")),
        subnet=_opt_str(values.get("subnet")),
        lease_s=_opt_int(values.get("lease")),
        lease_never="lease" in values and values["lease"] is None,
        given=tuple(values),
        more_nics=tuple(more_nics),
        macs=tuple(sorted(macs.items())),
    )


NICS_USAGE = "+ADDRESS or +SUBNET per NIC after the first, then mac2=MAC ... (mac= is the first's)"


def parse_nics(text: str) -> tuple[tuple[str, ...], tuple[tuple[int, str], ...]]:
    """A form's "more NICs" field: the same `+` words and `mac=`/`macN=` as the text
    grammar, nothing else; the NICs after the first and the fixed MACs by NIC number."""
    words = text.split()
    for word in words:
        key = fold(word.partition("=")[0])
        if not word.startswith("+") and key != "mac" and not _MAC_KEY_RE.fullmatch(key):
            raise UsageError(f"`{word}`: give {NICS_USAGE}, like +10.0.20.5 +lab30.", USAGE)
    args = _deploy(["nics", *words])  # the same rules as after a VM's name
    return args.more_nics, args.macs


def _mac(key: str, value: str, nic: int, nics: int, macs: dict[int, str]) -> None:
    """`mac=` / `macN=`: the NIC's fixed MAC, normalised into `macs`."""
    if nic > nics:
        have = "one NIC" if nics == 1 else f"{nics} NICs"
        raise UsageError(
            f"{key}={value}: the request has {have}; add a `+` word for NIC {nic}, or drop {key}=.",
            USAGE,
        )
    if nic in macs:
        raise UsageError("`mac` and `mac1` are the same NIC's: keep one.", USAGE)
    try:
        macs[nic] = normal_mac(value)
    except ValueError as exc:
        raise UsageError(f"{key}={value}: {exc}.", USAGE) from None


def _unknown_key(key: str) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.5)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return f"`{key}` is not an option I know.{hint} Options: {', '.join(KEYS)}."


def _convert(key: str, value: str) -> object:
    if key == "cpu":
        if not is_whole(value) or int(value) < 1:
            raise UsageError(f"cpu={value}: give a whole number of cores, like cpu=4.", USAGE)
        return int(value)
    if key == "mem":
        mib = _mib(value, f"mem={value}: give a size with a unit, like mem=4G or mem=512M.")
        if mib < MIN_MEMORY_MIB:
            raise UsageError(_too_little_memory(value), USAGE)
        return mib
    if key == "disk":
        message = f"disk={value}: disks only grow; give the growth, like disk=+20G."
        if not value.startswith("+"):
            raise UsageError(message, USAGE)
        mib = _mib(value[1:], message)
        if mib % 1024:
            raise UsageError(f"disk={value}: grow by whole GiB, like disk=+20G.", USAGE)
        return mib // 1024
    if key == "lease":
        try:
            return parse_length(value)  # None: never
        except ValueError as exc:
            raise UsageError(f"lease={value}: {exc}.", USAGE) from None
    if key == "upgrade":
        lowered = fold(value)
        if lowered in _YES | _NO:
            return lowered in _YES
        raise UsageError(f"upgrade={value}: say upgrade=yes or upgrade=no.", USAGE)
    return value


def _too_little_memory(value: str) -> str:
    """The least a VM gets, in the unit the person typed (mem=0G: in G)."""
    match = _SIZE_RE.fullmatch(value)
    unit = match.group(2) if match else "M"
    least = MIN_MEMORY_MIB / _UNIT_MIB[unit.lower()]
    shown = f"{least:g}{unit}" + ("" if unit.lower() == "m" else f" ({MIN_MEMORY_MIB}M)")
    typed = shown.split()[0]
    return f"mem={value} is too little: a VM needs at least {shown}; ask for mem={typed} or more."


def _mib(text: str, message: str) -> int:
    match = _SIZE_RE.fullmatch(text) if text.isascii() else None
    if not match or not match.group(2) or match.group(2).lower() == "k":
        raise UsageError(message, USAGE)
    mib = float(match.group(1)) * _UNIT_MIB[match.group(2).lower()]
    if mib > 2**40 or mib != int(mib):
        raise UsageError(message, USAGE)
    return int(mib)


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _opt_bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
