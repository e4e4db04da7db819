"""The package as shipped: fresh stubs, a client that needs no server dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
        committed = (ROOT / "src/gpufeed/v1" / name).read_text()
        assert fresh == committed, f"src/gpufeed/v1/{name} is stale: regenerate the stubs"


def test_client_imports_without_server_dependencies():
    code = ("import sys\n"
            "sys.modules['av'] = None\n"  # any `import av` now raises ImportError
            "sys.modules['prometheus_client'] = None\n"
            "import gpufeed.client\n"
            "from gpufeed.client import FeedClient, FeedError, Loader\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_server_help_and_version():
    import gpufeed

    run = lambda *args: subprocess.run([sys.executable, "-m", "gpufeed.server", *args],  # noqa: E731
                                       capture_output=True, text=True)
    help_text = run("--help")
    assert help_text.returncode == 0
    assert "--log-level" in help_text.stdout and "--version" in help_text.stdout
    assert "`" not in help_text.stdout  # plain text, not reST
    version = run("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"gpufeed-server {gpufeed.__version__}"


def test_client_only_install_says_what_the_server_needs(tmp_path):
    """What the gpufeed-server entry point runs, where PyAV is not installed."""
    code = ("import sys\n"
            "sys.modules['av'] = None\n"
            "from gpufeed.server.__main__ import main\n"
            f"sys.exit(main(['--data-root', {str(tmp_path)!r}]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert "install gpufeed[server]" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, words", [
    (["--data-root", "/no/such/dir"], "--data-root: data root '/no/such/dir' is not a directory"),
    (["--plugins", "no_such_plugin"], "--plugins no_such_plugin: cannot import it"),
    (["--threads", "x"], "argument --threads: invalid int value: 'x'"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--token-file", "/no/such/token"], "--token-file: '/no/such/token' is not a file"),
    (["--help"], ""),
])
def test_the_command_line_is_refused_before_the_servers_imports(tmp_path, args, words):
    """A mistake on the command line is refused before torch, PyAV and gRPC are imported
    (they take seconds), so an operator's typo is answered at once."""
    code = ("import sys\n"
            "from gpufeed.server.__main__ import main\n"
            "try:\n"
            f"    main(['--data-root', {str(tmp_path)!r}, *{args!r}])\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code, sorted({'torch', 'av', 'grpc'} & set(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.splitlines()[-1] == f"exit {0 if args == ['--help'] else 2} []"
    assert words in result.stderr


def test_the_wheel_ships_py_typed(tmp_path):
    """PEP 561: type checkers read the client's and server's annotations."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("gpufeed-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("gpufeed", "gpufeed/client", "gpufeed/server"):
        assert f"{package}/py.typed" in names
