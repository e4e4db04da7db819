"""Directories as torchvision's ImageFolder sees them: the files under one, and classes.

A directory named as samples stands for the image, video and array files under
it, recursively, in ImageFolder's order: files directly in it first (sorted;
ImageFolder would ignore them), then each subdirectory in sorted order, and
within one the directories of ``os.walk`` sorted by path and their files by
name. Symlinked directories are followed, as ImageFolder does, but only while
they resolve under a data root and not back into a directory being walked;
a symlinked file is listed and checked when read, as any file is.

Folder labels (``LABELS_FROM_FOLDER``) number classes the way ImageFolder does,
from the class folders on disk rather than from the samples a request happens
to name, so a validation list missing a class keeps every label: the classes
are the sorted subdirectories of the *dataset directory*. That is the
directory named as samples (its files' class is their first folder below it);
or, for a sample named as a file, the parent of the folder holding it (its
class is that folder). Every sample must then have the same dataset directory;
with explicit ``classes`` it need not, and the classes are those given. Either
way a sample whose class folder is not a class is refused, naming it.

A directory in S3 is a prefix ending in "/" (storage/roots.py), listed with
ListObjectsV2 under the same rules: the sample objects under it in the order
the same tree on disk would have (a key's first "folder" below the directory
is its class folder, the rest of its path its subdirectories), the bound
counted as the pages come, so a prefix of a hundred million keys is refused
after ``--max-samples`` of them, not after listing it all; the classes are its
first-level prefixes (a "directory marker" key ``val/bird/`` makes one, as an
empty folder does on disk). A listing is what the store answered while it
was made: an object deleted later fails as any missing file does, one added
later is not served, and one the store answers twice (pages that moved under
a listing) is listed once.

A local tree listed for a request that names it alone is kept and shared by
every stream that names it (lists.py: ``list_tree``'s ``ListedTree``, checked
against its directories' mtimes): its files' located paths, packed, and where
each class folder's files lie, so that folder labels are numbered a class
folder at a time rather than a sample at a time.
"""

from __future__ import annotations

import itertools
import os
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ...media.samples import is_sample_file
from ...storage.paths import LocatedPaths, OutsideDataRoots
from ...storage.roots import Storage
from ...storage.s3 import is_s3
from .names import SampleNames
from .thread import PlanStopped

__all__ = ["FolderError", "ListedNames", "ListedTree", "Listing", "SampleFiles", "as_directory",
           "below", "folder_labels", "list_directory", "list_tree", "names_a_directory"]

# Keys listed between two looks at whether the call still wants them (an S3 page's worth).
_STOP_CHECK_KEYS = 1000

Answer = TypeVar("Answer")


class FolderError(ValueError):
    """A directory or class folder that cannot serve the request; the message names it."""

    def __init__(self, message: str, not_found: bool = False):
        super().__init__(message)
        self.not_found = not_found


class TooManyFiles(FolderError):
    """A listing over the server's --max-samples."""


@dataclass(frozen=True)
class Listing:
    """Samples ``start:stop`` are the files listed under ``directory`` (a located path)."""

    start: int
    stop: int
    directory: str


@dataclass(eq=False)
class ListedTree:
    """A local directory's sample files (``list_directory``'s, in its order), as kept and
    shared (lists.py): their located paths, packed; the files directly in it first
    (samples ``0:loose``), then those under each of its subdirectories ``folders``
    (sorted: the classes on disk), folder k's at ``bounds[k]:bounds[k + 1]``; and every
    directory listed, the top one first."""

    directory: str
    paths: SampleNames
    loose: int
    folders: list[str]
    bounds: np.ndarray
    directories: list[str]

    @property
    def nbytes(self) -> int:
        return self.paths.nbytes + self.bounds.nbytes


class ListedNames(Sequence[str]):
    """A listed tree's samples named as a request named its directory (``name``, then each
    file's path below it), made when asked: the tree's packed paths serve every
    request, however it spelled the directory."""

    def __init__(self, name: str, tree: ListedTree):
        self._name, self._tree = name, tree

    def __len__(self) -> int:
        return len(self._tree.paths)

    def __getitem__(self, index):  # an int (the protocol's slices are not asked for)
        return posixpath.join(self._name, below(self._tree.paths[index], self._tree.directory))

    def by_suffix(self, answer: Callable[[str], Answer]) -> tuple[list[Answer], np.ndarray]:
        """``SampleNames.by_suffix``: a name ends with its path's file name."""
        return self._tree.paths.by_suffix(answer)


