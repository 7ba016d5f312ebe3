"""Every measured number the README, the docs and the notebooks quote comes
from a committed result file in ``docs/results/``.

The pages read are ``README.md``, ``docs/*.md`` and the Markdown cells of
``notebooks/*.ipynb``. ``CHANGELOG.md`` is not read: it records what was
measured at each release, and older entries keep older numbers.

**What counts as a measured number.** A number followed by a unit of time
(``s``, ``ms``, ``µs``, ``min``, ``minutes``, ``seconds``, ``hours``; also
``N min M s``), of size (``KB``, ``MB``, ``GB``), a ratio (``x``, ``×``, or
``times`` before ``sooner``, ``faster``, ``slower``, ``cheaper``,
``longer``, ``shorter``, ``more``, ``fewer``, ``less``, ``theirs`` or
``as``), a share (``%``, ``points``), or a bare decimal with three or more
decimal places (an accuracy such as ``0.887``). A range ``A-B unit`` or ``A
to B unit`` counts as two. Everything else is not: counts (workers, steps,
parameters, epochs, bytes per value), versions, dates, option values, rates
of a link (``Mbit/s``, ``Gbit/s``), and accuracies written with two decimal
places, the way targets are given (``0.88``). Numbers in fenced code blocks,
in inline code and in the generated tables (checked by
``test_release.py`` and ``test_planner.py``) are not read either.

**The convention.** The block (paragraph, list or heading, up to the next
blank line) after a comment

    <!-- numbers: docs/results/a.json docs/results/b.json -->

takes its measured numbers from the files named; a blank line may separate
the comment from its block. Several blocks in a row take the same files
between ``<!-- numbers begin: FILES -->`` and ``<!-- numbers end -->``.

**A quoted number matches** a value of the files named if it equals the
value rounded as the text shows it (``9.6 s`` matches ``9.58``; ``16 min``
anything from 15.5 to 16.5 minutes), after converting the unit: a time from
seconds (or from the value itself for a file's ``*_ms_*`` fields), a size in
MB from MB or bytes, a share in percent from a fraction or its complement
(``98%`` busy from a utilisation of ``0.02``), a ratio from the value or its
reciprocal. The values of a file are its numbers, the numbers written inside
its strings (``"25ms"``, ``"3-8"``), and the minimum, maximum, mean and
median of each list of numbers and of each field over a list of objects
(``rows[*].epoch_seconds``, ``workers[*].hidden``). A number may also be the
difference or the ratio of two numbers quoted in the same block that match
themselves (``0.9 s longer`` after ``13.83 s against 12.91 s``).

Every measured number outside a marked block fails the test, except the
phrases of :data:`ALLOWED`, each with its reason. The test reads files only.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import re
import statistics

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Phrases with a measured number that no result file holds, and why.
ALLOWED: dict[tuple[str, str], str] = {
    ("README.md", "about 2-4 minutes on 2 cores"): (
        "how long the demo takes end to end, installation excluded, as a "
        "user plans for it; the demo's own result (docs/results/demo.json) "
        "times its methods, not the whole command"
    ),
    ("docs/quickstart.md", "2-4 minutes on 2 cores"): (
        "the demo's duration as in the README"
    ),
    ("docs/multi-worker.md", "delays one worker by 2 s"): (
        "a setting of the test the sentence names, not a measurement"
    ),
    ("docs/planner.md", "every row within 25%"): "the test's tolerance",
    ("docs/planner.md", "bounds the speed-up near 64x"): (
        "follows from the setting max_interval 64"
    ),
    ("docs/planner.md", "0.1 s a step"): "an assumed step time, stated as one",
    ("docs/planner.md", "0.5 s a step"): "an assumed step time, stated as one",
    ("docs/planner.md", "at 0.1 ms, the fitted overhead (10 ms a ring step)"): (
        "a latency given to the planner and a constant of its model: settings"
    ),
    ("notebooks/adaptive_interval.ipynb", "10, 100 or 1000 times longer"): (
        "the factors the cell feeds to the rule, not measurements"
    ),
    ("docs/algorithm.md", "sent 2x (momentum) or 3x (Adam) the bytes"): (
        "counted, not measured: an average sends the weights and one or two "
        "slots of the same size"
    ),
    ("docs/algorithm.md", "0.999 for Adam"): "a setting: Adam's default decay",
    ("docs/algorithm.md", "closed 82-92% of the training-loss"): (
        "a float64 simulation of the equations, not a benchmark run"
    ),
}

#: Blocks marked from here, by their first words, for pages that carry no
#: comment of their own yet.
MARKED_HERE: dict[tuple[str, str], tuple[str, ...]] = {
    ("docs/algorithm.md", '- `"average"` reached the same accuracy'): (
        "docs/results/slots.json",
    ),
}

GENERATED = re.compile(
    r"<!-- generated: [^\n]*-->\n.*?<!-- end of generated table -->\n", re.S
)
TABLE = re.compile(
    r"<!-- generated: python -m keras_skip\.bench\.(?:reports|planner)\.tables \w+ "
    r"(?P<files>[^>]*) -->\n(?P<table>.*?)<!-- end of generated table -->",
    re.S,
)
MARKER = re.compile(r"^\s*<!-- numbers(?P<begin> begin)?: (?P<files>[^>]*?) -->\s*$")
END = re.compile(r"^\s*<!-- numbers end -->\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")

NUMBER = r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
TIME = r"s|ms|µs|min|minutes|seconds|hours"
RATIO = (
    r"x|×|times(?= (?:sooner|faster|slower|cheaper|longer|shorter|more|fewer"
    r"|less|theirs|as)\b)"
)
UNIT = rf"(?:{TIME}|KB|MB|GB|%|points|{RATIO})"
MINUTES_AND_SECONDS = re.compile(
    rf"(?<![\w.])(?P<a>{NUMBER}) min (?P<b>{NUMBER}) s(?![\w/])"
)
QUANTITY = re.compile(
    rf"(?<![\w.,])(?P<a>{NUMBER})(?:\s?(?:-|–| to )\s?(?P<b>{NUMBER}))?"
    rf"\s?(?P<unit>{UNIT})(?![\w/])"
)
BARE = re.compile(r"(?<![\w.,])[-−]?0\.\d{3,}(?![\w.])")
#: A time that names a link's latency is a setting of the run.
LATENCY = re.compile(
    rf"(?<![\w.,]){NUMBER}\s?ms(?= (?:one-way|one way|of latency|of one-way latency"
    r"|latency)\b)"
)


def pages() -> dict[str, list[str]]:
    """Each page's text (a notebook's Markdown cells, each on its own)."""
    found = {"README.md": [(ROOT / "README.md").read_text()]}
    for path in sorted((ROOT / "docs").glob("*.md")):
        found[str(path.relative_to(ROOT))] = [path.read_text()]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        found[str(path.relative_to(ROOT))] = [
            "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
        ]
    return found


def blocks(text: str) -> list[tuple[tuple[str, ...], str]]:
    """The text's blocks outside code and generated tables, each with the
    result files its marker names (none when unmarked)."""
    text = GENERATED.sub("", text)
    found, lines, files, pending, span = [], [], (), None, None
    fenced = False

    def close():
        nonlocal lines, files
        if lines:
            found.append((files, "\n".join(lines)))
        lines, files = [], ()

    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            close()
            continue
        if fenced:
            continue
        if END.match(line):
            close()
            span = None
            continue
        marker = MARKER.match(line)
        if marker:
            close()
            named = tuple(marker["files"].split())
            if marker["begin"]:
                span = named
            else:
                pending = named
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            close()
            continue
        if not lines:
            files = span or pending or ()
            pending = None
        lines.append(line)
    close()
    return found


def readable(block: str) -> str:
    """The block's prose: no inline code, comments, link targets or HTML."""
    block = re.sub(r"<!--.*?-->", " ", block, flags=re.S)
    block = re.sub(r"(`+).*?\1", " ", block, flags=re.S)
    block = re.sub(r"\]\([^)]*\)", "]", block)
    block = re.sub(r"<[^>]+>", " ", block)
    return " ".join(block.replace("**", "").split())


