"""Page allocator and block-table bookkeeping: refcounts, fork, copy-on-write, free."""
import pytest

from rollout.kv_cache import TRASH_PAGE, KVCacheManager, PageAllocator
from rollout.request import Request, SamplingParams


def _seq(n_prompt: int, n: int = 1):
    return Request(0, list(range(1, n_prompt + 1)), SamplingParams(n=n), seed=0).seqs[0]


def test_allocator_never_hands_out_trash_page_and_counts():
    a = PageAllocator(5, 4)
    pages = [a.allocate() for _ in range(4)]
    assert TRASH_PAGE not in pages and sorted(pages) == [1, 2, 3, 4]
    assert a.num_free == 0 and a.total_allocations == 4
    with pytest.raises(RuntimeError):
        a.allocate()
    a.incref(pages[0])
    a.decref(pages[0])
    assert a.num_free == 0          # still referenced once
    a.decref(pages[0])
    assert a.num_free == 1
    with pytest.raises(AssertionError):
        a.decref(pages[0])          # double free is caught


def test_append_allocates_only_needed_pages():
    kv = KVCacheManager(10, 4)
    s = _seq(6)
    copies = []
    assert kv.pages_needed(s, 6) == 2
    kv.append(s, 6, copies)
    assert len(s.block_table) == 2 and not copies
    s.num_computed = 6
    assert kv.pages_needed(s, 2) == 0   # positions 6, 7 fit in page 2
    kv.append(s, 2, copies)
    s.num_computed = 8
    assert kv.pages_needed(s, 1) == 1


def test_fork_shares_pages_and_copy_on_write_partial_page():
    kv = KVCacheManager(10, 4)
    parent = _seq(6, n=3)
    kv.append(parent, 6, [])
    parent.num_computed = 6
    children = [_seq(6) for _ in range(2)]
    for c in children:
        c.num_computed = 6
        kv.fork(parent, c)
    full, partial = parent.block_table
    assert kv.alloc.refcount[full] == 3 and kv.alloc.refcount[partial] == 3
    assert kv.alloc.total_allocations == 2      # the prompt's pages exist once
    # First writer of the shared partial page gets a private copy.
    copies = []
    assert kv.pages_needed(children[0], 1) == 1
    kv.append(children[0], 1, copies)
    assert copies == [(partial, children[0].block_table[1])]
    assert kv.alloc.refcount[partial] == 2 and children[0].block_table[0] == full
    kv.append(children[1], 1, copies)
    assert len(copies) == 2
    # The last holder writes in place: no copy.
    assert kv.pages_needed(parent, 1) == 0
    kv.append(parent, 1, copies)
    assert len(copies) == 2 and parent.block_table[1] == partial
    for s in [parent, *children]:
        kv.free(s)
    assert kv.alloc.num_free == kv.alloc.num_usable
    assert all(r == 0 for r in kv.alloc.refcount)


def test_full_pages_are_never_copied():
    kv = KVCacheManager(10, 4)
    parent = _seq(8, n=2)
    kv.append(parent, 8, [])
    parent.num_computed = 8
    child = _seq(8)
    child.num_computed = 8
    kv.fork(parent, child)
    copies = []
    kv.append(child, 1, copies)      # position 8 starts a new page
    assert copies == [] and len(child.block_table) == 3


def test_builder_rewrites_a_block_table_row_when_its_pages_change():
    """The batch builder skips rows whose (sequence, table_version) it already wrote; a
    copy-on-write swaps a page without changing the table's length, and must still show."""
    from rollout.batch import BatchBuilder
    from rollout.scheduler import ScheduledSeq, SchedulerOutput
    kv = KVCacheManager(16, 4)
    parent = _seq(6, n=2)
    kv.append(parent, 6, [])
    parent.num_computed = 6
    child = Request(1, list(range(1, 7)), SamplingParams(), seed=0).seqs[0]
    kv.fork(parent, child)
    b = BatchBuilder(kv, max_num_batched_tokens=8, max_num_seqs=4, max_pages_per_seq=4)

    def build(seq):
        b.build(SchedulerOutput(items=[ScheduledSeq(seq, 1, 0, seq.num_computed)]))
        return b.host["block_tables"][0, :len(seq.block_table)].tolist()

    parent.token_ids.append(9)
    assert build(parent) == parent.block_table
    before = list(parent.block_table)
    copies = []
    kv.append(parent, 1, copies)          # the shared partial page is copied on write
    assert copies and parent.block_table != before and len(parent.block_table) == len(before)
    assert build(parent) == parent.block_table
    child.token_ids.append(9)
    assert build(child) == child.block_table == before   # another sequence in the same row
