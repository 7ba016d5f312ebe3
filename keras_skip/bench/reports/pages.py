"""Markdown pages whose tables a command prints: the markers around such a
table, and printing every table of a page again from the files it names.

A table printed by ``python -m MODULE KIND ARGUMENTS`` stands between::

    <!-- generated: python -m MODULE KIND ARGUMENTS -->
    ...
    <!-- end of generated table -->

so that a test can print it again and compare, and ``refresh`` can rewrite
it after a new run.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable


def generated(module: str) -> re.Pattern:
    """The markers of the tables ``python -m module`` prints; the groups are
    the opening line, the kind, the arguments, the table and the closing
    line."""
    return re.compile(
        rf"(<!-- generated: python -m {re.escape(module)} "
        r"(\w+) ([^>]*) -->\n)"
        r"(.*?)(<!-- end of generated table -->\n)",
        flags=re.S,
    )


def refresh(
    page: str | pathlib.Path,
    markers: re.Pattern,
    render: Callable[[str, str, pathlib.Path], str],
) -> int:
    """Prints again every table of ``page`` between ``markers`` with
    ``render(kind, arguments, root)``, ``root`` being the repository (the
    parent of the page's folder); returns how many tables the page holds."""
    page = pathlib.Path(page)
    root = page.resolve().parent.parent
    text = page.read_text()
    count = len(markers.findall(text))
    page.write_text(markers.sub(lambda m: m[1] + render(m[2], m[3], root) + m[5], text))
    return count
