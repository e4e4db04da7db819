"""tf.data: in this process, and through the tf.data service to this process.

Each job is written the way TensorFlow's own ImageNet input pipelines write it,
one map function per image, ``num_parallel_calls`` = the core count, then
batch and prefetch:

- squash: ``read_file -> decode_jpeg -> image.resize`` (bilinear, TensorFlow's
  default, no antialiasing) -> uint8.
- training: ``extract_jpeg_shape -> sample_distorted_bounding_box`` (area and
  aspect ranges of ``bench.jobs``, 10 attempts, else the whole image) ->
  ``decode_and_crop_jpeg``, which decodes only the crop's scanlines ->
  ``image.resize`` -> ``random_flip_left_right`` -> uint8, or float16
  normalised.
- evaluation: ``decode_and_crop_jpeg`` of the centre box that a shorter side
  of 256 and a centre 224 keep (``bench.jobs.centre_box``) -> ``image.resize``.

Batches come out NHWC, TensorFlow's layout. For the service row (squash), a
child process runs a dispatcher and one worker (which does the decoding) and
this process reads the batches through
``tf.data.experimental.service.distribute``: the same split as gpufeed's
server and trainer.

``python -m bench.peers.tfdata serve`` is that child: it prints the
dispatcher's address and serves until its standard input closes.
"""

from __future__ import annotations

import os
import subprocess
import sys

from .. import jobs
from . import Unavailable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _tf():
    try:
        import tensorflow as tf
    except ImportError:
        raise Unavailable("tensorflow is not installed (pip install tensorflow-cpu)") from None
    return tf


