"""Tensor parallelism on torch.distributed: one model split over `tp_size` ranks, one
process each (gloo on CPU, NCCL on CUDA). Rank 0 holds the scheduler, the radix cache and
the slot allocator, and sends each step to the other ranks; every rank holds its shard of
the weights and of the KV pool, at the same slot indices."""
