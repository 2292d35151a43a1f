"""A small but real serving engine for SSM mixers: state pool, scheduler, step metadata, prefix cache.

Typical loop (the model runner drives it)::

    pool = StatePool(spec, num_layers, num_slots, dtype=torch.float32, layout="page_major")
    cache = PrefixCache(mode="all", block_size=16, capacity=64)
    sched = Scheduler(pool, token_budget=32, max_model_len=512, prefix_cache=cache)
    sched.add(Request("a", prompt, max_new_tokens=8))
    while (batch := sched.schedule()) is not None:
        md = build_metadata(batch, mode=cache.mode, block_size=cache.block_size, chunk_size=64)
        # per layer: conv0, rec0 = pool.gather(layer, md.state_indices); zero the rows where
        #   md.has_initial_states is False; run the ops with cu_seqlens=md.query_start_loc (prefills)
        #   and the decode path; pool.scatter(layer, md.state_indices, conv, rec)
        # snapshots: for request i, each (pos, tok_idx) in zip(md.snapshot_positions[i],
        #   md.snapshot_token_indices[i]) -> cache.insert(sched.tokens(rid)[:pos], snapshot)
        #   (pos == entry.end: pool.snapshot(slot) after the step)
        sched.update(batch, {e.request_id: next_token for e in batch if e.sample})
"""
from .metadata import MambaMetadata, build_metadata, chunk_indices_offsets, request_chunks
from .pool import PAD_SLOT_ID, PoolExhausted, Snapshot, StatePool
from .prefix_cache import PrefixCache, block_hashes
from .scheduler import Batch, BatchEntry, Request, RequestState, Scheduler

__all__ = ["PAD_SLOT_ID", "PoolExhausted", "Snapshot", "StatePool", "Batch", "BatchEntry", "Request",
           "RequestState", "Scheduler", "MambaMetadata", "build_metadata", "chunk_indices_offsets",
           "request_chunks", "PrefixCache", "block_hashes"]
