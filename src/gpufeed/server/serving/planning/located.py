"""The samples a request names: the names, located under the data roots, listed, labelled.

The only planning that reads storage: the list file (at most
``--max-list-bytes``, and at most ``--max-samples`` of its lines are worked
on: listfile.py), directories named as samples (folders.py), tar shards
(indexed once per version: storage/shards.py) and folder labels. A list file,
or a directory named alone, is read once for every stream of the server that
names it, and shared (lists.py). What planning asks of every name (a sample
file? which kind? a tar shard?) is asked once per distinct suffix (names.py),
not once per name.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from gpufeed.v1 import feed_pb2

from ...config import Limits
from ...media.samples import is_sample_file, kind_of, sample_kind
from ...storage.paths import FileTooLarge, LocatedPaths, OutsideDataRoots
from ...storage.roots import Storage
from ...storage.s3 import is_s3
from ...storage.shardnames import TooManyShards, locate_shards, names_shards
from ...storage.shards import IndexCancelled, ShardSet, TooManySamples
from ..errors import Forbidden, InvalidRequest, LimitExceeded, NotFound
from .folders import (
    FolderError,
    ListedNames,
    ListedTree,
    Listing,
    SampleFiles,
    TooManyFiles,
    as_directory,
    below,
    folder_labels,
    list_directory,
    names_a_directory,
)
from .listfile import ListFileError, parse_list
from .lists import Hold, SharedLists
from .names import SampleNames, TooManyNames
from .thread import PlanStopped

__all__ = ["names_kind", "sample_files", "sample_labels", "sample_names", "tar_shards"]

# Sample names located between two looks at whether the call still wants the plan (an
# S3 name without a suffix costs a LIST to learn whether it is a directory).
_STOP_CHECK_NAMES = 256


def sample_names(req: feed_pb2.StreamRequest, storage: Storage, limits: Limits,
                 stopped: Callable[[], bool], lists: SharedLists | None, held: list[Hold]
                 ) -> tuple[SampleNames, np.ndarray | None, str]:
    """The sample names, the list file's labels when label_source asks for them, the prefix.

    A directory given as list_file is one name, located as a list file is
    (without the prefix), and listed later like a directory in ``files``. A
    list file is parsed by listfile.py: the server's shared parse with
    ``lists`` (then held in ``held``), else this stream's own.
    """
    kind = req.WhichOneof("samples")
    if kind == "files":
        return _pack(req.files.paths, limits), None, req.prefix
    if kind != "list_file":
        raise InvalidRequest("samples: give either files or list_file")
    if "\0" in req.list_file:
        raise InvalidRequest(f"list_file: {req.list_file!r} contains a NUL byte")
    labelled = req.label_source == feed_pb2.LABELS_FROM_LIST_FILE
    try:
        path = storage.locate(req.list_file)
        if storage.is_directory(path):
            if labelled:
                raise InvalidRequest(f"list_file: {req.list_file!r} is a directory; labels from "
                                     "the list file need a list file")
            return _pack([req.list_file], limits), None, ""
        if lists is not None:
            hold = lists.list_file(storage, path, labelled, limits, stopped)
            held.append(hold)
            names, labels = hold.value.names, hold.value.labels
        else:
            data = storage.read(path, limits.max_list_bytes, "--max-list-bytes")
            names, labels = parse_list(data, labelled, limits.max_samples, stopped)
    except OutsideDataRoots as e:
        raise Forbidden(f"list_file: {e}") from None
    except (FileNotFoundError, IsADirectoryError):
        raise NotFound(f"list_file: {req.list_file!r}: no such list file or directory "
                       f"under the data roots") from None
    except FileTooLarge as e:
        raise LimitExceeded(f"list_file: {req.list_file!r} is a {e}") from None
    except OSError as e:
        raise InvalidRequest(f"list_file: cannot read {req.list_file!r}: {e}") from None
    except ListFileError as e:
        raise (LimitExceeded if e.limit else InvalidRequest)(e.message(req.list_file)) from None
    return names, labels, req.prefix


def _pack(names: Iterable[str], limits: Limits) -> SampleNames:
    try:
        return SampleNames.pack(names, limit=limits.max_samples)
    except TooManyNames:
        raise LimitExceeded(f"samples: more than {limits.max_samples} samples, over the "
                            f"server's --max-samples {limits.max_samples}") from None


def _names_shards(names: SampleNames) -> bool:
    """storage/shardnames.py's ``names_shards``, over packed names at once where no name
    has a brace."""
    if names.contains("{"):
        return names_shards(names)
    shards = names.ends_with(".tar")
    if not len(shards) or not shards.any():
        return False
    if shards.all():
        return True
    first, loose = int(np.argmax(shards)), int(np.argmin(shards))
    return names_shards([names[min(first, loose)], names[max(first, loose)]])  # raises


def _all_sample_files(names: Sequence[str]) -> bool:
    """Whether every name is an image, video or array file's, once per distinct suffix."""
    if isinstance(names, SampleNames):
        answers, _ = names.by_suffix(is_sample_file)
        return all(answers)
    return all(is_sample_file(name) for name in names)


