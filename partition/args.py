"""argparse types for the command lines (python -m partition, pipe.run, bench): a bad number is a
one-line usage error naming the value and the fix, before anything is traced or launched."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

__all__ = ["OneLineParser", "whole", "wholes"]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage error is one line, `prog: error: message` (exit code 2), as the command's
    other usage errors are."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def whole(least: int = 1, flag: str = "", example: int | None = None) -> Callable[[str], int]:
    """A whole number >= `least` (`flag` and `example` name the fix)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            fix = f"; e.g. {flag} {example if example is not None else least}" if flag else ""
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, got {text!r}{fix}")
        return value
    return parse


def wholes(least: int = 1) -> Callable[[str], str]:
    """Comma-separated whole numbers, each >= `least` (kept as the text, which the callers split)."""
    one = whole(least)

    def parse(text: str) -> str:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers >= {least}, got {text!r}")
        for p in parts:
            try:
                one(p.strip())
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers >= {least}, got {text!r} "
                                                 f"({p.strip()!r})") from None
        return text
    return parse
