"""A read-only walk of a store's records B-tree straight from `data.mdb`, checking every page header.

lmdb trusts its pages: stepping a cursor onto a zeroed or overwritten page fails an assertion and aborts
the process. Walking the tree here first finds such pages (and the keys they hide) with plain reads, so
scans can refuse or step around them. Layout: LMDB 0.9 on a 64-bit little-endian machine (lmdb.h, mdb.c).
"""

from __future__ import annotations

import os
import struct
from array import array
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO

PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper (overflow pages: u32 page count)
NODE_HEADER = struct.Struct("<HHHH")  # lo, hi, flags, key size
# magic, version, address, map size, free db, main db, last page, txn id
META = struct.Struct("<IIQQ48s48sQQ")
DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
MAGIC = 0xBEEFC0DE
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA, F_SUBDATA = 0x01, 0x02
P_INVALID = 2**64 - 1
_MAX_DEPTH = 64  # far beyond any real tree; a cycle of broken pointers must not recurse forever


@dataclass(frozen=True)
class BrokenPage:
    """A page that is not what its parent points at: every key in [low, high) is unreadable (None: open
    end), or, for a value's page, the record `low` alone (`high` equal to it)."""

    pgno: int
    low: bytes | None
    high: bytes | None
    reason: str

    def holds(self, key: bytes) -> bool:
        if self.low is not None and self.low == self.high:
            return key == self.low
        return (self.low is None or self.low <= key) and (self.high is None or key < self.high)

    @property
    def span(self) -> str:
        low = self.low.decode("utf-8", "replace") if self.low is not None else None
        if self.low is not None and self.low == self.high:
            return f"the value of {low!r}"
        high = self.high.decode("utf-8", "replace") if self.high is not None else None
        start = f"from {low!r}" if low is not None else "from the first record"
        end = f"to before {high!r}" if high is not None else "to the end"
        return f"the records {start} {end}"


@dataclass
class TreeWalk:
    """What a walk found: the intact keys in order and the broken pages; for each key, where its value
    lies in the file: `value_at[i]` bytes from the start, `value_size[i]` long (its overflow pages,
    header included), or 0 and 0 for a value kept in its leaf; with `locate`, also where each value's bytes
    themselves lie as (byte offset, length) in `where` (for `read_value`, which needs no lmdb and no map)."""

    keys: list[bytes] = field(default_factory=list)
    broken: list[BrokenPage] = field(default_factory=list)
    value_at: array = field(default_factory=lambda: array("q"))
    value_size: array = field(default_factory=lambda: array("q"))
    where: list[tuple[int, int]] = field(default_factory=list)
    leaf_at: array = field(default_factory=lambda: array("q"))  # the offset of the leaf holding each key
    page_size: int = 4096

    def spans(self, key: bytes) -> tuple[tuple[int, int], ...]:
        """The (offset, size) ranges of the file that reading `key` touches beyond the branch pages: its
        leaf and its overflow pages; none when the walk did not see it."""
        i = bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            leaf = (self.leaf_at[i], self.page_size)
            return (leaf, (self.value_at[i], self.value_size[i])) if self.value_size[i] else (leaf,)
        return ()

    def value_span(self, key: bytes) -> tuple[int, int]:
        """(offset, size) of `key`'s overflow pages in the file as walked: (0, 0) when its value is kept in
        its leaf, (-1, -1) when the walk did not see it."""
        i = bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            return self.value_at[i], self.value_size[i]
        return -1, -1


def walk_records(
    data: Path, db_name: bytes, txnid: int | None = None, values: bool = False, locate: bool = False
) -> TreeWalk:
    """Walk the named database `db_name` of `data` (a data.mdb) as of transaction `txnid` (default: the
    last committed), checking every branch and leaf page, and with `values` every value's first page;
    `locate` also records where each value lies (for `read_value`, which needs no lmdb and no map)."""
    with open(data, "rb") as f:
        pages = _Pages(f.fileno(), txnid, values)
        pages.locate = locate
        walk = TreeWalk(page_size=pages.psize)
        main = pages.main_root()
        root = pages.named_root(main, db_name, walk) if main != P_INVALID else None
        if root is not None and root != P_INVALID:
            pages.walk(root, None, None, walk, 0)
        return walk


