"""The user docs run: every ```python block of README.md and docs/guide/*.md, against a real server.

A page's blocks run in order in one namespace, as a reader pasting them would, in a
fresh working directory. The blocks name the server as ``localhost:50051``, which is
replaced by the test server's address, and data as paths under its data root, which
``docs_root`` builds small (an ImageFolder tree, a list file, tar shards, a COCO-like
tree with sidecars). ``model`` stands for the reader's model. A block that cannot run
here (CUDA, S3, several hosts) says so just above its fence with
``<!-- not run: reason -->``; there may be only a few. Shell blocks are not run.

The docs' relative links must point at files and headings that exist, and no user
doc may name an issue by number.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from shards import write_shards

REPO = Path(__file__).resolve().parent.parent
# The pages whose python blocks run: what a user reads and pastes.
RUN_PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]
# The docs whose relative links must resolve.
LINK_PAGES = [*RUN_PAGES, REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md",
              REPO / "docker" / "README.md", *sorted((REPO / "docs" / "decisions").glob("*.md"))]
ADDRESS = "localhost:50051"  # how the docs name the server
MAX_NOT_RUN = 6  # blocks marked "not run", over every page

_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not run or None)`` for each ```python block of ``page``."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i].strip())
        if not fence:
            i += 1
            continue
        start, language = i, fence.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        if language == "python":
            before = next((line for line in reversed(lines[:start]) if line.strip()), "")
            not_run = _NOT_RUN.match(before.strip())
            indent = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
            code = "\n".join(b[indent:] for b in body)
            blocks.append((start + 1, code, not_run.group(1) if not_run else None))
    return blocks


def _jpeg(path: Path, rng: np.random.Generator) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = int(rng.integers(48, 97)), int(rng.integers(48, 97))
    path.write_bytes(encode_jpeg(synthetic_photo(rng, height, width)))


@pytest.fixture(scope="module")
def docs_root(tmp_path_factory) -> Path:
    """The data the docs name, small."""
    from PIL import Image

    root = tmp_path_factory.mktemp("docs-data")
    rng = np.random.default_rng(7)
    classes = ["n01440764", "n01443537"]
    lines = []
    for label, name in enumerate(classes):
        for i in range(6):
            _jpeg(root / "imagenet" / "train" / name / f"{i:03d}.JPEG", rng)
            lines.append(f"imagenet/train/{name}/{i:03d}.JPEG {label}")
        for i in range(2):
            _jpeg(root / "imagenet" / "val" / name / f"{i:03d}.JPEG", rng)
    (root / "train.flist").write_text("\n".join(lines) + "\n")
    # COCO-like: images, masks and labels trees, metadata beside the images.
    for i in range(3):
        image = root / "coco" / "images" / "train" / f"x{i}.jpg"
        _jpeg(image, rng)
        with Image.open(image) as im:
            width, height = im.size
        mask = root / "coco" / "masks" / "train" / f"x{i}.png"
        mask.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 5, (height, width), dtype=np.uint8), "L").save(mask)
        boxes = root / "coco" / "labels" / "train" / f"x{i}.txt"
        boxes.parent.mkdir(parents=True, exist_ok=True)
        boxes.write_text(f"2 3 {width - 4} {height - 5} 1\n0 0 10 10 2\n")
        image.with_suffix(".json").write_text(json.dumps({"id": i}))
    write_shards(root / "shards", [4, 4])  # train-0000.tar, train-0001.tar: NNN.jpg + NNN.cls
    return root


@pytest.fixture(scope="module")
def docs_server(docs_root):
    with ServerProcess(["--data-root", str(docs_root), "--threads", "2"]) as proc:
        yield proc


def _model(images):
    """The reader's model, as the docs call it: [N, ...] in, [N, 2] logits out."""
    import torch

    return torch.zeros(len(images), 2)


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run(page, docs_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__", "model": _model}
    for line, code, not_run in python_blocks(page):
        if not_run:
            continue
        code = code.replace(ADDRESS, docs_server.address)
        try:
            exec(compile(code, f"{page.relative_to(REPO)}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(REPO)}, the block at line {line} "
                                 f"failed: {type(e).__name__}: {e}") from e


def test_few_blocks_are_not_run():
    skipped = [(page.relative_to(REPO), line, reason) for page in RUN_PAGES
               for line, _, reason in python_blocks(page) if reason]
    assert all(reason.strip() for _, _, reason in skipped)
    assert len(skipped) <= MAX_NOT_RUN, f"too many blocks marked not run: {skipped}"
    ran = sum(1 for page in RUN_PAGES for *_, reason in python_blocks(page) if not reason)
    assert ran >= 15, f"only {ran} python blocks run"


def test_block_extraction_catches_a_broken_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n\n"
                    "```python\n    y = undefined_name\n```\n\n```bash\nls\n```\n")
    (first, second) = python_blocks(page)
    assert first[2] == "needs a GPU" and second[2] is None
    with pytest.raises(NameError):
        exec(second[1], {})


@pytest.mark.parametrize("page", LINK_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    if not page.exists():
        pytest.skip(f"{page.relative_to(REPO)} does not exist yet")
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links to missing files or headings: {broken}"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


_REPO_PATH = re.compile(r"(?<![\w./-])(?:src|tests|examples|bench|protos|docker|\.ci)/[\w./-]*\w")


@pytest.mark.parametrize("page", [*RUN_PAGES, REPO / "CONTRIBUTING.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_named_repository_files_exist(page):
    """A file of the repository the docs name (``src/gpufeed/server/media/draws.py``) is there: a
    module that moves takes its mentions with it."""
    missing = sorted({p for p in _REPO_PATH.findall(page.read_text())
                      if "." in p.rsplit("/", 1)[-1] and not (REPO / p).exists()})
    assert not missing, f"{page.relative_to(REPO)} names files that do not exist: {missing}"


def test_no_issue_numbers_in_user_docs():
    pages = [*RUN_PAGES, REPO / "CONTRIBUTING.md"]
    found = [(p.relative_to(REPO), m.group(0)) for p in pages if p.exists()
             for m in re.finditer(r"\bissues? #?[0-9]+", p.read_text(), re.IGNORECASE)]
    assert not found, f"issue numbers mean nothing to a reader: {found}"