@dataclass
class SampleFiles:
    """A request's samples after directories are listed: names for messages, located
    paths (packed sequences, located.py), and which of them came from which listing;
    ``tree`` when they are one kept tree's, alone."""

    names: Sequence[str]
    paths: LocatedPaths | SampleNames
    listings: list[Listing] = field(default_factory=list)
    tree: ListedTree | None = None


def names_a_directory(path: str, name: str, storage: Storage) -> bool:
    """Whether a located path is a directory (``Storage.is_directory``, which raises
    OSError), for a request's sample name: FolderError naming ``name`` when S3 cannot
    be asked."""
    try:
        return storage.is_directory(path)
    except OutsideDataRoots:
        raise
    except OSError as e:
        raise FolderError(f"cannot list {name!r}: {e}",
                          not_found=isinstance(e, FileNotFoundError)) from None


def as_directory(path: str) -> str:
    """A located directory as ``list_directory`` takes it and ``Listing`` keeps it: an S3
    one ends in "/" (the prefix its keys share), a local one as located."""
    return path.rstrip("/") + "/" if is_s3(path) else path


def below(path: str, directory: str) -> str:
    """``path``'s name relative to ``directory`` (``as_directory``'s), which holds it."""
    return path[len(directory):] if is_s3(directory) else os.path.relpath(path, directory)


def list_directory(directory: str, name: str, storage: Storage, limit: int,
                   stopped: Callable[[], bool] = lambda: False) -> list[str]:
    """The sample files under ``directory`` (located; ``as_directory``'s), in ImageFolder's
    order.

    ``name`` is how the request named it, for messages. Raises OutsideDataRoots
    for a directory (or a symlinked one under it) that resolves outside the
    roots, FolderError for a symlink loop, an unreadable directory, or more than
    ``limit`` files; PlanStopped once ``stopped()`` (checked per directory, or per
    page of S3 keys): a tree or a bucket can take minutes to list.
    """
    if is_s3(directory):
        return _list_prefix(directory, name, storage, limit, stopped)
    return _list_local(directory, name, storage, limit, stopped)[0]


def list_tree(directory: str, name: str, storage: Storage, limit: int,
              stopped: Callable[[], bool] = lambda: False) -> ListedTree:
    """``list_directory`` of a local directory, as a ``ListedTree``; raises as it does."""
    files, folders, bounds, directories = _list_local(directory, name, storage, limit, stopped)
    paths = SampleNames.pack(files)
    del files
    return ListedTree(directory, paths, bounds[0], folders, np.asarray(bounds, np.int64),
                      directories)


def _list_local(directory: str, name: str, storage: Storage, limit: int,
                stopped: Callable[[], bool]) -> tuple[list[str], list[str], list[int], list[str]]:
    """(the files, the sorted subdirectories, where each one's files begin and the last
    end, every directory listed) of a local ``list_directory``."""
    if storage.root_of(os.path.realpath(directory)) is None:
        raise OutsideDataRoots(f"{name!r} resolves outside the data roots")
    files, subdirs = [], []
    for entry in _entries(directory, name):
        if _is_dir(entry):
            subdirs.append(entry.name)
        elif is_sample_file(entry.name):
            files.append(os.path.join(directory, entry.name))
    files.sort()
    subdirs.sort()
    bounds, directories = [len(files)], [directory]
    seen = {os.path.realpath(directory)}
    for subdir in subdirs:
        _check_limit(len(files), limit, name)
        walked = _walk(os.path.join(directory, subdir), name, storage, seen, limit - len(files),
                       stopped)
        for parent, names in sorted(walked):
            files.extend(os.path.join(parent, n) for n in sorted(names))
            directories.append(parent)
        bounds.append(len(files))
    _check_limit(len(files), limit, name)
    return files, subdirs, bounds, directories


