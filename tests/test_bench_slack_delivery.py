"""benchmarks/bench_slack_delivery.py at a tiny scale (a smoke test, not a timing)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_slack_delivery import run


async def test_the_delivery_benchmark_sees_every_ssh_line_and_answer(tmp_path: Path) -> None:
    result = await run(3, tmp_path)
    assert result["ready"] == 3 and result["violations"] == 0
    assert result["dm_seen"] == result["thread_seen"] == result["answer_seen"] == 3
