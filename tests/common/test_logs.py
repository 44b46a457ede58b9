"""``common/logs.py``: client text as one safe log line; a rate limit per message template."""

from __future__ import annotations

import logging
import time

import pytest

from common.logs import (
    MAX_MESSAGE_CHARS,
    RateLimit,
    limit_rate,
    reset_rate_limits,
    safe,
    safe_message,
)
from support.waiting import wait_until


@pytest.mark.parametrize(
    "text, shown",
    [
        ("GET /v2/models/demo", "GET /v2/models/demo"),
        ("/v2/x\nINFO forged line", "/v2/x\\nINFO forged line"),
        ("a\r\x1b[31mred\x00", "a\\r\\x1b[31mred\\x00"),
        ("line\u2028sep\x85", "line\\u2028sep\\x85"),
        ("back\\slash", "back\\\\slash"),  # escaped too: "\\n" in the text stays unambiguous
        ("naïve ü", "naïve ü"),  # printable non-ASCII is kept
    ],
)
def test_safe_escapes_what_could_break_a_line(text, shown):
    assert safe(text) == shown
    assert "\n" not in safe(text) and "\r" not in safe(text)


def test_safe_cuts_long_text_and_names_its_length():
    assert safe("x" * 10_000, limit=20) == "x" * 20 + "... (10000 characters)"
    assert safe(ValueError("bad\nvalue")) == "bad\\nvalue"


def test_safe_message_keeps_the_start_and_end_of_a_long_message():
    text = "filter: unknown value '" + "P" * 16_000 + "' (batch row 3)"
    shown = safe_message(text)
    assert len(shown) < MAX_MESSAGE_CHARS + 40
    assert shown.startswith("filter: unknown value 'PPP") and shown.endswith("PP' (batch row 3)")
    assert f"... ({len(text) - MAX_MESSAGE_CHARS} characters cut) ..." in shown
    assert safe_message("short\n\x1b message") == "short\\n\\x1b message"
    assert safe_message("a\\b") == "a\\b"  # an answer's backslashes are the client's own
    wide = safe_message("\U0001f600" * 10_000)  # 4 UTF-8 bytes each, 12 percent-encoded
    assert len(wide.encode()) * 3 < 8192  # gRPC's default metadata limit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def limited(caplog):
    logger = logging.getLogger("test_logs.limited")
    clock = Clock()
    limit = RateLimit(logger, burst=3, interval_s=10.0, clock=clock)
    logger.addFilter(limit)
    caplog.set_level(logging.INFO, logger=logger.name)
    yield logger, clock, caplog
    logger.removeFilter(limit)


def test_a_burst_per_template_passes_then_one_summary_line(limited):
    logger, clock, caplog = limited
    for i in range(1000):
        logger.warning("refused %s", f"/path/{i}")  # different text, one template
    logger.info("other %s", 1)  # another template has its own window
    assert [r.getMessage() for r in caplog.records] == [
        "refused /path/0",
        "refused /path/1",
        "refused /path/2",
        "other 1",
    ]
    caplog.clear()
    clock.now = 10.0  # next window: the count of what was left out, then the line itself
    logger.warning("refused %s", "/again")
    assert [r.getMessage() for r in caplog.records] == [
        "... 'refused %s' repeated 997 times in 10 s (not logged)",
        "refused /again",
    ]
    assert caplog.records[0].levelno == logging.WARNING


def test_a_quiet_template_gets_no_summary_and_reset_forgets(limited):
    logger, clock, caplog = limited
    for _ in range(3):
        logger.warning("ok")
    clock.now = 20.0
    logger.warning("ok")
    assert [r.getMessage() for r in caplog.records] == ["ok"] * 4


def test_limit_rate_adds_one_filter_and_reset_rate_limits_clears_it(caplog):
    logger = limit_rate(limit_rate(logging.getLogger("test_logs.once"), burst=2))
    assert sum(isinstance(f, RateLimit) for f in logger.filters) == 1
    caplog.set_level(logging.WARNING, logger=logger.name)
    for _ in range(5):
        logger.warning("flood")
    reset_rate_limits()
    logger.warning("flood")
    assert len(caplog.records) == 3


def test_a_suppressed_stretch_is_reported_when_its_window_ends_without_another_record(caplog):
    logger = logging.getLogger("test_logs.flushed")
    limit = RateLimit(logger, burst=2, interval_s=0.3)
    logger.addFilter(limit)
    caplog.set_level(logging.INFO, logger=logger.name)
    try:
        start = time.monotonic()
        for i in range(50):
            logger.warning("refused %d", i)
        summary = "... 'refused %d' repeated 48 times in 0 s (not logged)"

        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records]

        wait_until(lambda: summary in lines(), 5.0, "the summary line, with no record after")
        assert time.monotonic() - start < 0.3 + 2.0
        assert lines() == ["refused 0", "refused 1", summary]
        logger.warning("refused %d", 50)  # a new window: it passes, nothing left to report
        assert lines()[-1] == "refused 50" and lines().count(summary) == 1
    finally:
        logger.removeFilter(limit)
