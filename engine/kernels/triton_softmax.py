"""The loop both Triton attention kernels share: a tile of query rows attends to a range of keys read through
a sequence's block table, with the online softmax (one pass; the running maximum rescales what came before).

Per query row it keeps ``best`` (the largest logit so far), ``total`` (the sum of ``2 ** (logit - best)``) and
``acc`` (the values weighted alike), and returns the three unnormalised: the output is ``acc / total``, the
row's log-sum-exp ``best + log2(total)`` (base 2: the callers fold ``log2(e)`` into the scale). Called from
a kernel, it is inlined there, so each kernel compiles as if the loop were written in it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_online_softmax(
    query,
    table,
    head_base,
    lo,
    hi,
    query_pos,
    scale_log2,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_slot,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """``(acc, best, total)`` of ``query`` (``[ROWS, BLOCK_D]``, the cache's dtype) over keys ``[lo, hi)``.

    ``table`` points at the sequence's block table, ``head_base`` at its KV head's keys in the cache (the
    values are ``cache_stride_kv`` further). With ``CAUSAL``, row ``r`` sees only keys at positions
    ``<= query_pos[r]``; every row must see at least one key, or its ``total`` is 0.
    """
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offsets = block * cache_stride_block + (pos % BLOCK_SIZE) * cache_stride_slot
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        key = tl.load(head_base + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(query, tl.trans(key), input_precision="ieee") * scale_log2
        if CAUSAL:
            visible = key_ok[None, :] & (pos[None, :] <= query_pos[:, None])
        else:
            visible = key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        probs = tl.math.exp2(scores - new_best[:, None])
        rescale = tl.math.exp2(best - new_best)
        total = total * rescale + tl.sum(probs, 1)
        value = tl.load(
            head_base + cache_stride_kv + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0
        )
        acc = acc * rescale[:, None] + tl.dot(probs.to(value.dtype), value, input_precision="ieee")
        best = new_best
    return acc, best, total
