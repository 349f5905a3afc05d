"""manifest.yml is a valid Slack app manifest (checked against Slack's own schema)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from tests.support.reference import reference_json

MANIFEST = Path(__file__).resolve().parent.parent / "manifest.yml"


def test_manifest_matches_slacks_schema() -> None:
    schema = reference_json("slack-manifest.schema.1.0.0.json")
    manifest = yaml.safe_load(MANIFEST.read_text())
    jsonschema.Draft7Validator(schema).validate(manifest)
    commands = [c["command"] for c in manifest["features"]["slash_commands"]]
    assert commands == ["/deploy"]
    assert manifest["settings"]["socket_mode_enabled"] is True
