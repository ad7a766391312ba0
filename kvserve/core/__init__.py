"""Pure-Python bookkeeping: block math, the block pool, prefix hashing, the KV cache manager and
the scheduler. Nothing here imports torch, so these tests run in milliseconds."""