#: A unit's size in its dimension's base unit (seconds, MB), for derivations.
SCALE = {"ms": 1e-3, "µs": 1e-6, "min": 60, "minutes": 60, "hours": 3600}
SCALE |= {"KB": 1e-3, "GB": 1e3}
DIMENSION = dict.fromkeys(("s", "seconds", "ms", "µs", "min", "minutes", "hours"), "s")
DIMENSION |= dict.fromkeys(("KB", "MB", "GB"), "MB")


def decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def value(number: str) -> float:
    return float(number.replace(",", "").replace("−", "-"))


def quoted(prose: str) -> list[tuple[str, str, str]]:
    """The measured numbers of ``prose``: (number as written, unit, the
    phrase around it)."""
    found = []

    def take(match, pairs):
        phrase = prose[max(0, match.start() - 30) : match.end() + 10]
        found.extend((number, unit, phrase) for number, unit in pairs)
        return " " * (match.end() - match.start())

    prose = LATENCY.sub(lambda m: " " * len(m[0]), prose)
    prose = MINUTES_AND_SECONDS.sub(
        lambda m: take(m, [(f"{value(m['a']) * 60 + value(m['b']):g}", "s")]),
        prose,
    )
    prose = QUANTITY.sub(
        lambda m: take(m, [(n, m["unit"]) for n in (m["a"], m["b"]) if n is not None]),
        prose,
    )
    BARE.sub(lambda m: take(m, [(m[0], "")]), prose)
    return found


