"""The guest agent's file and exec endpoints, as qemu-server's PVE/API2/Qemu/Agent.pm
answers them (see supplement.json's `_source`): the same guest-agent commands in the
same order (file-read: guest-file-open, guest-file-read in 1 MiB chunks up to `count`,
guest-file-close), sent to `Cluster.machines`, whose guests are simulated or real. The
privilege check of the server's release is the server's (`acl.ENFORCED`).
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any

from tests.support.fakepve.call import Call
from tests.support.fakepve.cluster import VM
from tests.support.fakepve.errors import ApiError
from tests.support.fakepve.guestfiles import AgentError
from tests.support.fakepve.reads import agent_of

MAX_READ_SIZE = 16 * 1024 * 1024
READ_SIZE = 1024 * 1024
_TRUE = ("1", "true", "yes", "on")


async def _agent_cmd(c: Call, vm: VM, command: str, arguments: dict[str, Any], what: str) -> Any:
    """PVE::QemuServer::Agent's agent_cmd and check_agent_error: an agent's error is a
    500 "Agent error: <its text>"; a null answer "Agent error: <what>"."""
    try:
        answer = await c.cluster.machines.qga(vm, f"guest-{command}", arguments)
    except AgentError as exc:
        raise ApiError(500, f"Agent error: {exc.desc}") from None
    if answer is None:
        raise ApiError(500, f"Agent error: {what}")
    return answer


async def file_read(c: Call) -> Any:
    vm = agent_of(c)
    count = int(c.params.get("count", MAX_READ_SIZE))
    decode = c.params.get("decode", "1").lower() in _TRUE
    offset = int(c.params.get("offset", "0"))
    handle = await _agent_cmd(c, vm, "file-open", {"path": c.params["file"]}, "can't open file")
    if offset > 0:
        seek = {"handle": handle, "offset": offset, "whence": "set"}
        await _agent_cmd(c, vm, "file-seek", seek, "can't seek to offset position")
    read, eof, parts = 0, False, []
    while read < count and not eof:
        size = min(count - read, READ_SIZE)
        chunk = await _agent_cmd(
            c, vm, "file-read", {"handle": handle, "count": size}, "can't read from file"
        )
        data = str(chunk["buf-b64"])
        parts.append(base64.b64decode(data).decode("latin-1") if decode else data)
        read += int(chunk["count"])
        eof = bool(chunk.get("eof", False))
    # check_agent_error with noerr: a failed close is only warned about.
    with contextlib.suppress(AgentError):
        await c.cluster.machines.qga(vm, "guest-file-close", {"handle": handle})
    result: dict[str, Any] = {"content": "".join(parts), "bytes-read": read}
    if not eof:
        result["truncated"] = 1
    return result


async def file_write(c: Call) -> Any:
    vm = agent_of(c)
    content = c.params["content"]
    encode = c.params.get("encode", "1").lower() in _TRUE
    buf = base64.b64encode(content.encode()).decode() if encode else content
    opened = {"path": c.params["file"], "mode": "wb"}
    handle = await _agent_cmd(c, vm, "file-open", opened, "can't open file")
    written = {"handle": handle, "buf-b64": buf}
    await _agent_cmd(c, vm, "file-write", written, "can't write to file")
    await _agent_cmd(c, vm, "file-close", {"handle": handle}, "can't close file")
    return None


async def exec_command(c: Call) -> Any:
    """qemu_exec: the program and its arguments; output captured."""
    vm = agent_of(c)
    argv = c.lists.get("command") or ([c.params["command"]] if "command" in c.params else [])
    if not argv:
        raise ApiError(500, "No command given")
    arguments: dict[str, Any] = {"path": argv[0], "arg": argv[1:], "capture-output": True}
    if "input-data" in c.params:
        arguments["input-data"] = base64.b64encode(c.params["input-data"].encode()).decode()
    return await _agent_cmd(c, vm, "exec", arguments, "can't execute command")


async def exec_status(c: Call) -> Any:
    vm = agent_of(c)
    answer = await _agent_cmd(
        c, vm, "exec-status", {"pid": int(c.params["pid"])}, "can't get exec status"
    )
    result = dict(answer)
    for stream in ("out-data", "err-data"):  # qemu_exec_status decodes them
        if stream in result:
            result[stream] = base64.b64decode(str(result[stream])).decode("latin-1")
    return result
