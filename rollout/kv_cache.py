"""Paged KV cache bookkeeping (CPU side): a page allocator with refcounts, per-sequence
block tables, prompt sharing across a GRPO group, and copy-on-write of a shared
partial page. The device tensors live in the model runner; this module only decides
which physical page each token goes to.
"""
from __future__ import annotations

from collections import deque

from .request import Sequence

TRASH_PAGE = 0  # never handed out: padding tokens write here, padding rows read it


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self._free = deque(range(1, num_pages))
        self.total_allocations = 0    # pages ever handed out (tests assert prompt sharing on it)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("out of KV pages (the scheduler should have checked)")
        page = self._free.popleft()
        assert self.refcount[page] == 0, f"page {page} handed out while in use"
        self.refcount[page] = 1
        self.total_allocations += 1
        return page

    def incref(self, page: int) -> None:
        assert self.refcount[page] > 0, f"incref of free page {page}"
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        assert self.refcount[page] > 0, f"double free of page {page}"
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)


class KVCacheManager:
    """Maps sequences to pages. All methods are host-only and O(pages touched)."""

    def __init__(self, num_pages: int, page_size: int):
        self.alloc = PageAllocator(num_pages, page_size)
        self.page_size = page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _needs_cow(self, seq: Sequence) -> bool:
        """The next write lands on a page shared with another sequence."""
        pos = seq.num_computed
        idx = pos // self.page_size
        return pos % self.page_size != 0 and idx < len(seq.block_table) \
            and self.alloc.refcount[seq.block_table[idx]] > 1

    def pages_needed(self, seq: Sequence, num_new: int) -> int:
        extra = self.pages_for(seq.num_computed + num_new) - len(seq.block_table)
        return max(extra, 0) + (1 if self._needs_cow(seq) else 0)

    def fits_in_place(self, seq: Sequence, num_new: int) -> bool:
        """The tokens land in pages the sequence already owns alone (most decode steps):
        `append` would do nothing."""
        return seq.num_computed + num_new <= len(seq.block_table) * self.page_size and not self._needs_cow(seq)

    def can_append(self, seq: Sequence, num_new: int, reserve: int = 0) -> bool:
        return self.pages_needed(seq, num_new) + reserve <= self.alloc.num_free

    def append(self, seq: Sequence, num_new: int, copies: list[tuple[int, int]]) -> None:
        """Make room for tokens [num_computed, num_computed + num_new). A shared partial
        page is copied first (copy-on-write); the copy is queued in `copies` (src, dst)
        and runs on the device before the step's forward."""
        if self._needs_cow(seq):
            idx = seq.num_computed // self.page_size
            old = seq.block_table[idx]
            new = self.alloc.allocate()
            copies.append((old, new))
            seq.block_table[idx] = new
            self.alloc.decref(old)
            seq.table_version += 1
        while len(seq.block_table) < self.pages_for(seq.num_computed + num_new):
            seq.block_table.append(self.alloc.allocate())
            seq.table_version += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's pages (full and partial)."""
        child.block_table = list(parent.block_table)
        child.table_version += 1
        for p in child.block_table:
            self.alloc.incref(p)

    def free(self, seq: Sequence) -> None:
        for p in seq.block_table:
            self.alloc.decref(p)
        seq.block_table = []
        seq.table_version += 1

    def swap_out(self, seq: Sequence, host: PageAllocator, moves: list[tuple[int, int]]) -> None:
        """Give the sequence's device pages up for host pages: (device page, host page) pairs are
        queued in `moves` (copied before the next step's forward, after the step in flight)."""
        host_pages = [host.allocate() for _ in seq.block_table]
        moves.extend(zip(seq.block_table, host_pages))
        self.free(seq)
        seq.host_table = host_pages

    def swap_in(self, seq: Sequence, host: PageAllocator, moves: list[tuple[int, int]]) -> None:
        """Fresh device pages for a swapped-out sequence; (host page, device page) pairs into `moves`."""
        pages = [self.alloc.allocate() for _ in seq.host_table]
        moves.extend(zip(seq.host_table, pages))
        self.drop_swapped(seq, host)
        seq.block_table = pages
        seq.table_version += 1

    @staticmethod
    def drop_swapped(seq: Sequence, host: PageAllocator) -> None:
        """Free the host pages of a swapped-out sequence."""
        for h in seq.host_table:
            host.decref(h)
        seq.host_table = []
