"""Memory: the slot rings batches are written into, and the memories behind them.

The server heap (inline), POSIX shared memory (shm) and CUDA device memory
(cuda_ipc), and the server-wide budget every stream's ring reserves from. These
are the only modules of the server that name a transport's memory.
"""
