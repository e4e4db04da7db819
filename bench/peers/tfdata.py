"""tf.data: in this process, and through the tf.data service to this process.

The map function reads a file, decodes it with ``tf.io.decode_jpeg`` and
resizes it with ``tf.image.resize`` (bilinear, TensorFlow's default), cast to
uint8 like gpufeed's output; ``num_parallel_calls`` is the core count, then
batch and prefetch. For the service row, a child process runs a dispatcher
and one worker (which does the decoding) and this process reads the batches
through ``tf.data.experimental.service.distribute``: the same split as
gpufeed's server and trainer.

``python -m bench.peers.tfdata serve`` is that child: it prints the
dispatcher's address and serves until its standard input closes.
"""

from __future__ import annotations

import os
import subprocess
import sys

from . import Unavailable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _tf():
    try:
        import tensorflow as tf
    except ImportError:
        raise Unavailable("tensorflow is not installed (pip install tensorflow-cpu)") from None
    return tf


def _dataset(tf, config):
    height, width = config.size

    def load(path):
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        return tf.cast(tf.image.resize(image, (height, width)), tf.uint8)

    return (tf.data.Dataset.from_tensor_slices(config.paths)
            .repeat(config.passes)
            .map(load, num_parallel_calls=config.threads)
            .batch(config.batch_size)
            .prefetch(tf.data.AUTOTUNE))


def run(config, meter, service: bool) -> str:
    if not service:
        tf = _tf()
        for batch in _dataset(tf, config).as_numpy_iterator():
            meter.batch(len(batch))
        meter.stop()
        return f"num_parallel_calls={config.threads}, in the trainer's process"
    # Start the service first: both processes import TensorFlow (seconds) at once.
    child = subprocess.Popen([sys.executable, "-m", "bench.peers.tfdata", "serve"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tf = _tf()
        target = child.stdout.readline().strip()
        if not target:
            raise RuntimeError("the tf.data service process did not start")
        dataset = _dataset(tf, config).apply(tf.data.experimental.service.distribute(
            processing_mode="parallel_epochs", service=target))
        for batch in dataset.as_numpy_iterator():
            meter.batch(len(batch))
        meter.stop()
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return f"dispatcher + 1 worker in another process, num_parallel_calls={config.threads}"


def _serve() -> None:
    tf = _tf()
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=0))
    address = dispatcher.target.split("://", 1)[1]
    worker = service.WorkerServer(service.WorkerConfig(dispatcher_address=address, port=0))
    print(dispatcher.target, flush=True)
    sys.stdin.read()  # until the trainer closes our stdin
    del worker, dispatcher


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve()
