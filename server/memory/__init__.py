"""Memory: the slot rings batches are written into, and the memories behind them.

One ``SlotMemory`` protocol (slots.py) with a backend per transport: the server
heap (inline, heap.py), POSIX shared memory (shm.py) and CUDA device memory
(cuda_ipc.py), picked in memories.py; and the server-wide budget every stream's
ring reserves from. These are the only modules of the server that name a
transport's memory.
"""
