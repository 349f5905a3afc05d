from __future__ import annotations

from pathlib import Path

import pytest

from bot.config.settings import BUNDLED_CONFIG, config_path, load_settings
from bot.models.errors import ConfigError


def test_bundled_config_is_valid() -> None:
    settings = load_settings(BUNDLED_CONFIG)
    assert settings.default_backend == "sim"
    assert settings.approval.approvers == ("bob",)


def test_config_path_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DEPLOYBOT_CONFIG", raising=False)
    assert config_path() == BUNDLED_CONFIG
    (tmp_path / "deploybot.toml").write_text("")
    assert config_path() == Path("deploybot.toml")
    monkeypatch.setenv("DEPLOYBOT_CONFIG", "/etc/deploybot/x.toml")
    assert config_path() == Path("/etc/deploybot/x.toml")
    assert config_path("given.toml") == Path("given.toml")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"backends": [{"kind": "sim", "name": "a"}, {"kind": "sim", "name": "a"}]}, "unique"),
        ({"defaults": {"backend": "pve9"}}, "defaults.backend 'pve9' is not one of"),
        (
            {"approval": {"always": True}},
            "approval: some requests need approval but `approvers` is empty",
        ),
        ({"backends": [{"kind": "vmware", "name": "x"}]}, "backends.0.kind"),
        (
            {"limits": {"max_running": 0}},
            "limits.max_running: Input should be greater than or equal to 1",
        ),
        ({"subnets": [{"cidr": "10.0.0.0/33", "gateway": "10.0.0.1"}]}, "subnets.0.cidr"),
        (
            {"subnets": [{"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "search_domain": "a b"}]},
            "subnets.0.search_domain: 'a b' is not one domain name",
        ),
        (
            {"subnets": [{"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "vms_on": ["vc9"]}]},
            "subnet 10.0.0.0/24 names backend 'vc9', not one of ['sim']",
        ),
    ],
)
def test_bad_settings_name_the_key(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(BUNDLED_CONFIG, **overrides)
    message = str(caught.value)
    assert message.startswith(f"{BUNDLED_CONFIG}: the configuration has")
    assert fragment in message


def test_environment_overrides_are_ignored_for_unknown_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEPLOYBOT_CONFIG", str(BUNDLED_CONFIG))
    monkeypatch.setenv("DEPLOYBOT_SOMETHING_ELSE", "1")
    assert load_settings().default_backend == "sim"


def test_the_search_domain_is_one_domain_without_its_trailing_dot() -> None:
    """It is the guests' domain too (web01.lab.example): `lab.example.` means the same."""
    subnet = {"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "search_domain": "lab.example."}
    settings = load_settings(BUNDLED_CONFIG, subnets=[subnet])
    assert settings.subnets[0].search_domain == "lab.example"
