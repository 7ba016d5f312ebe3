"""The data of the efficiency map: shards of the MNIST subset, and the
character-level text of the Python standard library's own source files.

NumPy only: nothing here imports TensorFlow, so the shards can be made and
checked before TensorFlow sets its devices up.
"""

from __future__ import annotations

import hashlib
import itertools
import pathlib
import sysconfig
from dataclasses import dataclass

import numpy as np

#: Shard kinds of the classification workloads: IID, and Dirichlet-skewed
#: over labels with concentration alpha (smaller is more skewed).
IMAGE_SHARDS = ("iid", "dirichlet1.0", "dirichlet0.1")
#: Shard kinds of the language model: IID windows of the whole text, and
#: contiguous runs of the sorted source files (one package's files on one
#: replica: different vocabularies, styles and lengths).
TEXT_SHARDS = ("iid", "files")


def dirichlet_alpha(shards: str) -> float | None:
    """The alpha of ``"dirichletA"``, None for ``"iid"``."""
    if shards == "iid":
        return None
    if shards.startswith("dirichlet"):
        try:
            alpha = float(shards.removeprefix("dirichlet"))
        except ValueError:
            alpha = 0.0
        if alpha > 0:
            return alpha
    raise ValueError(f"shards {shards!r}: expected 'iid' or 'dirichletALPHA'")


def iid_shards(count: int, replicas: int, seed: int) -> list[np.ndarray]:
    """``count`` indices shuffled with ``seed`` and cut into ``replicas``
    shards of (nearly) equal size."""
    order = np.random.default_rng(seed).permutation(count)
    return [np.sort(part) for part in np.array_split(order, replicas)]


