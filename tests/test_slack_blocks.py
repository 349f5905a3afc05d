"""Block Kit limits hold for any text: sections split, options cut, everything validates."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from slack_sdk.models.blocks import Block

from backends.base import Template
from handlers.slack import views
from handlers.slack.catalog import Catalog, template_options


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=4000), max_size=30), st.booleans())
def test_any_answer_fits_slacks_limits(lines: list[str], monospace: bool) -> None:
    blocks = views.answer(lines, monospace=monospace)
    assert 1 <= len(blocks) <= views.MESSAGE_BLOCKS_MAX
    for block in blocks:
        assert len(block["text"]["text"]) <= 3000
        parsed = Block.parse(block)
        assert parsed is not None
        parsed.to_dict()  # raises on any limit Slack would refuse


def test_a_short_answer_keeps_every_line() -> None:
    lines = [f"line {n}" for n in range(500)]
    text = "\n".join(b["text"]["text"] for b in views.answer(lines))
    assert text.splitlines() == lines


def test_template_options_are_cut_to_75_characters_and_100_options() -> None:
    catalog = Catalog(templates=[("sim", Template(f"t{n}-{'y' * 90}", "x")) for n in range(120)])
    options = template_options(catalog)
    assert len(options) == 100
    assert all(len(o.to_dict()["text"]["text"]) <= 75 for o in options)
