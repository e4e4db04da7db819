"""Memory: the slot rings batches are written into, and the memories behind them.

One ``SlotMemory`` protocol (slots.py) with a backend per transport: the server
heap (inline, heap.py), POSIX shared memory (shm.py) and CUDA device memory
(cuda_ipc.py), picked in memories.py; and the server-wide budget every stream's
ring reserves from. These are the only modules of the server that name a
transport's memory. A memory reads a stream's plan through the ``SlotPlan``
protocol (slots.py), so memory imports nothing of serving.

- ``ring``: the slot ring, and a batch's layout in a slot.
- ``slots``: the ``SlotMemory`` and ``SlotPlan`` protocols, and what the backends share.
- ``memories``: which backend a stream's slots get.
- ``heap``, ``shm``, ``cuda_ipc``: one backend each.
- ``budget``: what all open streams' rings and plans may hold together.
"""