def dirichlet_shards(
    labels: np.ndarray,
    replicas: int,
    alpha: float,
    seed: int,
    min_size: int = 32,
    max_draws: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed shards: for every class, the share of its examples each
    replica gets is drawn from Dirichlet(alpha, ..., alpha), as in the
    federated-learning literature (Hsu et al. 2019). Draws are repeated
    (with the same generator, so deterministic by ``seed``) until every
    shard holds at least ``min_size`` examples. The shards partition the
    indices ``0 .. len(labels) - 1``; each is sorted.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, not {alpha}")
    if min_size * replicas > len(labels):
        raise ValueError(
            f"{replicas} shards of at least {min_size} examples need more than "
            f"{len(labels)} examples"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_draws):
        parts: list[list[np.ndarray]] = [[] for _ in range(replicas)]
        for c in classes:
            members = np.flatnonzero(labels == c)
            members = members[rng.permutation(len(members))]
            shares = rng.dirichlet(np.full(replicas, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for i, piece in enumerate(np.split(members, cuts)):
                parts[i].append(piece)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) >= min_size:
            return shards
    raise RuntimeError(
        f"no Dirichlet({alpha}) draw in {max_draws} gave every one of {replicas} "
        f"shards {min_size} examples"
    )


def label_shards(
    labels: np.ndarray, replicas: int, shards: str, seed: int, min_size: int = 32
) -> list[np.ndarray]:
    """The shards of kind ``shards`` (one of :data:`IMAGE_SHARDS`, or any
    ``"dirichletA"``) of a labelled set, one per replica."""
    alpha = dirichlet_alpha(shards)
    if alpha is None:
        return iid_shards(len(labels), replicas, seed)
    return dirichlet_shards(labels, replicas, alpha, seed, min_size=min_size)


def skew(labels: np.ndarray, shards: list[np.ndarray]) -> float:
    """How far the shards' label distributions are from the whole set's:
    the mean over shards of the total-variation distance (0: every shard
    has the global mix; 1: disjoint from it)."""
    classes = np.unique(labels)
    overall = np.array([np.mean(labels == c) for c in classes])
    distances = []
    for shard in shards:
        own = labels[shard]
        mix = np.array([np.mean(own == c) for c in classes])
        distances.append(0.5 * np.abs(mix - overall).sum())
    return float(np.mean(distances))


# --- the language model's text ---------------------------------------------

#: Characters are bytes below 128 (ASCII); every other byte is one token.
VOCABULARY = 128
#: Directories of the standard library left out of the corpus: the test
#: suite (huge, and full of generated data), installed packages, caches,
#: and the help topics (one 800 kB file of prose).
EXCLUDED_DIRECTORIES = frozenset(
    {
        "test",
        "tests",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "idlelib",
        "pydoc_data",
    }
)


def stdlib_files(root: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted by their path relative
    to ``root`` (default: ``sysconfig.get_paths()["stdlib"]``), without the
    directories of :data:`EXCLUDED_DIRECTORIES`."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRECTORIES.isdisjoint(relative.parts[:-1]):
            found.append(relative)
    return [root / p for p in sorted(found, key=lambda p: p.as_posix())]


def encode(text: bytes) -> np.ndarray:
    """Bytes to tokens: ASCII as is, any other byte as ``VOCABULARY - 1``
    (DEL, which source files do not hold)."""
    tokens = np.frombuffer(text, dtype=np.uint8).copy()
    tokens[tokens >= VOCABULARY] = VOCABULARY - 1
    return tokens


@dataclass
class Corpus:
    """The standard library's text, split by file into training and
    validation, with the training files in sorted order."""

    train_files: list[str]
    train_texts: list[np.ndarray]
    validation: np.ndarray
    validation_files: list[str]
    digest: str

    @property
    def train_tokens(self) -> int:
        return sum(len(t) for t in self.train_texts)


def load_corpus(
    max_train_tokens: int = 4_000_000,
    validation_every: int = 10,
    root: str | pathlib.Path | None = None,
) -> Corpus:
    """Every ``validation_every``-th file of :func:`stdlib_files` is held out
    for validation; of the other files, every ``k``-th (the smallest ``k``
    that keeps them under ``max_train_tokens``) is training text, in sorted
    order, so the training text spans the whole library. The files are the
    same on every run of one Python version; ``digest`` (SHA-256 of the
    names and bytes, kept in the results) tells two versions apart."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if len(files) < 2 * validation_every:
        raise RuntimeError(f"only {len(files)} Python files found under {root}")
    held = [i % validation_every == validation_every - 1 for i in range(len(files))]
    candidates = [path for path, h in zip(files, held, strict=True) if not h]
    total = sum(path.stat().st_size + 1 for path in candidates)
    stride = max(1, -(-total // max_train_tokens))
    chosen = set(candidates[::stride])
    digest = hashlib.sha256()
    train_files, train_texts, validation, validation_files = [], [], [], []
    for path, is_held in zip(files, held, strict=True):
        if not is_held and path not in chosen:
            continue
        name = path.relative_to(root).as_posix()
        raw = path.read_bytes()
        if not raw:
            continue
        digest.update(name.encode() + b"\0" + raw)
        target = (
            (validation, validation_files) if is_held else (train_texts, train_files)
        )
        target[0].append(encode(raw + b"\n"))
        target[1].append(name)
    return Corpus(
        train_files,
        train_texts,
        np.concatenate(validation),
        validation_files,
        digest.hexdigest()[:16],
    )


def text_shards(corpus: Corpus, replicas: int, shards: str, seed: int) -> list:
    """Each replica's text, a token array.

    ``"iid"``: the whole training text for every replica (each samples its
    own random windows). ``"files"``: the sorted training files cut into
    ``replicas`` contiguous runs of about equal length, so that each
    replica reads its own packages only.
    """
    if shards == "iid":
        whole = np.concatenate(corpus.train_texts)
        return [whole] * replicas
    if shards != "files":
        raise ValueError(f"text shards {shards!r}: expected one of {TEXT_SHARDS}")
    return [np.concatenate(part) for part in file_runs(corpus.train_texts, replicas)]


def file_runs(texts: list[np.ndarray], replicas: int) -> list[list[np.ndarray]]:
    """``texts`` (in order) cut into ``replicas`` contiguous runs, each of
    about ``1 / replicas`` of the tokens and at least one file."""
    if len(texts) < replicas:
        raise ValueError(f"{len(texts)} files cannot make {replicas} shards")
    lengths = np.cumsum([len(t) for t in texts])
    bounds = [0]
    for i in range(1, replicas):
        cut = int(np.searchsorted(lengths, lengths[-1] * i / replicas)) + 1
        cut = min(max(cut, bounds[-1] + 1), len(texts) - (replicas - i))
        bounds.append(cut)
    bounds.append(len(texts))
    return [texts[a:b] for a, b in itertools.pairwise(bounds)]


def windows(tokens: np.ndarray, length: int, count: int, seed: int) -> np.ndarray:
    """``count`` windows of ``length + 1`` tokens at random starts (inputs
    and their next-token targets), shape ``(count, length + 1)``."""
    if len(tokens) <= length + 1:
        raise ValueError(f"a text of {len(tokens)} tokens has no window of {length}")
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length - 1, count)
    return tokens[starts[:, None] + np.arange(length + 1)]
