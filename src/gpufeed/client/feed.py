"""``FeedClient``: channels to one or more gpufeed servers, and loaders over them."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import TRANSPORTS

from .connection import Connection
from .discovery import Servers
from .errors import FeedError
from .fields import Field, field_specs
from .loader import Loader
from .output import Output, choice

__all__ = ["FeedClient"]

_TRANSPORTS = {"auto": feed_pb2.TRANSPORT_AUTO, **TRANSPORTS}
_LABEL_SOURCES = {"list_file": feed_pb2.LABELS_FROM_LIST_FILE,
                  "folder": feed_pb2.LABELS_FROM_FOLDER}


def _prefix(prefix: str | os.PathLike) -> str:
    """A str prefix as it is; a path prefix is a directory (its separator added)."""
    if isinstance(prefix, str):
        return prefix
    return os.path.join(os.fspath(prefix), "")


def _sample_transforms(transforms: Sequence[str | tuple[str, dict]]
                       ) -> list[feed_pb2.SampleTransform]:
    """Names with JSON parameters: what a request may carry (the server checks them)."""
    specs = []
    for i, item in enumerate(transforms):
        name, params = (item, {}) if isinstance(item, str) else \
            tuple(item) if isinstance(item, (tuple, list)) and len(item) == 2 else (None, None)
        if not isinstance(name, str) or not isinstance(params, dict):
            raise ValueError(f"transforms[{i}] must be a name or (name, dict of parameters), "
                             f"got {item!r}")
        try:
            text = json.dumps(params, allow_nan=False, sort_keys=True,
                              default=_json_value) if params else ""
        except (TypeError, ValueError) as e:
            raise ValueError(f"transforms[{i}] {name!r}: parameters must be JSON values: "
                             f"{e}") from None
        specs.append(feed_pb2.SampleTransform(name=name, params_json=text))
    return specs


def _json_value(value: Any) -> Any:
    """What ``json`` does not know, as the JSON it stands for: numpy scalars and arrays
    (and tensors), by their ``tolist()``, as numbers and lists. What that gives is
    encoded as any value is: a NaN or infinity is still refused."""
    tolist = getattr(value, "tolist", None)
    if not callable(tolist):
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return tolist()


class FeedClient:
    """Connections to ``address`` ("host:port", or several). A context manager.

    An address may be a gRPC ``dns:`` target, ``dns:///name:port`` (or
    ``dns://DNS-SERVER/name:port``), which stands for every address the name
    resolves to, asked again at each new pass and when a server is lost: a
    Kubernetes headless Service's name is its ready pods (discovery.py).
    With several servers, a loader hands each the pass's batches as fast as it
    makes them, and a lost server's batches to the others (dealing.py).
    ``credentials`` (e.g. ``grpc.ssl_channel_credentials(ca_pem)``) makes the
    channels TLS; ``token`` is sent as ``authorization: Bearer
    <token>`` on every call. A server that has not answered within
    ``connect_timeout`` seconds of the first call to it is an error (UNAVAILABLE,
    naming its address).
    """

    def __init__(self, address: str | Sequence[str], *, connect_timeout: float = 5.0,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None):
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise ValueError("FeedClient needs at least one server address")
        self._servers = Servers(addresses, lambda a, authority: Connection(
            a, connect_timeout=connect_timeout, credentials=credentials, token=token,
            authority=authority))
        self.address = ",".join(addresses)

    @property
    def servers(self) -> list[Connection]:
        """The servers up now (``dns:`` targets resolved again)."""
        return self._servers.current()

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._servers.close()

    def info(self) -> feed_pb2.InfoResponse:
        """The first server's Info."""
        return self.servers[0].info()

    def loader(self, files: Sequence[str | os.PathLike] | str | os.PathLike, *,
               batch_size: int, output: Output | None = None,
               prefix: str | os.PathLike = "", labels: Sequence[int] | str | None = None,
               classes: Sequence[str] | None = None,
               shuffle: bool = False, seed: int = 0, epoch: int = 0, rank: int = 0,
               world_size: int = 1, drop_last: bool = False,
               transport: str = "auto", prefetch: int = 0, copy: bool = False,
               compression: str = "", failure_budget: int | float = 0,
               reconnect_timeout: float = 30.0, job: str = "",
               fields: Mapping[str, Field | str] | Sequence[str] | None = None,
               transforms: Sequence[str | tuple[str, dict]] = (), names: bool = False,
               **output_fields: Any) -> Loader:
        """A loader: an iterable of batches, each pass one epoch of ``files``.

        The first stream is opened here: a refused request raises FeedError
        now, and ``loader.classes`` and ``len(loader)`` are known.

        Args:
            files: a list of paths, or the path of a list file on the server
                (``str`` or ``pathlib.Path`` alike). A directory
                (``files="train/"``, or one in the list) stands for the image,
                video or array files under it, recursively, in ImageFolder's
                order. Array files (.npy, .npz, .pt) give each key of the file
                as a tensor of that name ("array" for .npy).
            batch_size: samples per batch.
            output: what each sample becomes (``Output``: size, resize, crops,
                flips, dtype, normalisation, layout, video clips). Its fields
                may instead be given as keywords here (``size=(224, 224)``,
                ``resize=...``), as scripts written before ``Output`` do; not
                both.
            prefix: prepended to every file; a ``Path`` prefix is a directory
                (``prefix / name``), a ``str`` prefix is prepended as it is.
            labels: one int per file; "list_file" (the list file's lines are
                ``path<TAB>label``, or ``path label`` with the label the last
                word); or "folder" (each file's class folder is its class,
                numbered as ImageFolder does).
            classes: the folder labels' class names, in order; else the sorted
                subdirectories of the dataset directory (``loader.classes``).
            shuffle, seed: a new order each epoch, from (seed, epoch).
            epoch: the first pass's epoch; a pass goes on from where the last
                one stopped, and after an epoch's last batch the next pass is
                the next epoch, unless ``set_epoch`` or ``load_state_dict``
                chose one (loader.py).
            rank, world_size: this trainer's part of the data set; every rank
                gets as many batches (repeats marked in ``padded``).
            drop_last: leave out a last, short batch.
            transport: "auto" (the fastest the server offers this trainer),
                "inline", "shm" or "cuda_ipc".
            prefetch: batches the server may decode ahead (0: its default).
            copy: owned tensors always, instead of views of shared memory (shm,
                cuda_ipc) while the trainer holds fewer than ``prefetch`` of
                them, or read-only views of the received message (inline).
            compression: "zstd" or "lz4": compress inline batches losslessly
                (worth it for array samples, not for decoded pixels: docs/guide/transports.md).
            failure_budget: samples that may fail before the pass ends with
                DATA_LOSS: an int is a count, a float in (0, 1) a fraction of
                the pass, 0 the server's default (10 samples or 0.1%).
            reconnect_timeout: seconds to keep reconnecting after a server that
                has answered becomes unavailable (0: never); one that never
                answered fails within ``connect_timeout``.
            job: share one pass with every loader naming the same job (one
                server only; docs/guide/operations.md, "Shared jobs", says
                what that keeps and loses).
            fields: a sample's fields beside its image, each from a sidecar
                file: names (``["mask", "boxes", "meta"]``, default sidecars)
                or a dict of name to a ``Field`` or a suffix; each is a tensor
                of the batch (docs/guide/fields.md).
            transforms: sample transforms the server has (built in, or
                installed by its operator with ``--plugins``), run in order on
                each decoded image: names, or ``(name, {parameter: JSON
                value})`` pairs, e.g. ``[("color_jitter", {"brightness": 0.4}),
                "trivial_augment_wide"]``; numpy scalars and arrays are sent as
                numbers and lists.
            names: each batch also carries its samples' names (``names`` uint8
                and ``names_offsets``; ``gpufeed.client.names(batch)`` gives a
                list of str): a file's path relative to its data root,
                ``shard/key`` for a tar sample, an S3 object's ``s3://`` URL.
                Off by default, so that batches carry no more than asked for.
            **output_fields: ``Output``'s fields as flat keywords.

        Raises:
            ValueError: an option the client can check is out of range.
            TypeError: a keyword that is neither an argument nor an output field.
            FeedError: the server refused the request (its status and message).
        """
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        if job and len(self.servers) > 1:
            raise ValueError("a shared job lives on one server; give FeedClient one address")
        output = Output.from_keywords(output, output_fields)
        label_source = feed_pb2.LABELS_FROM_REQUEST
        if isinstance(labels, str):
            label_source, labels = choice("labels", labels, _LABEL_SOURCES), None
        request = feed_pb2.StreamRequest(
            prefix=_prefix(prefix), labels=[] if labels is None else [int(x) for x in labels],
            label_source=label_source, classes=list(classes or ()),
            batch_size=batch_size, output=output.spec(), clip=output.clip_spec(),
            drop_last=drop_last, shuffle=shuffle, seed=seed, epoch=epoch, rank=rank,
            world_size=world_size, transport=_TRANSPORTS[transport], prefetch=prefetch, job=job,
            compression=compression, fields=field_specs(fields),
            sample_transforms=_sample_transforms(transforms), names=names)
        if isinstance(failure_budget, float) and 0 < failure_budget < 1:
            request.max_failure_fraction = failure_budget
        elif isinstance(failure_budget, int) and failure_budget >= 0:
            request.max_failures = failure_budget
        else:
            raise ValueError(f"failure_budget must be a count (int >= 0) or a fraction in (0, 1), "
                             f"got {failure_budget!r}")
        if isinstance(files, (str, os.PathLike)):
            request.list_file = os.fspath(files)
        else:
            request.files.paths.extend(os.fspath(f) for f in files)
        try:
            return Loader(self._servers, request, copy=copy, reconnect_timeout=reconnect_timeout)
        except FeedError as e:
            raise _in_loader_terms(e) from None


def _in_loader_terms(error: FeedError) -> FeedError:
    """The server's refusal, naming the loader's argument where its field differs: a path
    given as ``files`` travels as the request's ``list_file``."""
    message = str(error).removeprefix(f"{error.code.name}: ")
    if message.startswith("list_file: "):
        return FeedError(error.code, "files (list_file): " + message.removeprefix("list_file: "))
    return error
