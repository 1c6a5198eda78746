"""What every bench shares on the way out: its command line, where it writes, its progress bar, its last words.

One rule for every bench: a run writes into a new directory, ./radixserve-bench/<bench>-<YYYYmmdd-HHMMSS>/ under
the current directory, unless --out names a directory (created if missing; files of the same name in it are
replaced). The results the README quotes live in bench/results/ and were written with `--out bench/results`.
JSON and Markdown are always written; a PNG only where matplotlib is installed (the `bench` extra), otherwise
the run says so and leaves no older PNG of that name behind. At the end a run prints its table and the paths
it wrote.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from tqdm import tqdm

DEFAULT_ROOT = "radixserve-bench"
PNG_SKIPPED = "matplotlib is not installed (pip install 'radixserve[bench]')"
OUT_HELP = ("directory for this run's files, created if missing; files of the same name in it are replaced "
            f"(default: a new directory {DEFAULT_ROOT}/<bench>-<date>-<time>/ under the current directory)")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and appends each flag's default, written as it is typed."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or default == [] or "default" in text:
            return text
        if isinstance(default, (list, tuple)):
            default = ",".join(str(x) for x in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


def bench_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of `python -m radixserve.bench.<module>`: the docstring's first paragraph as its description,
    defaults shown, and --out."""
    description = (doc or "").strip().split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=f"python -m radixserve.bench.{module}", description=description,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--out", metavar="DIR", help=OUT_HELP)
    return parser


def comma_choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of `allowed` values, each once, in the order given."""
    def parse(text: str) -> list[str]:
        values = text.split(",")
        if bad := [v for v in values if v not in allowed]:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: choose from {', '.join(allowed)}")
        return list(dict.fromkeys(values))
    return parse


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses argv (sys.argv[1:] when None) and records the command line as the reports quote it."""
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.command = " ".join([parser.prog, *args.argv])
    return args


@contextlib.contextmanager
def progress(total: int, desc: str, unit: str = "run") -> Iterator[tqdm]:
    """A progress bar on stderr while a bench measures: shown on a terminal, off when stderr is a file or a
    pipe; log lines print above it instead of through it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=total, desc=desc, unit=unit, disable=None, file=sys.stderr) as bar:
        yield bar


class BenchOutput:
    """The directory one bench run writes into, and the list of what it wrote."""

    def __init__(self, bench: str, out: str | None = None, now: datetime.datetime | None = None) -> None:
        self.explicit = out is not None
        stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
        self.dir = out if out is not None else os.path.join(DEFAULT_ROOT, f"{bench}-{stamp}")
        self.written: list[str] = []
        self.notes: list[str] = []
        self._ready = False

    def path(self, name: str) -> str:
        """Where file `name` goes; the directory is made on first use (a run that fails before writing
        leaves nothing behind), with a suffix -2, -3, ... when a default one of that name already exists."""
        if not self._ready:
            if self.explicit:
                os.makedirs(self.dir, exist_ok=True)
            else:
                base, num = self.dir, 1
                while True:
                    try:
                        os.makedirs(self.dir)
                        break
                    except FileExistsError:
                        num += 1
                        self.dir = f"{base}-{num}"
            self._ready = True
        return os.path.join(self.dir, name)

    def write_text(self, name: str, text: str) -> str:
        path = self.path(name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        self.written.append(path)
        return path

    def write_json(self, name: str, data: Any) -> str:
        return self.write_text(name, json.dumps(data, indent=2))

    def write_plot(self, name: str, draw: Callable[[str], None]) -> str | None:
        """draw(path) saves the figure; without matplotlib nothing is drawn, an older file of that name is
        removed (it would not belong to this run) and the run notes the skip."""
        path = self.path(name)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            if os.path.exists(path):
                os.remove(path)
            self.notes.append(f"{name} skipped: {PNG_SKIPPED}")
            return None
        draw(path)
        self.written.append(path)
        return path

    def write_report(self, stem: str, data: Any, markdown: str,
                     draw: Callable[[str], None] | None = None) -> str:
        """stem.json, stem.png (when `draw` is given) and stem.md; without the PNG the Markdown says so where
        it would have shown it. Returns the Markdown as written."""
        self.write_json(stem + ".json", data)
        png = stem + ".png"
        if draw is not None and self.write_plot(png, draw) is None:
            markdown = re.sub(r"!\[[^\]]*\]\(" + re.escape(png) + r"\)", f"(plot skipped: {PNG_SKIPPED})",
                              markdown)
        self.write_text(stem + ".md", markdown)
        return markdown

    def finish(self, table: str, file: TextIO | None = None) -> None:
        """The run's last words on stdout: its table, then every path it wrote and what it skipped."""
        out = file or sys.stdout
        print(table.rstrip("\n"), file=out)
        print(file=out)
        print(f"Wrote {len(self.written)} file(s) to {self.dir}:" if self.written else "Wrote no files.", file=out)
        for path in self.written:
            print(f"  {path}", file=out)
        for note in self.notes:
            print(f"  {note}", file=out)
        out.flush()


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default, as vLLM's bench reports)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