def _list_prefix(directory: str, name: str, storage: Storage, limit: int,
                 stopped: Callable[[], bool]) -> list[str]:
    """``list_directory`` for S3: the sample objects under ``directory`` in the order of the
    same tree on disk, each once. FolderError (not found) when no key at all lies under
    it: S3 cannot tell an empty prefix from a missing one."""
    found: list[str] = []
    keys = 0
    try:
        for key in storage.list_objects(directory):
            keys += 1
            if keys % _STOP_CHECK_KEYS == 0:
                _check_stopped(stopped, name)
            if is_sample_file(key):
                found.append(key)
                _check_limit(len(found), limit, name)
    except OutsideDataRoots:
        raise
    except OSError as e:
        raise FolderError(f"cannot list {name!r}: {e}",
                          not_found=isinstance(e, FileNotFoundError)) from None
    if not keys:
        raise FolderError(f"{name!r}: no object under {directory!r}", not_found=True)
    found.sort(key=_on_disk)
    return [directory + key for key, _ in itertools.groupby(found)]


def _on_disk(key: str) -> tuple[int, str, str, str]:
    """Where a key below a listed directory comes in ``list_directory``'s local order:
    files directly in it first, by name; then by class folder, and within one by the
    file's folder (as the sorted ``os.walk``), then by name. The class comes first
    because the whole path does not sort so: ``cat-x/`` sorts before ``cat/more/``."""
    folder, sep, _ = key.partition("/")
    if not sep:
        return 0, "", "", key
    parent, _, file = key.rpartition("/")
    return 1, folder, parent, file


def _check_stopped(stopped: Callable[[], bool], name: str) -> None:
    if stopped():
        raise PlanStopped(f"the call ended while {name!r} was listed")


def _check_limit(count: int, limit: int, name: str) -> None:
    if count > limit:
        raise TooManyFiles(f"{name!r} holds more than {limit} sample files (the server's "
                           f"--max-samples, less the samples before it)")


def _entries(directory: str, name: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError as e:
        raise FolderError(f"cannot list {name!r}: {e.strerror or e}") from None


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether an entry is a directory (a symlink followed); False when that cannot be
    learnt, as ``os.walk`` decides below it: a looping or unreadable symlink is then
    a file, listed if its name is a sample's and failing alone when read, instead of
    failing the whole listing."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _walk(top: str, name: str, storage: Storage, seen: set[str], limit: int,
          stopped: Callable[[], bool]) -> list[tuple[str, list[str]]]:
    """(directory, sample file names) for every directory under ``top``, ``top`` included.

    ``seen`` holds the real paths already walked: reaching one again (a symlink
    loop, or two links to one directory) is refused rather than listed twice.
    More than ``limit`` files stop the walk (TooManyFiles).
    """
    found, count = [], 0

    def fail(error: OSError) -> None:
        raise FolderError(f"cannot list {storage.shown(error.filename)!r} under {name!r}: "
                          f"{error.strerror or error}")

    for parent, _, files in os.walk(top, onerror=fail, followlinks=True):
        _check_stopped(stopped, name)
        real = os.path.realpath(parent)
        if storage.root_of(real) is None:
            raise OutsideDataRoots(f"{storage.shown(parent)!r} (under {name!r}) resolves "
                                   f"outside the data roots")
        if real in seen:
            raise FolderError(f"{storage.shown(parent)!r} (under {name!r}) is a directory "
                              f"listed already (a symlink loop, or a second link to it)")
        seen.add(real)
        found.append((parent, [f for f in files if is_sample_file(f)]))
        count += len(found[-1][1])
        _check_limit(count, limit, name)
    return found


def folder_labels(samples: SampleFiles, classes: list[str], storage: Storage
                  ) -> tuple[np.ndarray, list[str]]:
    """Each sample's label (its class folder's number) and the classes; see the module doc.

    Raises FolderError naming the first sample or directory at fault.
    """
    if len(set(classes)) != len(classes) or not all(classes):
        raise FolderError("classes: class names must be distinct and non-empty")
    if samples.tree is not None:
        return _tree_labels(samples, samples.tree, classes)
    folders, datasets = _class_folders(samples, storage)
    if not classes:
        found = sorted(set(datasets))
        if len(found) > 1:
            first = datasets.index(found[0])
            other = datasets.index(found[1])
            raise FolderError(
                f"label_source: LABELS_FROM_FOLDER: samples[{first}] "
                f"({samples.names[first]!r}) and samples[{other}] ({samples.names[other]!r}) "
                f"are in different dataset directories ({storage.shown(found[0])!r} and "
                f"{storage.shown(found[1])!r}); give the classes explicitly")
        classes = _subdirectories(found[0], samples.names[0], storage)
    number = {name: i for i, name in enumerate(classes)}
    labels = np.empty(len(folders), dtype=np.int64)
    for i, folder in enumerate(folders):
        label = number.get(folder)
        if label is None:
            raise _not_a_class(i, samples.names[i], folder, classes)
        labels[i] = label
    return labels, list(classes)


