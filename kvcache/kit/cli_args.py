"""The command line's argument checks: types that refuse a bad value as it is parsed.

Every numeric flag and output path of ``python -m kvcache`` (``kvcache.kit.cli``)
is checked as it is parsed, before any work: a bad one is one line on stderr and
exit status 2 (``Parser.error``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kvcache.kit.workloads import WORKLOAD_NAMES


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (and exit status 2)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit 2 (argparse prints the usage too)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an int of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            what = {0: "0 or more", 1: "a positive integer"}.get(low, f"at least {low}")
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def float_above(low: float, inclusive: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite float above ``low`` (or equal, ``inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            what = f"{low:g} or more" if inclusive else f"more than {low:g}"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def output_path(text: str) -> str:
    """An argparse ``type``: a file to write, whose folder exists ("" : none)."""
    if not text:
        return text
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {path.parent} to write {path.name} in")
    return text


def workload_list(text: str) -> str:
    """An argparse ``type``: comma-separated workload names, each known ("": none)."""
    unknown = [name for name in text.split(",") if name and name not in WORKLOAD_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}"
        )
    return text


def need_matplotlib(flag: str) -> None:
    """Refuse ``flag`` (a plot) before any work where matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag}: matplotlib is not installed (pip install matplotlib)")


POSITIVE = int_at_least(1)
NON_NEGATIVE = int_at_least(0)
