from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.models.errors import UsageError
from bot.requests.grammar import parse
from bot.requests.parsed import (
    Approve,
    Cancel,
    DeployArgs,
    Help,
    History,
    Reject,
    Status,
    Templates,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("web01 10.0.0.50", DeployArgs(name="web01", address="10.0.0.50")),
        ("web01", DeployArgs(name="web01")),
        ("web01 10.0.0.50/24", DeployArgs(name="web01", address="10.0.0.50/24")),
        (
            "db1 10.0.0.9 mem=4G cpu=4 disk=+20G upgrade=yes user=admin template=rocky-9",
            DeployArgs(
                name="db1",
                address="10.0.0.9",
                memory_mib=4096,
                cores=4,
                disk_grow_gib=20,
                upgrade=True,
                user="admin",
                template="rocky-9",
                given=("mem", "cpu", "disk", "upgrade", "user", "template"),
            ),
        ),
        (
            "a 10.0.0.9 mem=512M",
            DeployArgs(name="a", address="10.0.0.9", memory_mib=512, given=("mem",)),
        ),
        (
            "a 10.0.0.9 mem=1.5GiB",
            DeployArgs(name="a", address="10.0.0.9", memory_mib=1536, given=("mem",)),
        ),
        (
            "a 10.0.0.9 disk=+1T",
            DeployArgs(name="a", address="10.0.0.9", disk_grow_gib=1024, given=("disk",)),
        ),
        (
            "a 10.0.0.9 upgrade=no",
            DeployArgs(name="a", address="10.0.0.9", upgrade=False, given=("upgrade",)),
        ),
        (
            "a 10.0.0.9 on=pve1/node2 storage=fast",
            DeployArgs(
                name="a",
                address="10.0.0.9",
                on="pve1/node2",
                storage="fast",
                given=("on", "storage"),
            ),
        ),
        ("  web01   10.0.0.50  ", DeployArgs(name="web01", address="10.0.0.50")),
        ("help", Help()),
        ("HELP", Help()),
        ("templates", Templates()),
        ("history", History(10)),
        ("history 25", History(25)),
        ("status j4k", None),  # a prefix needs 4 characters
        ("status j4k7", Status("j4k7")),
        ("status J4K7TQA2", Status("j4k7tqa2")),
        ("status j4k7tqa2bxw9cdn3efhpr", Status("j4k7tqa2bxw9cdn3efhpr")),
        ("status jabcdef", Status("jabcdef")),
        ("status #jabcdef", Status("jabcdef")),
        ("cancel jabcdef", Cancel("jabcdef")),
        ("cancel bk3m9xq2", Cancel("bk3m9xq2")),  # a template build
        ("approve jabcdef", Approve("jabcdef")),
        ("reject jabcdef too big for a test", Reject("jabcdef", "too big for a test")),
    ],
)
def test_good_input(text: str, expected: object) -> None:
    if expected is None:
        with pytest.raises(UsageError):
            parse(text)
        return
    assert parse(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "Tell me what to deploy"),
        ("   ", "Tell me what to deploy"),
        ("web01 10.0.0.50 memory=4G", "Did you mean `mem`?"),
        ("web01 10.0.0.50 templte=x", "Did you mean `template`?"),
        ("web01 10.0.0.50 colour=red", "Options: template, on"),
        ("web01 10.0.0.50 mem=4G mem=8G", "`mem` is given twice"),
        ("web01 10.0.0.50 mem=4", "give a size with a unit"),
        ("web01 10.0.0.50 mem=lots", "give a size with a unit"),
        ("web01 10.0.0.50 mem=4K", "give a size with a unit"),
        ("web01 10.0.0.50 disk=20G", "disks only grow"),
        ("web01 10.0.0.50 disk=+1.5G", "whole GiB"),
        ("web01 10.0.0.50 cpu=0", "whole number of cores"),
        ("web01 10.0.0.50 cpu=two", "whole number of cores"),
        ("web01 10.0.0.50 upgrade=maybe", "upgrade=yes or upgrade=no"),
        ("web01 10.0.0.50 stray", "is not an option"),
        ("web01 10.0.0.50 user=", "needs a value"),
        ("mem=4G web01", "Start with the VM's name"),
        ("status", "needs a job id"),
        ("status 42", "is not a job id"),
        ("status jabcdef extra", "takes only a job id"),
        ("history many", "not a number from 1 to 100"),
        ("history 0", "not a number from 1 to 100"),
        ("history 1 2", "at most one number"),
        ("help me", "takes no arguments"),
        ("reject jabcdef", "Say why you reject it"),
        ("web01 10.0.0.50 mem=99999999999999999999999999999999999G", "give a size"),
    ],
)
def test_bad_input_says_what_and_shows_usage(text: str, fragment: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse(text)
    assert fragment in str(caught.value)
    assert "Usage: /deploy" in str(caught.value)


@settings(max_examples=400, deadline=None)
@given(st.text())
def test_any_text_parses_or_raises_usage_error(text: str) -> None:
    try:
        parse(text)
    except UsageError as exc:
        assert exc.usage.startswith("/deploy")


_word = st.sampled_from(
    [
        "web01",
        "10.0.0.5",
        "mem=4G",
        "cpu=2",
        "disk=+5G",
        "upgrade=yes",
        "status",
        "history",
        "jabcdef",
        "on=x",
        "=",
        "mem=",
        "disk=+",
        "help",
        "reject",
        "a=b=c",
        "#",
        "cpu=-1",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_word | st.text(min_size=1, max_size=8), max_size=8))
def test_grammar_like_text_parses_or_raises_usage_error(words: list[str]) -> None:
    with contextlib.suppress(UsageError):
        parse(" ".join(words))


@pytest.mark.parametrize("text", ["history ²", "web01 10.0.0.50 cpu=²", "history ١٢"])
def test_digits_that_are_not_ascii_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError):
        parse(text)
