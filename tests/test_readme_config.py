"""The documentation's configuration examples load: a reader who copies one gets a valid
file.

Each ```toml block of README.md and the pages in docs/ (the [images] recipes are in
docs/templates.md) that sets `[images]` is loaded on top of the bundled
example configuration, through the same `load_settings` the bot starts with. A
placeholder digest (`sha256:...`) is the one thing a reader must fill in, so it is
replaced by a well-formed digest first; anything else wrong in a block fails here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from bot.config.settings import BUNDLED_CONFIG, load_settings

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEMPLATES_PAGE = ROOT / "docs" / "templates.md"
PLACEHOLDER_DIGEST = re.compile(r"sha256:\.\.\.|sha256:<[^>]*>")


def _toml_blocks() -> list[str]:
    return [
        block
        for page in PAGES
        for block in re.findall(
            r"^```toml\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S
        )
    ]


def _images_blocks() -> list[dict[str, Any]]:
    blocks = []
    for text in _toml_blocks():
        filled = PLACEHOLDER_DIGEST.sub("sha256:" + "0" * 64, text)
        data = tomllib.loads(filled)
        if "images" in data:
            blocks.append(data)
    return blocks


def test_every_images_example_in_the_readme_loads(tmp_path: Path) -> None:
    blocks = _images_blocks()
    assert len(blocks) >= 2, "the docs' [images] examples are gone"
    for data in blocks:
        # smoke_subnet must name a configured subnet: give the examples the one they name.
        subnets = [{"name": "lab", "cidr": "10.0.0.0/24", "gateway": "10.0.0.1"}]
        settings = load_settings(
            BUNDLED_CONFIG,
            images=data["images"],
            subnets=subnets,
            log_file=str(tmp_path / "bot.log"),
        )
        for name in data["images"].get("profiles", {}):
            settings.images.profile(name)  # the merged profile validates


def test_the_local_mirror_recipe_sets_what_a_debian_build_needs(tmp_path: Path) -> None:
    """The offline recipe: a local image and checksum file, and the agent's packages
    (a Debian cloud image ships without qemu-guest-agent)."""
    mirror = [d for d in _images_blocks() if "debian-12" in d["images"].get("profiles", {})]
    assert mirror, "the docs have no local-mirror recipe for debian-12"
    settings = load_settings(
        BUNDLED_CONFIG, images=mirror[0]["images"], log_file=str(tmp_path / "bot.log")
    )
    profile = settings.images.profile("debian-12")
    assert profile.url.startswith("http://mirror.lab.example/")
    assert profile.checksum_url is not None and profile.checksum_url.endswith("SHA512SUMS")
    assert profile.checksum is None and profile.checksum_algorithm == "sha512"
    assert any("qemu-guest-agent" in p.url for p in profile.packages)
    assert settings.images.smoke_subnet == "lab"


def test_the_readme_build_example_does_not_collide_with_the_fakes_templates() -> None:
    """The fake Proxmox seeds `debian-12`, a template deploybot did not build, so the
    build example of docs/templates.md passes another `--name`."""
    text = TEMPLATES_PAGE.read_text(encoding="utf-8")
    example = re.search(r"\$ deploybot template build .*", text)
    assert example is not None and "--name debian-12-gold" in example.group(0)