def _tree_labels(samples: SampleFiles, tree: ListedTree, classes: list[str]
                 ) -> tuple[np.ndarray, list[str]]:
    """``folder_labels`` of one kept tree's samples: its class folders' numbers, a folder
    at a time, refused as ``folder_labels`` refuses (the first sample at fault). The
    classes on disk are the tree's folders: it was found unchanged when asked for."""
    if tree.loose:
        raise FolderError(f"label_source: LABELS_FROM_FOLDER: samples[0] ({samples.names[0]!r}) "
                          f"is not in a class folder under a dataset directory")
    classes = classes or tree.folders
    number = {name: i for i, name in enumerate(classes)}
    labels = np.empty(len(tree.paths), dtype=np.int64)
    for folder, start, stop in zip(tree.folders, tree.bounds[:-1].tolist(),
                                   tree.bounds[1:].tolist()):
        if start == stop:
            continue
        label = number.get(folder)
        if label is None:
            raise _not_a_class(start, samples.names[start], folder, classes)
        labels[start:stop] = label
    return labels, list(classes)


def _not_a_class(index: int, name: object, folder: str, classes: list[str]) -> FolderError:
    """The refusal of sample ``index`` (``name``), whose ``folder`` is none of ``classes``."""
    shown = ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else "")
    return FolderError(f"label_source: LABELS_FROM_FOLDER: samples[{index}] ({name!r}) is in "
                       f"folder {folder!r}, which is not a class (classes: {shown})")


def _class_folders(samples: SampleFiles, storage: Storage) -> tuple[list[str], list[str]]:
    """Each sample's class folder name and dataset directory (located)."""
    folders, datasets = [], []
    listed = iter(samples.listings)
    listing = next(listed, None)
    for i, path in enumerate(samples.paths):
        while listing is not None and i >= listing.stop:
            listing = next(listed, None)
        if listing is not None and listing.start <= i:
            folder, sep, _ = below(path, listing.directory).partition("/")
            dataset = listing.directory
        else:
            parent = os.path.dirname(path)
            folder, dataset = os.path.basename(parent), os.path.dirname(parent)
            if is_s3(path):  # as a listed S3 directory is kept: the prefix of its keys
                dataset += "/"
            sep = "/" if storage.root_of(dataset) is not None else ""
        if not sep:
            raise FolderError(f"label_source: LABELS_FROM_FOLDER: samples[{i}] "
                              f"({samples.names[i]!r}) is not in a class folder under a "
                              f"dataset directory")
        folders.append(folder)
        datasets.append(dataset)
    return folders, datasets


def _subdirectories(dataset: str, example: str, storage: Storage) -> list[str]:
    """ImageFolder's classes: the sorted names of the directories in ``dataset``."""
    if is_s3(dataset):
        return _prefix_classes(dataset, example, storage)
    shown = storage.shown(dataset)
    if storage.root_of(os.path.realpath(dataset)) is None:
        raise OutsideDataRoots(f"the dataset directory {shown!r} resolves outside the data roots")
    if not os.path.isdir(dataset):
        raise FolderError(f"label_source: LABELS_FROM_FOLDER: the dataset directory {shown!r} "
                          f"(of {example!r}) is not a directory on the server", not_found=True)
    return sorted(entry.name for entry in _entries(dataset, shown) if _is_dir(entry))


def _prefix_classes(dataset: str, example: str, storage: Storage) -> list[str]:
    """``_subdirectories`` for S3: the sorted first-level prefixes of ``dataset``."""
    classes, keys = [], 0
    try:
        for key in storage.list_objects(dataset, first_level=True):
            keys += 1
            if key.endswith("/") and key != "/":
                classes.append(key[:-1])
    except OutsideDataRoots:
        raise
    except OSError as e:
        raise FolderError(f"label_source: LABELS_FROM_FOLDER: cannot list the dataset directory "
                          f"{dataset!r} (of {example!r}): {e}",
                          not_found=isinstance(e, FileNotFoundError)) from None
    if not keys:
        raise FolderError(f"label_source: LABELS_FROM_FOLDER: the dataset directory {dataset!r} "
                          f"(of {example!r}) holds no object", not_found=True)
    return sorted(set(classes))
