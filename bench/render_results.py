"""Render ``bench/RESULTS.md``, the current page, from ``bench/results/*.json``.

``bench/page.toml`` names, per target, the JSON files that hold its latest figures and how to
read them (``kind``); this script reads each file and writes one table per target: the latest
figure, its ratio to the fastest peer that reaches the same recall (named), the command (from the
JSON's own argv), the date and the commit that recorded the JSON. Figures older than the JSON
files are ``[[target.hand]]`` rows of the manifest, copied from ``bench/journal/`` and marked so.

    .venv/bin/python bench/render_results.py           # write bench/RESULTS.md
    .venv/bin/python bench/render_results.py --check   # exit 1 when RESULTS.md is not the render
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib
from pathlib import Path

from result_rows import BENCH, KINDS, Data, Rows, Spec, load

MANIFEST = BENCH / "page.toml"
PAGE = BENCH / "RESULTS.md"


def command(spec: Spec, data: Data) -> str:
    """The command that wrote the JSON: the manifest's, or the bench script with the JSON's argv."""
    if "command" in spec:
        return str(spec["command"])
    meta = data.get("meta") or data.get("environment") or {}
    argv = meta.get("argv") or data.get("argv") or []
    env = f"env {spec['env']} " if "env" in spec else ""
    return f"{env}.venv/bin/python bench/{spec['script']} {shlex.join(argv)}".rstrip()


def machine(data: Data) -> str:
    """The CPU and our scan's instruction set, where the JSON recorded them."""
    meta, builds = data.get("meta") or {}, data.get("builds") or {}
    said = [str(meta["cpu"])] if meta.get("cpu") else []
    said += [f"our scan: {builds['ours-int8-isa']}"] if builds.get("ours-int8-isa") else []
    return f" ({', '.join(said)})" if said else ""


def date_of(spec: Spec, data: Data) -> str:
    meta = data.get("meta") or data.get("environment") or {}
    return str(spec.get("date") or meta.get("date", "")[:10])


def table(head: str, rows: Rows) -> list[str]:
    """A markdown table and the blank line after it."""
    return [f"| {head} |", "|" + "---|" * (head.count(" | ") + 1), *(f"| {r} |" for r in rows), ""]


def section(target: Spec) -> list[str]:
    """One target: its rendered table with its numbered commands, then its hand-kept rows."""
    out = [f"## {target['title']}", ""] + ([target["note"].strip(), ""] if "note" in target else [])
    if target.get("row"):
        commands: list[tuple[str, str, str]] = []
        rows: Rows = []
        for spec in target["row"]:
            data = load(spec["json"])
            cmd = (command(spec, data), spec["json"], machine(data))
            commands += [] if cmd in commands else [cmd]
            tail = f"{date_of(spec, data)} | `{spec['commit']}` | [{commands.index(cmd) + 1}]"
            rows += [f"{r} | {tail}" for r in KINDS[spec["kind"]][0](data, spec)]
        out += table(KINDS[target["row"][0]["kind"]][1] + " | date | commit | cmd", rows)
        out += [f"{i}. `{c}` → `bench/results/{j}`{m}" for i, (c, j, m) in enumerate(commands, 1)]
        out.append("")
    if target.get("hand"):
        out += [
            "Hand-kept (no JSON for these figures; copied from the journal, with its date and commit):",
            "",
        ]
        cells = ("figure", "latest", "against", "date", "commit", "source")
        hand = [
            " | ".join(f"`{h[c]}`" if c == "commit" else h[c] for c in cells)
            for h in target["hand"]
        ]
        out += table("figure | latest | against | date | commit | journal section", hand)
    return out


def render(manifest: Spec) -> str:
    lines = [manifest["title"], "", manifest["intro"].strip(), ""]
    for target in manifest["target"]:
        lines += section(target)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="fail when RESULTS.md differs from the render"
    )
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="the page's manifest (TOML)")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page to write or check")
    args = ap.parse_args(argv)
    text = render(tomllib.loads(args.manifest.read_text()))
    if not args.check:
        args.out.write_text(text)
    elif not args.out.exists() or args.out.read_text() != text:
        print(
            f"{args.out} is not what {args.manifest} renders: run bench/render_results.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
