"""Argument parsing for ``pdgate sim`` and ``pdgate plan`` whose errors are one line.

argparse prints the whole usage before an error: for the simulator that is 30 lines, and the one
line that matters comes last. Here a wrong flag says what is wrong and where the flags are listed;
a bad file or value found after parsing (:meth:`Parser.fail`) says only what is wrong."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A flag argparse refused: the message and where the flags are listed, exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")

    def fail(self, message: str) -> NoReturn:
        """A value or file refused after parsing: the message alone, exit status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default where it says something (not "default: None" for a flag whose help says
    what leaving it out means, nor "default: False" for a switch); the description and epilog as
    written (they hold examples)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default: Any = action.default
        if default is None or default is False or default == argparse.SUPPRESS or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