def names_kind(names: Sequence[str]) -> str:
    """samples.py's ``sample_kind``, asked once per distinct suffix where the names can
    say which they have (packed names, a listed tree's)."""
    by_suffix = getattr(names, "by_suffix", None)
    if by_suffix is None:
        return sample_kind(names)
    kinds, codes = by_suffix(kind_of)
    first = kinds[int(codes[0])]
    others = [code for code, kind in enumerate(kinds) if kind != first]
    if not others:
        return first
    other = int(np.flatnonzero(np.isin(codes, others))[0])
    return sample_kind([names[0], names[other]])  # raises, naming the first of another kind


def tar_shards(req: feed_pb2.StreamRequest, names: SampleNames, prefix: str,
               storage: Storage, limits: Limits, stopped: Callable[[], bool]
               ) -> ShardSet | None:
    """The named tar shards, indexed (storage/shards.py); None when the names are loose files."""
    try:
        if not _names_shards(names):
            return None
        # A shard holds at least one sample (an unreadable one counts as one failed
        # sample): names over --max-samples, or --max-shards, are refused before they
        # are made, and so before any is indexed.
        paths = locate_shards(names, prefix, storage,
                              min(limits.max_samples, limits.max_shards))
    except OutsideDataRoots as e:
        raise Forbidden(f"samples: {e}") from None
    except TooManyShards as e:
        if limits.max_shards < limits.max_samples:
            raise LimitExceeded(f"{e}, over the server's --max-shards {limits.max_shards}"
                                ) from None
        raise LimitExceeded(f"{e}, over the server's --max-samples {limits.max_samples} (each "
                            f"shard counts as one sample at least)") from None
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if req.labels or req.label_source != feed_pb2.LABELS_FROM_REQUEST:
        raise InvalidRequest("labels: tar shards carry their labels (.cls or .txt members); "
                             "give neither labels nor label_source")
    try:  # counted as the headers are read: indexing stops past the limit
        shards = ShardSet.index(storage, paths, limits.max_samples, stopped)
    except IndexCancelled:
        raise PlanStopped("the call ended while its tar shards were indexed") from None
    except TooManySamples as e:
        raise LimitExceeded(f"samples: {e}, over the server's --max-samples "
                            f"{limits.max_samples}") from None
    if len(shards.unreadable()) == len(paths):
        path, why = shards.unreadable()[0]
        raise NotFound(f"samples: no tar shard could be read (first: {path!r}: {why})")
    return shards


