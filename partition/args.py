"""argparse types for the command lines (python -m partition, pipe.run, bench): a bad number is a
one-line usage error naming the value and the fix, before anything is traced or launched."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn

__all__ = ["OneLineParser", "file_to_write", "whole", "wholes"]


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


def file_to_write(text: str) -> str:
    """A path a file can be written to: not a folder, in a folder that exists (found by review: a folder, or a
    missing parent, failed after planning or exporting, with a traceback and a .tmp file left behind)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the path of a file, in it or elsewhere")
    parent = path.parent
    if not parent.is_dir():
        why = "is a file" if parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"the folder of {text}, {parent}, {why}; give a path in an existing folder")
    return text
