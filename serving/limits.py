"""Request size limits (``[limits]`` in serve.toml), checked at the edge before any parsing.

A filter is parsed and compiled in Python (``retrieval/filters.py``), at a cost per clause:
unbounded, one filter of thousands of clauses held the interpreter for seconds and stalled every
other caller's requests for as long. The limits keep the work per request small and refuse the
rest in microseconds, with INVALID_ARGUMENT / HTTP 400 naming the field and the limit::

    filter: 200000 bytes is over the limit of 16384 (limits.max_filter_bytes)
    filter: more than 64 clauses (limits.max_filter_clauses)
    filter: the set of category holds more than 1024 values (limits.max_filter_set_values)

The byte count comes first (O(1) on the wire bytes), so the parser never sees more than
``max_filter_bytes``; it stops at the first clause or value past its limit. Every front end
(Recommend gRPC, KServe v2 gRPC and HTTP) and a router (the same front ends; its shard servers
receive compiled masks, not text) go through :meth:`LimitsConfig.parse_filter`:
``ServingState.submit`` calls it for every row, and the KServe parser for each row's filter.

A request's seen list (``seen`` / ``raw_seen``, the items it excludes) is bounded by
``max_seen``: the index maps the S ids to its rows and probes enough lists to hold ``K + S``
candidates (``retrieval/index/exclude.py``), so the list's length is work the server does. :meth:`LimitsConfig.check_seen` refuses a
longer list (``seen: 100001 item ids is over the limit of 100000 (limits.max_seen)``): the KServe
parser on the tensor's shape before decoding it, ``ServingState.submit`` for every row.

The HTTP limits live here too: the body's (``serving/frontends/kserve_http.py`` applies them) and
the connection's, a head timeout and a cap on open connections (``serving/frontends/http_conn.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from common.config import Config, WaitS
from serving.types import RequestError

if TYPE_CHECKING:
    from retrieval.filters import Expr

DEFAULT_MAX_FILTER_BYTES = 16 << 10
DEFAULT_MAX_HTTP_BODY_BYTES = 8 << 20


class LimitsConfig(Config):
    """``[limits]``: the most one request may ask of the server."""

    max_filter_bytes: int = Field(default=DEFAULT_MAX_FILTER_BYTES, ge=1, le=1 << 30)
    """Longest filter expression, in UTF-8 bytes (checked before it is parsed)."""
    max_filter_clauses: int = Field(default=64, ge=1, le=1 << 20)
    """Most clauses (``... and ...``) in one filter."""
    max_filter_set_values: int = Field(default=1024, ge=1, le=1 << 20)
    """Most values in one set (``attr in {v1, v2, ...}``)."""
    max_seen: int = Field(default=100_000, ge=0, le=1 << 24)
    """Most item ids in one request's seen list (``seen`` or ``raw_seen``, pads included)."""
    max_seen_user_growth: int = Field(default=100_000, ge=0, le=1 << 31)
    """``AddSeen`` (admin API): a user id must be below the model's seen store's users plus
    this, checked before the store grows (INVALID_ARGUMENT naming ``users``). A new user costs
    the store 8 bytes and every later update copies the store, so one short call must not add
    millions of users (``users=[10**7]`` alone would add 80 MB)."""
    max_item_id_growth: int = Field(default=1_000_000, ge=0, le=1 << 40)
    """``UpsertItems`` (admin API): an item id must be below the item table's rows
    (``config.num_items``) plus this (INVALID_ARGUMENT naming ``items[i].id``, checked before
    anything is built), on an unsharded server and a router alike. ``AddSeen`` names items the
    server holds (the table's and those upserted since); a router, whose index holds none,
    checks its seen items against this bound instead. Replayed log records were checked when
    they were taken."""
    max_http_body_bytes: int = Field(default=DEFAULT_MAX_HTTP_BODY_BYTES, ge=1, le=1 << 31)
    """Largest HTTP request body, compressed or decompressed (HTTP 413 past it)."""
    http_body_timeout_s: Annotated[WaitS, Field(gt=0)] = 10.0
    """Longest an HTTP request body may take to arrive, from its first byte read; a slower one
    is refused with HTTP 408 and its connection closed (a body that never finishes would hold
    the connection forever)."""
    http_head_timeout_s: Annotated[WaitS, Field(gt=0)] = 10.0
    """Longest an HTTP request head may take to arrive whole, from the connection's opening (or
    a kept-alive connection's next first byte); a slower one gets HTTP 408 and a close
    (``serving/frontends/http_conn.py``: a head that never ends would hold its connection
    forever)."""
    max_pending_updates: int = Field(default=8, ge=0, le=1 << 20)
    """Admin API: most live-update calls waiting or applying at once in this process (updates
    apply one at a time); one more is refused at once with RESOURCE_EXHAUSTED, so a client
    sending faster than updates apply backs off (``serving/engine/pending.py``). 0: no limit."""
    max_http_connections: int = Field(default=1024, ge=1, le=1 << 20)
    """Most HTTP connections open at once; one more is answered 503 and closed as it opens
    (the process keeps file descriptors for its model files and update logs)."""

    @property
    def filter_limits(self) -> tuple[int, int, int]:
        """The limits a filter text is parsed within (a key for texts already checked)."""
        return self.max_filter_bytes, self.max_filter_clauses, self.max_filter_set_values

    def check_filter_bytes(self, size: int, row: str = "") -> None:
        """Refuses a filter of ``size`` bytes over ``max_filter_bytes`` (``row``: where it is,
        e.g. `` (batch row 3)``)."""
        if size > self.max_filter_bytes:
            raise RequestError(
                f"filter: {size} bytes is over the limit of {self.max_filter_bytes} "
                f"(limits.max_filter_bytes){row}"
            )

    def check_seen(self, count: int, name: str = "seen", row: str = "") -> None:
        """Refuses a seen list of ``count`` ids over ``max_seen`` (``name``: ``seen`` or
        ``raw_seen``; ``row``: where it is)."""
        if count > self.max_seen:
            raise RequestError(
                f"{name}: {count} item ids is over the limit of {self.max_seen} "
                f"(limits.max_seen){row}"
            )

    def check_filter_text(self, text: str | None, row: str = "") -> None:
        """Refuses filter text over ``max_filter_bytes`` without encoding it unless it may be."""
        if text and len(text) * 4 > self.max_filter_bytes:  # maybe over (<= 4 bytes a char)
            self.check_filter_bytes(len(text.encode("utf-8", "surrogatepass")), row)

    def parse_filter(self, text: str | None, row: str = "") -> Expr | None:
        """``text`` parsed within the limits (empty or None: no filter); :class:`RequestError`
        naming the limit, or the parser's complaint, starting with ``filter:``."""
        if not text:
            return None
        # here, not at the top: the config (serve.toml, the CLI) must load without torch
        from retrieval.filters import FilterTooLargeError, parse_filter

        self.check_filter_text(text, row)
        try:
            return parse_filter(
                text, max_clauses=self.max_filter_clauses, max_values=self.max_filter_set_values
            )
        except FilterTooLargeError as e:
            key = {"max_clauses": "max_filter_clauses", "max_values": "max_filter_set_values"}
            note = f" (limits.{key[e.limit]})" if e.limit in key else ""
            raise RequestError(f"{e}{note}{row}") from None
        except ValueError as e:
            msg = str(e) if str(e).startswith("filter") else f"filter: {e}"
            raise RequestError(msg + row) from None
