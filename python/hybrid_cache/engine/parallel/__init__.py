"""Tensor parallelism: one driver (rank 0: scheduler, Rust allocator, sampler) and N - 1
worker processes joined by torch.distributed, each holding its shard of the model and of the KV
cache. One job per file:

    process_group.py   the groups every rank joins (gloo / NCCL, timeouts, file:// or env://)
    step_inputs.py     a step's inputs as every rank needs them, packed as int32
    step_broadcast.py  rank 0 sends each step; the setup exchanges every rank takes part in
    worker.py          ranks 1..N-1: setup, then receive and run steps until told to stop
    executor.py        rank 0's side: spawn, setup, send, failure diagnosis, shutdown

Nothing is imported here, so `model_runner.py` can use `step_inputs` without a cycle.
"""
