"""Tensor parallelism across processes: rank 0 in the engine core, ranks 1..N-1 in workers.

- ``rendezvous``: where the ranks meet (a loopback store on one node; ``MASTER_ADDR``,
  ``MASTER_PORT``, ``NNODES``, ``NODE_RANK`` across nodes) and the process groups they form.
- ``step_wire``: the per-step broadcast (one small header tensor, one packed int64 tensor).
- ``sync``: start-up barriers through the store, so no rank waits in a collective for a rank
  that is still loading or has failed.
- ``launcher``: starts a node's ranks as fresh interpreters (``WorkerSpec``, the command,
  the process handles); imported by ``workers`` and ``worker``, importing neither.
- ``workers``: ``TPWorkers``, rank 0's handle on the others (start-up, per-step broadcast,
  liveness watchdog, shutdown).
- ``worker``: the worker process, ``python -m pagectl.engine.distributed.worker`` (one rank,
  or on other nodes all of that node's ranks); nothing imports it.

Only rank 0 schedules and samples; every rank runs the same forward on the same broadcast
batch, with the same block ids, over its own shard of the weights and KV heads.
"""
