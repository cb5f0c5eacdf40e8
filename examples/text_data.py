"""Real text for the fine-tuning example: read documents, split held-out ones, pack them with cu_seqlens.

A *document* is one fortune (fortune files separate entries by lines holding only ``%``) or, for any
other text file, the whole file. Packing concatenates tokenised documents into fixed-length sequences
of ``T`` tokens with no padding between documents; ``cu_seqlens`` marks where each document (or the
piece of one that a sequence boundary cut) starts, so attention, convolution and recurrence restart
there and no token sees another document. With ``doc_mode="concat"`` the documents are joined into one
text first, so every sequence is a single segment (the long-document regime).
"""
from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

import torch

DEFAULT_DATA = ("/usr/share/games/fortunes", "/usr/share/common-licenses")
_FORTUNE_SEP = re.compile(r"^%\s*$", re.MULTILINE)
IGNORE = -100  # label of tokens that predict nothing (last token of each document)


def _text_files(path: str) -> list[str]:
    """Regular text files under ``path`` (a file or a directory, recursively), symlinks resolved once."""
    if os.path.isfile(path):
        return [os.path.realpath(path)]
    if not os.path.isdir(path):
        raise ValueError(f"--data path {path!r} is neither a file nor a directory")
    found = []
    for root, _, names in os.walk(path):
        for name in sorted(names):
            if name.endswith(".dat"):        # strfile's binary index beside each fortune file
                continue
            found.append(os.path.realpath(os.path.join(root, name)))
    return found


def read_documents(paths: list[str] | None) -> tuple[list[str], list[str]]:
    """Documents from text files / directories.

    Args:
        paths: files or directories; None tries ``DEFAULT_DATA`` in order (fortunes, then licenses).

    Returns:
        ``(documents, sources)``: non-empty stripped strings, in a fixed order (sorted file paths,
        then order inside each file); ``sources`` are the files read. Binary files (NUL bytes or not
        UTF-8) are skipped.

    Raises:
        ValueError: a path does not exist, or no document was found.
    """
    if paths is None:
        paths = [next((p for p in DEFAULT_DATA if os.path.isdir(p)), DEFAULT_DATA[-1])]
    files = sorted({f for p in paths for f in _text_files(p)})
    docs, sources = [], []
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read()
        if b"\0" in raw:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        parts = _FORTUNE_SEP.split(text) if _FORTUNE_SEP.search(text) else [text]
        new = [p.strip() for p in parts if p.strip()]
        if new:
            docs.extend(new)
            sources.append(f)
    if not docs:
        raise ValueError(f"--data {paths} holds no readable text document")
    return docs, sources


def split_documents(docs: list[str], heldout_fraction: float = 0.05, seed: int = 1234) -> tuple[list[str], list[str]]:
    """Deterministic train / held-out split: a fixed shuffle (independent of ``--seed``), last fraction held out."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_held = max(1, int(len(docs) * heldout_fraction))
    if n_held >= len(docs):
        raise ValueError(f"need at least 2 documents to hold one out, got {len(docs)}")
    return [docs[i] for i in order[n_held:]], [docs[i] for i in order[:n_held]]


@dataclass
class PackedBatch:
    """One packed sequence.

    input_ids: ``[T]`` int64. labels: ``[T]`` int64, the next token inside the same document, else
    ``IGNORE``. position_ids: ``[T]`` int64, restarting at 0 at each document. cu_seqlens: ``[N + 1]``
    int32, ``cu[0] == 0``, ``cu[-1] == T``.
    """
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor


def make_batch(pieces: list[list[int]]) -> PackedBatch:
    """Pack token lists (one per document piece) back to back into one ``PackedBatch``."""
    lengths = [len(p) for p in pieces]
    ids = torch.tensor([t for p in pieces for t in p], dtype=torch.int64)
    labels = torch.full_like(ids, IGNORE)
    pos = torch.empty_like(ids)
    start = 0
    for n in lengths:
        labels[start:start + n - 1] = ids[start + 1:start + n]
        pos[start:start + n] = torch.arange(n)
        start += n
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return PackedBatch(ids, labels, pos, cu)


DOC_MODES = ("short", "concat")


def pack(token_docs: list[list[int]], seq_len: int, max_batches: int | None = None,
         doc_mode: str = "short") -> list[PackedBatch]:
    """Concatenate documents into sequences of exactly ``seq_len`` tokens (the tail that does not fill one is dropped).

    ``doc_mode="short"``: each document is its own segment (many per sequence for short texts such as
    fortunes). A document longer than what is left of a sequence continues at the start of the next one as a
    new segment (its positions restart). Zero-length documents are skipped.
    ``doc_mode="concat"``: the long-document regime. All documents are joined, in order (each keeps its
    end-of-text token from ``tokenize``), into one text that every sequence takes ``seq_len`` tokens of as
    ONE segment: ``cu_seqlens = [0, seq_len]``, positions 0 .. seq_len - 1, every token but the last labelled.
    """
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    if doc_mode not in DOC_MODES:
        raise ValueError(f"--doc-mode must be one of {DOC_MODES}, got {doc_mode!r}")
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ValueError(f"max_batches must be None or an int >= 1, got {max_batches!r}")
    if doc_mode == "concat":
        text = [t for doc in token_docs for t in doc]
        n = len(text) // seq_len if max_batches is None else min(len(text) // seq_len, max_batches)
        return [make_batch([text[i * seq_len:(i + 1) * seq_len]]) for i in range(n)]
    batches, pieces, room = [], [], seq_len
    for doc in token_docs:
        while doc:
            take, doc = doc[:room], doc[room:]
            pieces.append(take)
            room -= len(take)
            if room == 0:
                batches.append(make_batch(pieces))
                if max_batches is not None and len(batches) >= max_batches:
                    return batches
                pieces, room = [], seq_len
    return batches


def tokenize(docs: list[str], encode, eos_id: int | None, max_tokens: int | None = None) -> list[list[int]]:
    """Tokenise documents in order (``encode(list[str]) -> list[list[int]]``), appending ``eos_id`` to each.

    Stops once ``max_tokens`` tokens are collected, so a short run does not tokenise the whole corpus.
    """
    out, total, step = [], 0, 256
    for i in range(0, len(docs), step):
        for ids in encode(docs[i:i + step]):
            ids = list(ids) + ([eos_id] if eos_id is not None else [])
            out.append(ids)
            total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return out


def batch_for_step(batches: list[PackedBatch], step: int, replica: int, replicas: int, seed: int) -> PackedBatch:
    """The batch of data-parallel ``replica`` at optimizer ``step`` (0-based): a pure function of its
    arguments, so a resumed run sees exactly the batches the uninterrupted one would have.

    Each epoch over ``batches`` is a fresh permutation seeded by ``(seed, epoch)``.
    """
    i = step * replicas + replica
    epoch, j = divmod(i, len(batches))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return batches[int(torch.randperm(len(batches), generator=g)[j])]
