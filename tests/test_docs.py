"""The documentation stays true to the code: the configuration reference is what the
settings models say, and README.md stays a short front door to the pages in docs/.

(The site itself is built with `mkdocs build --strict` by `make docs`, inside
`make test`, so a link to a missing page or anchor fails there.)
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, create_model

from bot.config.settings import Settings
from bot.leases.terms import LeaseSettings
from docs import config_reference

ROOT = Path(__file__).resolve().parent.parent


def test_the_configuration_reference_is_what_the_models_say() -> None:
    committed = config_reference.PAGE.read_text(encoding="utf-8")
    assert committed == config_reference.render(), (
        "docs/configuration-reference.md is stale: run .venv/bin/python -m docs.config_reference"
    )


def test_the_reference_lists_every_section_and_key() -> None:
    page = config_reference.render()
    for name, field in Settings.model_fields.items():
        assert f"`{name}`" in page or f"[{name}]" in page or f"[[{name}]]" in page, name
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            for key in annotation.model_fields:
                assert f"`DEPLOYBOT_{name.upper()}__{key.upper()}`" in page, (name, key)
    for key in ("lock_wait_s", "thin_provisioned", "time_scale", "checksum_url", "vms_on"):
        assert f"| `{key}` |" in page, key


def test_a_field_comment_becomes_its_description() -> None:
    """What the reader sees is what the model's source says beside the field."""
    model = create_model("Probe", timeout_s=(float, Field(default=5, gt=0)))
    row = config_reference._row(model, "timeout_s", model.model_fields["timeout_s"], None)
    assert row.startswith("| `timeout_s` | number | 5 | > 0 |")
    notes = config_reference._notes(LeaseSettings)
    assert notes["step"] == "the Extend button"


def test_the_readme_is_a_short_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
    for command in ("make demo", "make test"):
        assert command in readme
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README does not point at docs/{page.name}"