def json_values(data, key: str = "") -> list[tuple[float, str]]:
    """The numbers of a result file with the name of the field holding
    each, and the statistics of its lists (see the module's docstring)."""
    found = []
    if isinstance(data, bool) or data is None:
        return found
    if isinstance(data, int | float):
        return [(float(data), key)]
    if isinstance(data, str):
        return [
            (value(n), f"{key}:{suffix}")
            for n, suffix in re.findall(r"(\d+(?:\.\d+)?)([a-z]*)", data)
        ]
    if isinstance(data, dict):
        for k, v in data.items():
            found += json_values(v, k)
        if isinstance(data.get("seconds"), float) and "validation_seconds" in data:
            # An epoch's training time, as the harness counts it.
            training = data["seconds"] - (data["validation_seconds"] or 0.0)
            found.append((training, "seconds"))
        return found
    numbers = [float(v) for v in data if isinstance(v, int | float)]
    numbers = [v for v, b in zip(numbers, data, strict=False) if b is not True]
    if numbers:
        found += _statistics(numbers, key)
    objects = [v for v in data if isinstance(v, dict)]
    if objects and all("epoch" in o and "seconds" in o for o in objects):
        # Each epoch's own training time, from the running totals.
        times = [o["seconds"] - (o.get("validation_seconds") or 0.0) for o in objects]
        epochs = [b - a for a, b in itertools.pairwise(times)]
        found += [(e, "seconds") for e in epochs]
    for field in {k for o in objects for k in o}:
        column = [
            o[field]
            for o in objects
            if isinstance(o.get(field), int | float)
            and not isinstance(o.get(field), bool)
        ]
        if len(column) > 1:
            found += _statistics([float(v) for v in column], field)
    for v in data:
        found += json_values(v, key)
    return found


def _statistics(numbers: list[float], key: str) -> list[tuple[float, str]]:
    stats = (
        min(numbers),
        max(numbers),
        statistics.fmean(numbers),
        statistics.median(numbers),
    )
    return [(s, key) for s in stats]


def shown(raw: float, key: str, unit: str) -> list[float]:
    """What a file's value ``raw`` (of field ``key``) may be shown as in
    ``unit``."""
    if key == "table":
        return [raw]
    if ":" in key and not key.endswith((":", ":ms", ":s")):
        return []  # a number written with another unit inside a string
    if unit in ("s", "seconds"):
        return [raw / 1e3] if "_ms" in key or key.endswith(":ms") else [raw]
    if unit == "ms":
        return [raw] if "_ms" in key or key.endswith(":ms") else [raw * 1e3]
    if unit == "µs":
        return [raw * 1e3] if "_ms" in key else [raw * 1e6]
    if unit in ("min", "minutes"):
        return [raw / 60]
    if unit == "hours":
        return [raw / 3600]
    if unit == "KB":
        return [raw * 1e3, raw / 1e3]
    if unit == "MB":
        return [raw, raw / 1e6]
    if unit == "GB":
        return [raw / 1e3, raw / 1e9]
    if unit in ("%", "points"):
        return [raw * 100, (1 - raw) * 100, raw]
    if unit in ("x", "×") or unit.startswith("times"):
        return [raw, 1 / raw] if raw else [raw]
    return [raw]