def sample_files(names: SampleNames, prefix: str, storage: Storage, max_samples: int,
                 stopped: Callable[[], bool] = lambda: False, lists: SharedLists | None = None,
                 held: list[Hold] | None = None) -> SampleFiles:
    """Located paths, each directory among them replaced by the files under it.

    Only a name without an image, video or array suffix costs a system call
    (is it a directory?): a long list of files is checked lexically, as before,
    and stays packed. A listing's names and paths are packed once it is done. A
    local directory named alone is the server's shared tree with ``lists``
    (held in ``held``), its names made when asked.
    """
    if "\0" in prefix or names.contains("\0"):  # a list file's line too: no path holds one
        i = next(i for i, name in enumerate(names) if "\0" in prefix + name)
        raise InvalidRequest(f"samples[{i}]: {prefix + names[i]!r} contains a NUL byte")
    if _all_sample_files(names):
        return SampleFiles(names, _located(names, prefix, storage))
    found_names: list[str] = []
    found_paths: list[str] = []
    listings: list[Listing] = []
    for i, name in enumerate(names):
        if i % _STOP_CHECK_NAMES == 0 and stopped():  # a name may cost a LIST on S3
            raise PlanStopped("the call ended while its sample names were located")
        try:
            path = storage.locate(prefix + name)
            if is_sample_file(name) or not names_a_directory(path, name, storage):
                found_names.append(name)
                found_paths.append(path)
                continue
            path = as_directory(path)
            if lists is not None and held is not None and len(names) == 1:
                hold = lists.tree(storage, path, name, max_samples, stopped)
                if hold is not None:
                    held.append(hold)
                    return _tree_files(hold.value, name)
            listed = list_directory(path, name, storage, max_samples - len(found_paths),
                                    stopped)
        except OutsideDataRoots as e:
            raise Forbidden(f"samples[{i}]: {e}") from None
        except TooManyFiles as e:
            raise LimitExceeded(f"samples[{i}]: {e}") from None
        except FolderError as e:
            raise (NotFound if e.not_found else InvalidRequest)(f"samples[{i}]: {e}") from None
        if not listed:
            raise InvalidRequest(f"samples[{i}]: the directory {name!r} holds no image, video or "
                                 f"array files")
        start = len(found_paths)
        found_paths += listed
        found_names += [posixpath.join(name, below(p, path)) for p in listed]
        listings.append(Listing(start, len(found_paths), path))
    if len(found_paths) > max_samples:  # the files named beside the listings
        raise LimitExceeded(f"samples: {len(found_paths)} samples is over the server's "
                            f"--max-samples {max_samples}")
    return SampleFiles(SampleNames.pack(found_names), SampleNames.pack(found_paths), listings)


def _tree_files(tree: ListedTree, name: str) -> SampleFiles:
    """The samples of a shared tree that a request named ``name`` (its only sample name)."""
    if not len(tree.paths):
        raise InvalidRequest(f"samples[0]: the directory {name!r} holds no image, video or "
                             f"array files")
    return SampleFiles(ListedNames(name, tree), tree.paths,
                       [Listing(0, len(tree.paths), tree.directory)], tree)


def _located(names: SampleNames, prefix: str, storage: Storage) -> LocatedPaths:
    """The names' paths, every one checked to lie under the roots (lexically) now.

    A relative name without ``..`` after a relative prefix without one cannot
    leave the roots: when no name has either, the per-name check is skipped.
    An ``s3://`` name (or prefix) is always checked: it names its bucket and
    key itself, which may lie under no root, or on a server with none.
    """
    if not (os.path.isabs(prefix) or ".." in prefix or is_s3(prefix) or names.contains("..")
            or names.contains("s3://") or (not prefix and names.any_starts_with("/"))):
        return LocatedPaths(names, prefix, storage)
    for i, name in enumerate(names):
        try:
            storage.locate(prefix + name)
        except OutsideDataRoots as e:
            raise Forbidden(f"samples[{i}]: {e}") from None
    return LocatedPaths(names, prefix, storage)


def sample_labels(req: feed_pb2.StreamRequest, samples: SampleFiles, listed: np.ndarray | None,
                  storage: Storage) -> tuple[np.ndarray | None, list[str]]:
    """Per-sample labels (or None) and, for folder labels, the class names."""
    source = req.label_source
    if req.labels and source != feed_pb2.LABELS_FROM_REQUEST:
        raise InvalidRequest("labels: give labels or label_source, not both")
    if req.classes and source != feed_pb2.LABELS_FROM_FOLDER:
        raise InvalidRequest("classes: only folder labels (LABELS_FROM_FOLDER) take class names")
    if source == feed_pb2.LABELS_FROM_REQUEST:
        if not req.labels:
            return None, []
        if len(req.labels) != len(samples.paths):
            raise InvalidRequest(f"labels: {len(req.labels)} labels for {len(samples.paths)} "
                                 "samples")
        return np.asarray(req.labels, dtype=np.int64), []
    if source == feed_pb2.LABELS_FROM_LIST_FILE:
        if listed is None:
            raise InvalidRequest("label_source: LABELS_FROM_LIST_FILE needs a list_file")
        if samples.listings:
            raise InvalidRequest(f"list_file: {samples.names[samples.listings[0].start]!r} "
                                 "comes from a directory; labels from the list file need one "
                                 "file per line")
        return listed, []
    if source == feed_pb2.LABELS_FROM_FOLDER:
        try:
            return folder_labels(samples, list(req.classes), storage)
        except OutsideDataRoots as e:
            raise Forbidden(f"label_source: {e}") from None
        except FolderError as e:
            raise (NotFound if e.not_found else InvalidRequest)(str(e)) from None
    raise InvalidRequest(f"label_source: unknown value {source}")
