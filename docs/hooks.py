"""MkDocs hook: renders the Sphinx roles of the docstrings as code.

Some docstrings write ``:class:`IntervalDecision``` or ``:func:`simulate```;
Markdown renders the role's name as text before the code. This hook drops the
role and, for a fully qualified ``keras_skip`` name, links the code to its
entry in the API reference when there is one.
"""

import re

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(<code>([^<]*)</code>)")


def _render(match: re.Match) -> str:
    code, name = match.group(1), match.group(2)
    if name.startswith("keras_skip."):
        return f'<autoref identifier="{name}" optional>{code}</autoref>'
    return code


def on_page_content(html, **kwargs):
    return _ROLE.sub(_render, html)