def close_to(number: str, candidate: float) -> bool:
    q = value(number)
    return abs(abs(candidate) - abs(q)) <= 0.5 * 10 ** -decimals(number) * (
        1 + 1e-9
    ) or math.isclose(candidate, q, rel_tol=1e-9)


def table_values() -> dict[str, list[tuple[float, str]]]:
    """The numbers each generated table of the pages prints, by the result
    files it is made from."""
    found: dict[str, list[tuple[float, str]]] = {}
    for texts in pages().values():
        for text in texts:
            for match in TABLE.finditer(text):
                numbers = [
                    (value(n), "table") for n in re.findall(NUMBER, match["table"])
                ]
                for path in match["files"].split():
                    if (ROOT / path).is_dir():
                        # The planner's check: a row per run of the directory.
                        named = [
                            str(p.relative_to(ROOT))
                            for p in sorted((ROOT / path).glob("*.json"))
                        ]
                    else:
                        named = [path]
                    for each in named:
                        found.setdefault(each, []).extend(numbers)
    return found


@pytest.fixture(scope="module")
def loaded():
    cache = {}
    tables = table_values()

    def load(path: str):
        if path not in cache:
            data = json.loads((ROOT / path).read_text())
            cache[path] = json_values(data) + tables.get(path, [])
        return cache[path]

    return load


def unmatched(prose: str, files, load) -> list[str]:
    """The measured numbers of a marked block that none of ``files`` holds."""
    values = [v for f in files for v in load(f)]
    numbers = quoted(prose)
    direct = []
    missing = []
    for number, unit, phrase in numbers:
        if any(
            close_to(number, c) for raw, key in values for c in shown(raw, key, unit)
        ):
            direct.append((value(number) * SCALE.get(unit, 1), DIMENSION.get(unit)))
        else:
            missing.append((number, unit, phrase))
    left = []
    for number, unit, phrase in missing:
        derived = False
        for (a, ua), (b, ub) in itertools.permutations(direct, 2):
            candidates = [a / b] if b else []
            if ua == ub:
                candidates.append(a - b)
            scale = SCALE.get(unit, 1)
            candidates = [c / scale for c in candidates]
            if unit in ("%", "points"):
                candidates = [c * 100 for c in candidates] + candidates
            if any(close_to(number, c) for c in candidates):
                derived = True
                break
        if not derived:
            left.append(f"{number} {unit}: ...{phrase}...")
    return left


def allowed_removed(page: str, prose: str) -> str:
    for (where, phrase), _ in ALLOWED.items():
        if where == page:
            prose = prose.replace(phrase, " ")
    return prose


def test_every_measured_number_comes_from_the_result_file_its_block_names(loaded):
    problems = []
    for page, texts in pages().items():
        for text in texts:
            for files, block in blocks(text):
                for (where, start), named in MARKED_HERE.items():
                    if where == page and block.lstrip().startswith(start):
                        files = named
                prose = allowed_removed(page, readable(block))
                if not files:
                    numbers = quoted(prose)
                    if numbers:
                        problems.append(
                            f"{page}: unmarked block quotes "
                            + "; ".join(f"{n} {u}" for n, u, _ in numbers)
                            + f": {prose[:100]}..."
                        )
                    continue
                for path in files:
                    if not (ROOT / path).is_file():
                        problems.append(f"{page}: names {path}, which does not exist")
                if all((ROOT / path).is_file() for path in files):
                    for left in unmatched(prose, files, loaded):
                        problems.append(f"{page} ({' '.join(files)}): {left}")
    assert not problems, "\n".join(problems)


def test_the_allowed_phrases_are_still_on_their_pages():
    """An allowance whose phrase has left the page is removed from the list."""
    texts = {
        page: " ".join(readable(b) for text in texts for _, b in blocks(text))
        for page, texts in pages().items()
    }
    gone = [key for key in ALLOWED if key[1] not in texts[key[0]]]
    starts = {
        (page, b.lstrip()[:80])
        for page, t in pages().items()
        for x in t
        for _, b in blocks(x)
    }
    gone += [
        key
        for key in MARKED_HERE
        if not any(p == key[0] and s.startswith(key[1]) for p, s in starts)
    ]
    assert not gone, gone


