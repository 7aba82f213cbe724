"""Shared builders for the kernel tests (CPU interpreter and CUDA): a shuffled paged KV pool
with poisoned unused slots, attention metadata, and the fp32 torch reference."""
import torch

from rollout.layers.attention import AttentionMetadata, paged_attention_ref


def make_paged(lens, Hkv, D, ps, dtype, seed, *, device="cpu", spare_pages=3):
    """Random page pool with shuffled page ids. Returns (clean caches, poisoned caches, block
    table): slots that hold no token are 0 in the clean copy (for the reference, which gathers
    whole pages) and NaN in the poisoned copy (for the kernel: reading one shows up as NaN)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-L // ps) for L in lens]
    num_pages = sum(need) + spare_pages
    max_pages = max(need + [1]) + 1                    # spare column: stale entries are never read
    perm = torch.randperm(num_pages, generator=g)
    bt = torch.randint(0, num_pages, (len(lens), max_pages), generator=g, dtype=torch.int32)
    used = torch.zeros(num_pages, ps, dtype=torch.bool)
    p = 0
    for i, (L, n) in enumerate(zip(lens, need)):
        bt[i, :n] = perm[p:p + n].int()
        used.view(-1)[(perm[p:p + n, None] * ps + torch.arange(ps)).view(-1)[:L]] = True
        p += n
    used = used.to(device)
    caches, poisoned = [], []
    for _ in range(2):
        c = torch.randn(num_pages, ps, Hkv, D, generator=g).to(device=device, dtype=dtype)
        c[~used] = 0
        caches.append(c)
        poisoned.append(c.masked_fill(~used[:, :, None, None], float("nan")))
    return caches, poisoned, bt.to(device)


def meta_for(lens, qlens, bt, ps):
    """Metadata on the block table's device for sequences of context `lens`, queries `qlens`."""
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(slot_mapping=None, block_tables=bt,
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=bt.device),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=bt.device),
                             seq_lens_host=list(lens), query_start_host=qsl, page_size=ps,
                             decode_only=all(b - a == 1 for a, b in zip(qsl, qsl[1:])))


def reference(q, caches, meta, scale, window):
    """fp32 reference; rows of empty sequences (softmax over nothing: NaN there) set to 0,
    the kernels' defined output for CUDA-graph padding rows."""
    ref = paged_attention_ref(q.float(), caches[0].float(), caches[1].float(), meta, scale, window)
    for i, L in enumerate(meta.seq_lens_host):
        if L == 0:
            ref[meta.query_start_host[i]:meta.query_start_host[i + 1]] = 0
    return ref
