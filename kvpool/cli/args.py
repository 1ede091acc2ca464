"""The argument parser both command lines use: a mistake is one line, with the nearest option."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

_UNKNOWN = re.compile(r"unrecognized arguments: (.*)$")

#: exit status of a command line that could not be parsed (argparse's own)
USAGE_EXIT = 2


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr and exit status 2: an
    unknown option names the nearest known one (``--tiers.dram.capacty`` -> "did you mean
    --tiers.dram.capacity?") instead of printing the whole usage."""

    def error(self, message: str) -> NoReturn:
        m = _UNKNOWN.search(message)
        if m:
            unknown = next((word for word in m.group(1).split() if word.startswith("-")), m.group(1).split()[0])
            name = unknown.split("=", 1)[0]
            known = [opt for action in self._actions for opt in action.option_strings]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            message = f"unknown option {name}{hint}"
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(USAGE_EXIT)