def _load(tf, job: str, size: tuple[int, int], read=None):
    """The map function: a file's path (or what ``read`` reads) -> one image of the job's
    output."""
    read = read or tf.io.read_file
    height, width = size
    out_dtype = tf.float16 if job == "train-f16" else tf.uint8
    whole = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, shape=[1, 1, 4])
    mean = tf.constant(jobs.MEAN, tf.float32) * 255
    std = tf.constant(jobs.STD, tf.float32) * 255

    def squash(data):
        return tf.io.decode_jpeg(data, channels=3)

    def random_crop(data):
        begin, crop, _ = tf.image.sample_distorted_bounding_box(
            tf.io.extract_jpeg_shape(data), bounding_boxes=whole, min_object_covered=0.0,
            aspect_ratio_range=jobs.RATIO, area_range=jobs.SCALE, max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        window = tf.stack([begin[0], begin[1], crop[0], crop[1]])
        return tf.image.decode_and_crop_jpeg(data, window, channels=3)

    def centre_crop(data):
        shape = tf.cast(tf.io.extract_jpeg_shape(data), tf.float32)
        short = tf.minimum(shape[0], shape[1]) / jobs.shorter_side(size)
        box_height = tf.cast(tf.round(height * short), tf.int32)
        box_width = tf.cast(tf.round(width * short), tf.int32)
        image_height, image_width = tf.cast(shape[0], tf.int32), tf.cast(shape[1], tf.int32)
        window = tf.stack([(image_height - box_height) // 2, (image_width - box_width) // 2,
                           box_height, box_width])
        return tf.image.decode_and_crop_jpeg(data, window, channels=3)

    decode = {"squash": squash, "eval": centre_crop}.get(job, random_crop)

    def load(path):
        image = tf.image.resize(decode(read(path)), (height, width))
        if job.startswith("train"):
            image = tf.image.random_flip_left_right(image)
        if out_dtype == tf.float16:
            return tf.cast((image - mean) / std, tf.float16)
        return tf.cast(image, tf.uint8)

    return load


def _dataset(tf, config, job: str):
    return (tf.data.Dataset.from_tensor_slices(config.paths)
            .repeat(config.passes)
            .map(_load(tf, job, tuple(config.size)), num_parallel_calls=config.threads)
            .batch(config.batch_size)
            .prefetch(tf.data.AUTOTUNE))


def run(config, meter, job: str, service: bool = False, *, prefix: list[str] = (),
        host: str = "") -> str:
    """``prefix`` runs the service's process elsewhere (``ip netns exec NS``), where it
    serves on ``host`` (bench/peers/remote.py); by default it serves on localhost."""
    if not service:
        tf = _tf()
        _read(_dataset(tf, config, job), meter, config, job)
        return f"num_parallel_calls={config.threads}, in the trainer's process, NHWC"
    # Start the service first: both processes import TensorFlow (seconds) at once.
    child = subprocess.Popen([*prefix, sys.executable, "-m", "bench.peers.tfdata", "serve",
                              *([host] if host else [])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tf = _tf()
        target = child.stdout.readline().strip()
        if not target:
            raise RuntimeError("the tf.data service process did not start")
        dataset = _dataset(tf, config, job).apply(tf.data.experimental.service.distribute(
            processing_mode="parallel_epochs", service=target))
        _read(dataset, meter, config, job)
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return f"dispatcher + 1 worker in another process, num_parallel_calls={config.threads}"


def run_shards(config, meter, job: str, where: str) -> str:
    """tf.data on the tar shards gpufeed's shard rows read: "local", or "s3" (SeaweedFS).

    TensorFlow reads no tar files and has no S3 file system of its own any more
    (it moved to tensorflow-io, not installed here), so each shard's members come
    from a generator (Python's ``tarfile`` over the file, or over one streamed
    boto3 GET), two shards at a time through ``interleave``; decoding and resizing
    are the squash row's map function on the bytes, ``num_parallel_calls`` = the
    core count. The generator runs under Python's GIL: that is the cost of tar
    in tf.data without TFRecord files.
    """
    from .shards import BUCKET, pack, seaweed_shards

    tf = _tf()
    if where == "local":
        folder, shards = pack(config)
        _read(_shard_dataset(tf, config, job, [str(folder / n) for n in shards],
                             lambda path: open(path, "rb")),
              meter, config, job)
        return f"{len(shards)} shards on the local disk; tarfile generator, NHWC"
    with seaweed_shards(config) as (s3, shards):
        def open_object(url: str):
            bucket, key = url.removeprefix("s3://").split("/", 1)
            return s3.client().get_object(Bucket=bucket, Key=key)["Body"]

        urls = [f"s3://{BUCKET}/shards/{name}" for name in shards]
        _read(_shard_dataset(tf, config, job, urls, open_object), meter, config, job)
    return (f"{len(shards)} shards in SeaweedFS on loopback, one streamed GET each (boto3); "
            f"tarfile generator, NHWC")


def _shard_dataset(tf, config, job: str, shards: list[str], open_shard):
    import tarfile

    def members(shard):
        """A shard's JPEGs, in order (labels are not what the row measures)."""
        with open_shard(shard.decode()) as stream, tarfile.open(fileobj=stream,
                                                                 mode="r|") as tar:
            for member in tar:
                if member.name.endswith(".jpg"):
                    yield tar.extractfile(member).read()

    def shard_members(shard):
        return tf.data.Dataset.from_generator(
            members, args=(shard,), output_signature=tf.TensorSpec((), tf.string))

    return (tf.data.Dataset.from_tensor_slices(shards)
            .repeat(config.passes)
            .interleave(shard_members, cycle_length=2, num_parallel_calls=2)
            .map(_load(tf, job, tuple(config.size), read=lambda data: data),
                 num_parallel_calls=config.threads)
            .batch(config.batch_size)
            .prefetch(tf.data.AUTOTUNE))


def _read(dataset, meter, config, job: str) -> None:
    for batch in dataset.as_numpy_iterator():
        if meter.images == 0:
            jobs.check_batch(batch.shape, batch.dtype, tuple(config.size), job)
        meter.batch(len(batch))
    meter.stop()


def _serve(host: str = "") -> None:
    tf = _tf()
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=0))
    address = dispatcher.target.split("://", 1)[1]
    if host:  # trainers reach the dispatcher, then the worker, at this address
        address = f"{host}:{address.rsplit(':', 1)[1]}"
    worker = service.WorkerServer(service.WorkerConfig(
        dispatcher_address=address, port=0,
        **({"worker_address": f"{host}:%port%"} if host else {})))
    print(f"grpc://{address}", flush=True)
    sys.stdin.read()  # until the trainer closes our stdin
    del worker, dispatcher


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve(*sys.argv[2:3])
