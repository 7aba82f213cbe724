"""Paged KV cache bookkeeping (CPU side): a page allocator with refcounts, per-sequence
block tables, prompt sharing across a GRPO group, copy-on-write of a shared partial
page, and automatic prefix caching. The device tensors live in the model runner; this
module only decides which physical page each token goes to.

Prefix cache: a full page whose tokens are known and whose KV is computed (scheduled by
an earlier step: the device runs steps in order) is entered under the key (id of the
entry of the page before it, its token ids); the first page's "parent" is a root per
weights version. Walking a new sequence's pages from the root finds its longest cached
prefix. The dict compares whole keys, tokens included, so a hash collision is never a
hit; entry ids are never reused, so a key names one exact prefix. KV computed by older
weights sits under an older root, out of reach of sequences started under newer ones
(a stale_kv="keep" sequence goes on filling pages under its own old root). A cached page
no sequence holds stays, counted as free, until an allocation finds no empty page: then
the least recently released one is evicted.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque

from .request import PLACEHOLDER, Sequence

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
        self.cached: dict[tuple, tuple[int, int]] = {}   # (parent entry id, token ids) -> (page, entry id)
        self.key_of: dict[int, tuple] = {}               # cached page -> its key
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached pages nobody holds, LRU first
        self.entry_ids = itertools.count()   # ids of cache entries, never reused
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: empty ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages holding a prefix-cache entry, referenced or not."""
        return len(self.key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        """Pages some sequence holds (cached pages nobody holds are not used: see num_cached)."""
        return self.num_usable - self.num_free

    def allocate(self) -> int:
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self.cached[self.key_of.pop(page)]
            self.num_evictions += 1
        else:
            raise RuntimeError("out of KV pages (the scheduler should have checked)")
        assert self.refcount[page] == 0, f"page {page} handed out while in use"
        self.refcount[page] = 1
        self.total_allocations += 1
        return page

    def incref(self, page: int) -> None:
        assert self.refcount[page] > 0, f"incref of free page {page}"
        self.refcount[page] += 1

    def acquire(self, page: int) -> None:
        """A reference to a page found in the prefix cache (no longer evictable)."""
        if self.refcount[page] == 0:
            del self._evictable[page]
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        assert self.refcount[page] > 0, f"double free of page {page}"
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.key_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def clear_cache(self) -> None:
        """Forget every entry (after a failed step, whose KV writes are unknown)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self.cached.clear()
        self.key_of.clear()


class KVCacheManager:
    """Maps sequences to pages. All methods are host-only and O(pages touched)."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False):
        self.alloc = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.weights_version = 0   # the engine's policy_version: sequences started now chain from its root

    def reuse_prefix(self, seq: Sequence) -> None:
        """A sequence starting from scratch (no KV) takes the cached pages of its longest cached
        prefix (num_computed moves past them) and starts its chain. At least its last token is
        computed, for the logits: a fully cached prompt recomputes its last page (as vLLM does),
        so no cached page is ever written."""
        if not self.prefix_caching:
            return
        a, ps, parent, n = self.alloc, self.page_size, -1 - self.weights_version, 0
        # A cached position ran no forward here, so it has no routed experts to return: compute them all.
        while n < (seq.num_tokens - 1) // ps and not seq.request.params.return_routed_experts:
            hit = a.cached.get((parent, tuple(seq.token_ids[n * ps:(n + 1) * ps])))
            if hit is None:
                break
            page, parent = hit
            a.acquire(page)
            seq.block_table.append(page)
            n += 1
        seq.prefix_pages, seq.prefix_key = n, parent
        seq.num_computed = n * ps
        seq.table_version += 1

    def cache_full_pages(self, seq: Sequence) -> None:
        """Enter the sequence's full pages with computed (scheduled) KV and known tokens into the
        cache, going on along its chain. A page already cached (shared with a group sibling that
        entered it) or a key already cached (a twin page computed beside it) is followed instead."""
        ps, a, tokens = self.page_size, self.alloc, seq.token_ids
        i, parent = seq.prefix_pages, seq.prefix_key
        end = min(seq.num_computed, seq.num_tokens) // ps
        # Placeholders (tokens still in flight) are only ever at the tail: a known last token means a known page.
        while i < end and tokens[(i + 1) * ps - 1] != PLACEHOLDER:
            page = seq.block_table[i]
            key = a.key_of.get(page) or (parent, tuple(tokens[i * ps:(i + 1) * ps]))
            entry = (page, next(a.entry_ids))
            held = a.cached.setdefault(key, entry)    # one hash of the key, hit or not
            if held is entry:
                a.key_of[page] = key
            parent = held[1]
            i += 1
        seq.prefix_pages, seq.prefix_key = i, parent

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
        and runs on the device before the step's forward. Pages filled by earlier steps
        enter the prefix cache first (here, so a decode step inside its last page costs nothing)."""
        if seq.num_computed >= (seq.prefix_pages + 1) * self.page_size:
            self.cache_full_pages(seq)
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
        child.prefix_pages, child.prefix_key = parent.prefix_pages, parent.prefix_key
        for p in child.block_table:
            self.alloc.incref(p)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's pages; its full computed ones stay cached, the last page first
        in line for eviction (a prefix outlives its extensions)."""
        self.cache_full_pages(seq)
        for p in reversed(seq.block_table):
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
