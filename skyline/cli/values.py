"""The parser and the value types of the CLI's flags: one sentence for a bad value, the
defaults in every flag's help."""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn

from skyline.config import ConfigError, parse_size


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default after its help, unless the help already speaks of it (or the
    flag is a switch, or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and a pointer to --help, not the whole usage
    block first: `skyline serve: error: --port must be in 1..65535, got 99999`."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        # Unknown flags are reported by the command that got them (`skyline serve: error:
        # unrecognized arguments: --prot 80; did you mean --port?`), not by `skyline`.
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            leaf: argparse.ArgumentParser = getattr(ns, "leaf_parser", self)
            known = [o for a in leaf._actions for o in a.option_strings]
            close = [m for e in extra if e.startswith("--")
                     for m in difflib.get_close_matches(e.split("=")[0], known, 1, 0.75)]
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            leaf.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return ns

    def error(self, message: str) -> NoReturn:
        m = re.match(r"argument ([^:/]+)(?:/[^:]*)?: (.*)", message, re.S)
        if m:  # "argument --port: must be ..." -> "--port must be ..."
            message = f"{m[1]} {m[2]}" if m[2].startswith("must") else f"{m[1]}: {m[2]}"
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in lo..hi (no upper bound when hi is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            span = f"at least {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a number in [lo, hi] ((lo, hi] with lo_open; no upper bound when hi is
    None)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if value in (math.inf, -math.inf):  # a budget or timeout of inf would never end
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        low_ok = value > lo if lo_open else value >= lo
        if not low_ok or (hi is not None and value > hi) or value != value:
            left = "(" if lo_open else "["
            span = f"in {left}{lo}, {hi}]" if hi is not None else \
                f"{'above' if lo_open else 'at least'} {lo}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return parse


PORT = int_in(1, 65535)
POSITIVE = int_in(1)
NON_NEGATIVE = int_in(0)
_HOST_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def port_range(text: str) -> tuple[int, int]:
    """An argparse type: a port N, or a range LO-HI, as (LO, HI)."""
    lo, sep, hi = text.partition("-")
    first, last = PORT(lo), PORT(hi) if sep else PORT(lo)
    if last < first:
        raise argparse.ArgumentTypeError(f"must be a port or a range LO-HI, got {text!r}")
    return first, last


def count_or_auto(text: str) -> int | str:
    """An argparse type: "auto", or a whole number of at least 1."""
    return "auto" if text == "auto" else POSITIVE(text)


def host(text: str) -> str:
    """An argparse type: an IP address or a well-formed host name (resolved at bind time)."""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if re.fullmatch(r"[\d.]+", text) or not _HOST_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be an IP address (e.g. 127.0.0.1 or 0.0.0.0 for every interface) or a host "
            f"name, got {text!r}")
    return text


def size(text: str) -> str:
    """An argparse type: a byte size such as 2GiB (kept as text for EngineArgs)."""
    try:
        parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
