"""The package as shipped: fresh stubs, a client that needs no server dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUBS = ["feed_pb2.py", "feed_pb2.pyi", "feed_pb2_grpc.py"]


def test_committed_stubs_match_the_proto(tmp_path):
    """Fails when protos/gpufeed/v1/feed.proto changed without regenerating (see its header)."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}", str(ROOT / "protos/gpufeed/v1/feed.proto")]
    assert protoc.main(args) == 0
    for name in STUBS:
        fresh = (tmp_path / "gpufeed/v1" / name).read_text()
        committed = (ROOT / "protos/gpufeed/v1" / name).read_text()
        assert fresh == committed, f"protos/gpufeed/v1/{name} is stale: regenerate the stubs"


def test_client_imports_without_server_dependencies():
    code = ("import sys\n"
            "sys.modules['av'] = None\n"  # any `import av` now raises ImportError
            "sys.modules['prometheus_client'] = None\n"
            "import gpufeed.client\n"
            "from gpufeed.client import FeedClient, FeedError, Loader\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