def transactions(data: Path) -> list[int]:
    """The transaction ids of `data`'s two meta pages, newest first: the snapshots a walk can start from."""
    with open(data, "rb") as f:
        pages = _Pages(f.fileno(), None, False)
        return sorted({pages.txnids[0], pages.txnids[1]}, reverse=True)


def read_value(f: BinaryIO, where: tuple[int, int]) -> bytes:
    """The value a located walk found at `where` in the open data file `f`, with one plain read."""
    offset, size = where
    return os.pread(f.fileno(), size, offset)


class _Pages:
    def __init__(self, fd: int, txnid: int | None, values: bool) -> None:
        self.fd = fd
        self.values = values
        self.locate = False
        metas = [self._meta(0, 4096)]
        self.psize = metas[0][0]
        metas.append(self._meta(1, self.psize))
        self.txnids = [m[3] for m in metas]
        chosen = [m for m in metas if m[3] == txnid] or metas
        _, self.main, last_pg, _ = max(chosen, key=lambda m: m[3])
        # the file may be shorter than its meta page says: no page past its end is ever touched
        self.last_pg = min(last_pg, os.fstat(fd).st_size // self.psize - 1)

    def _meta(self, index: int, psize: int) -> tuple[int, bytes, int, int]:
        raw = os.pread(self.fd, PAGE_HEADER.size + META.size, index * psize)
        magic, _, _, _, free_db, main_db, last_pg, txnid = META.unpack_from(raw, PAGE_HEADER.size)
        if magic != MAGIC:
            raise ValueError(f"meta page {index} has no LMDB magic number")
        return DB.unpack(free_db)[0], main_db, last_pg, txnid

    def page(self, pgno: int, *kinds: int) -> tuple[bytes | None, str]:
        """The page's bytes (an overflow page's header only), or None and why it is not a sound page of
        one of `kinds`."""
        if pgno > self.last_pg:
            return None, f"points past the last page ({pgno} > {self.last_pg})"
        size = PAGE_HEADER.size if kinds == (P_OVERFLOW,) else self.psize
        raw = os.pread(self.fd, size, pgno * self.psize)
        if len(raw) < PAGE_HEADER.size:
            return None, "lies past the end of the file"
        number, _, flags, lower, upper = PAGE_HEADER.unpack_from(raw)
        if number != pgno:
            return None, f"holds page number {number}, not {pgno} (overwritten or zeroed)"
        kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW)
        if kind not in kinds:
            return None, f"has flags {flags:#x}, not a {' or '.join(_KIND[k] for k in kinds)} page"
        if kind != P_OVERFLOW and not PAGE_HEADER.size <= lower <= upper <= self.psize:
            return None, f"has a broken free-space range ({lower}..{upper})"
        return raw, ""

    def nodes(self, raw: bytes) -> Iterator[tuple[int, int, bytes, int]]:
        """(lo | hi << 16, flags, key, node offset) of each node; raises ValueError on a broken offset."""
        lower = PAGE_HEADER.unpack_from(raw)[3]
        count = (lower - PAGE_HEADER.size) // 2
        for ptr in struct.unpack_from(f"<{count}H", raw, PAGE_HEADER.size):
            if ptr + NODE_HEADER.size > len(raw):
                raise ValueError(f"a node offset {ptr} lies outside the page")
            lo, hi, flags, ksize = NODE_HEADER.unpack_from(raw, ptr)
            start = ptr + NODE_HEADER.size
            if start + ksize > len(raw):
                raise ValueError(f"a key of {ksize} bytes runs past the page")
            yield lo | hi << 16, flags, raw[start : start + ksize], start + ksize

    def main_root(self) -> int:
        return DB.unpack(self.main)[-1]

    def named_root(self, root: int, name: bytes, walk: TreeWalk) -> int | None:
        """The root page of a named database, from the main database's single leaf."""
        raw, why = self.page(root, P_LEAF)
        if raw is None:
            walk.broken.append(BrokenPage(root, None, None, f"the main database's root page {why}"))
            return None
        for _, flags, key, data in self.nodes(raw):
            if key == name and flags & F_SUBDATA:
                return DB.unpack_from(raw, data)[-1]
        return P_INVALID

    def walk(self, pgno: int, low: bytes | None, high: bytes | None, walk: TreeWalk, depth: int) -> None:
        if depth > _MAX_DEPTH:
            walk.broken.append(BrokenPage(pgno, low, high, "the tree is deeper than any sound one (a cycle)"))
            return
        raw, why = self.page(pgno, P_BRANCH, P_LEAF)
        if raw is None:
            walk.broken.append(BrokenPage(pgno, low, high, f"page {pgno} {why}"))
            return
        if PAGE_HEADER.unpack_from(raw)[2] & P_LEAF:
            self._leaf(pgno, raw, low, high, walk)
            return
        try:
            children = [(key, size | flags << 32) for size, flags, key, _ in self.nodes(raw)]
        except ValueError as exc:
            walk.broken.append(BrokenPage(pgno, low, high, f"branch page {pgno}: {exc}"))
            return
        for i, (key, child) in enumerate(children):
            child_low = low if i == 0 else key
            child_high = children[i + 1][0] if i + 1 < len(children) else high
            self.walk(child, child_low, child_high, walk, depth + 1)

    def _leaf(self, pgno: int, raw: bytes, low: bytes | None, high: bytes | None, walk: TreeWalk) -> None:
        try:
            nodes = list(self.nodes(raw))
        except ValueError as exc:
            walk.broken.append(BrokenPage(pgno, low, high, f"leaf page {pgno}: {exc}"))
            return
        keys = [key for _, _, key, _ in nodes]
        in_order = all(a < b for a, b in pairwise(keys))
        if keys and (
            not in_order or (low is not None and keys[0] < low) or (high is not None and keys[-1] >= high)
        ):
            # lmdb would route lookups of these keys elsewhere: they cannot be found
            walk.broken.append(BrokenPage(pgno, low, high, f"leaf page {pgno} holds keys out of order"))
            return
        for size, flags, key, data in nodes:
            if data + (8 if flags & F_BIGDATA else size) > len(raw):
                reason = f"leaf page {pgno}: a value runs past the page"
                walk.broken.append(BrokenPage(pgno, key, key, reason))
                continue
            at = span = 0
            if flags & F_BIGDATA:
                (first,) = struct.unpack_from("<Q", raw, data)
                pages = -(-(size + PAGE_HEADER.size) // self.psize)
                # arithmetic only, so every walk does it: lmdb copies a value without checking its pages,
                # and a page past the end of the file kills the reader with SIGBUS
                if not 2 <= first <= first + pages - 1 <= self.last_pg:
                    why = f"runs outside the file's pages ({first}+{pages}, last page {self.last_pg})"
                    walk.broken.append(BrokenPage(first, key, key, f"value page {first} {why}"))
                    continue
                page, why = self.page(first, P_OVERFLOW) if self.values else (b"", "")
                if page is None:
                    walk.broken.append(BrokenPage(first, key, key, f"value page {first} {why}"))
                    continue
                if self.locate:
                    walk.where.append((first * self.psize + PAGE_HEADER.size, size))
                at, span = first * self.psize, pages * self.psize
            elif self.locate:
                walk.where.append((pgno * self.psize + data, size))
            walk.keys.append(key)
            walk.value_at.append(at)
            walk.value_size.append(span)
            walk.leaf_at.append(pgno * self.psize)


_KIND = {P_BRANCH: "branch", P_LEAF: "leaf", P_OVERFLOW: "value (overflow)"}