def test_the_rule_reads_what_it_says():
    """The rule on a few sentences: measured numbers are found, settings,
    counts and code are not, and rounding and derived values match."""
    prose = readable(
        "4 workers behind 100 Mbit/s links and `--latency 25ms`, target 0.88, "
        "Python 3.11.7: took **9.6 s** (0.082x), 0.13-0.14 ms, 98% busy, "
        "14 min 16 s, accuracy 0.887, 7.5 MB, 3x3 convolutions, x86_64."
    )
    assert [(n, u) for n, u, _ in quoted(prose)] == [
        ("856", "s"),
        ("9.6", "s"),
        ("0.082", "x"),
        ("0.13", "ms"),
        ("0.14", "ms"),
        ("98", "%"),
        ("7.5", "MB"),
        ("0.887", ""),
    ]
    assert close_to("9.6", 9.58) and not close_to("9.6", 9.54)
    assert close_to("16", 15.67) and close_to("98", (1 - 0.021) * 100)

    def load(path):
        return json_values({"rows": [{"t": 13.83}, {"t": 12.91}], "share": 0.6})

    assert unmatched("13.83 s against 12.91 s, 0.9 s longer, 60%", ["f"], load) == []
    assert unmatched("13.83 s and 1.5 s", ["f"], load) == [
        "1.5 s: ...13.83 s and 1.5 s..."
    ]
    marked = blocks(
        "<!-- numbers: docs/results/mlp.json -->\nA 9.6 s.\n\nB 1 s.\n\n"
        "<!-- numbers begin: x.json -->\nC\n\n- D\n<!-- numbers end -->\nE\n"
        "```\n10 s\n```\n"
    )
    assert marked == [
        (("docs/results/mlp.json",), "A 9.6 s."),
        ((), "B 1 s."),
        (("x.json",), "C"),
        (("x.json",), "- D"),
        ((), "E"),
    ]


#: The errors the multi-worker page quotes, as keras-skip raises them: the
#: source file and the constant parts of the message the page shows.
RAISED = (
    (
        "keras_skip/multi_worker.py",
        "ValueError: The workers are not configured alike, so their collectives "
        "would not match and training would deadlock. Differing: ",
    ),
    (
        "keras_skip/multi_worker.py",
        "Start every worker with the same keras-skip version and arguments.",
    ),
    (
        "keras_skip/_flight.py",
        "RuntimeError: A peer worker stopped or became unreachable while a "
        "delayed average (overlap) was on its way: ",
    ),
    (
        "keras_skip/_flight.py",
        "Restart every worker with the same command; with "
        "keras_skip.BackupAndRestore among the callbacks they resume from the "
        "last epoch every worker backed up, exactly. The cause:",
    ),
)

#: TensorFlow's own errors the page quotes, and where this project meets them.
FROM_TENSORFLOW = (
    (
        "keras_skip/multi_worker.py",
        "The following tasks are unhealthy (stopped sending heartbeats)",
    ),
    ("tests/test_multi_worker.py", "UnavailableError"),
)


def _literals(path: pathlib.Path) -> str:
    """Every string literal of a Python file, adjacent literals joined (as
    the parser joins them), the parts an f-string formats left out."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            found.append(
                "\0".join(
                    v.value
                    for v in node.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)
                )
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return " ".join(" ".join(s.split()) for s in found)


def test_the_multi_worker_page_quotes_the_errors_as_raised():
    """The error texts of the multi-worker page are those the code raises
    (or, for TensorFlow's, those the code and the tests expect)."""
    page = " ".join((ROOT / "docs" / "multi-worker.md").read_text().split())
    for source, message in RAISED:
        raised = message.split(": ", 1)[1] if "Error: " in message else message
        text = " ".join(raised.split())
        assert text in _literals(ROOT / source), (source, text)
        assert message in page, message
    for source, message in FROM_TENSORFLOW:
        source_text = " ".join((ROOT / source).read_text().split())
        assert message in source_text, (source, message)
        assert message in page, message
