"""Ids as the store keeps them: jobs (and builds), installations and runners, drawn from
one alphabet without look-alike letters (split from bot/models/__init__.py)."""

from __future__ import annotations

import re
import secrets

_ID_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # 31 letters: no i, l, o, 0 or 1
# 31**20 is about 2**99: random enough that ids never collide in practice (the store
# still retries a clash with a fresh id), too long to type, so people type a prefix.
JOB_ID_LENGTH = 20
SHORT_ID_LENGTH = 8  # what headlines and tables show: "j" and 7 random letters
MIN_JOB_REF = 4  # the shortest prefix a lookup accepts
# A stored id: "j" and at least 6 characters (ids before the longer ones had 6).
JOB_ID_RE = re.compile(r"j[a-z0-9]{6,40}")
# What a person may type for a job: the whole id or a prefix of it.
JOB_REF_RE = re.compile(rf"j[a-z0-9]{{{MIN_JOB_REF - 1},40}}")


def random_letters(count: int) -> str:
    """`count` letters of the id alphabet from one draw of the system's randomness:
    a draw per letter (`secrets.choice`) was a third of an admission's time when fifty
    requests came together."""
    value = secrets.randbelow(len(_ID_ALPHABET) ** count)
    letters = []
    for _ in range(count):
        value, index = divmod(value, len(_ID_ALPHABET))
        letters.append(_ID_ALPHABET[index])
    return "".join(letters)


def new_job_id() -> str:
    return "j" + random_letters(JOB_ID_LENGTH)


def new_installation_id() -> str:
    """One per database, made when it is created; VM tags carry it (about 50 bits)."""
    return random_letters(10)


def new_runner_id() -> str:
    """One per running process; `r` + 12 letters (about 60 bits), logged at start."""
    return "r" + random_letters(12)
