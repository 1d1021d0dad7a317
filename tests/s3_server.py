"""A real S3-protocol server on localhost for the tests of checkpoints in object storage (issue 34).

moto's `ThreadedMotoServer` speaks the S3 wire protocol on a free port of 127.0.0.1; reshard
talks to it through fsspec and s3fs exactly as it would to AWS or an on-premises store (no
client is mocked: every request is an HTTP request the server answers). The credentials and
the endpoint are handed over the standard way, as environment variables (the chain botocore
reads: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``), and the
bucket is made with the server's own API (a PUT Bucket through boto3), so what the tests
check is what a user with an S3 endpoint gets.

Imported by `tests/test_s3.py` only; `moto[server]` and `s3fs` come with the `s3` extra
(``pip install -e '.[test,s3]'``).
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

#: Credentials the server accepts (moto accepts any); set in the environment, never passed as arguments,
#: so the tests prove that reshard finds them in the standard chain and records them nowhere.
ACCESS_KEY = "AKIARESHARDTESTKEY01"
SECRET_KEY = "reshard-test-secret-9f8e7d6c5b4a"
BUCKET = "reshard-test"


@dataclass(frozen=True)
class S3Server:
    """A running server: its endpoint and the one bucket the tests use."""

    endpoint: str
    bucket: str

    def url(self, prefix: str) -> str:
        """``s3://bucket/prefix``: a checkpoint's URL on this server."""
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def client(self):
        """A boto3 client on this server (for uploads and listings made by the tests themselves)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def upload(self, local: Path, prefix: str) -> str:
        """Every regular file under ``local`` put under ``prefix`` (its relative path the key's tail); the URL."""
        c = self.client()
        for p in sorted(local.rglob("*")):
            if p.is_file():
                c.upload_file(str(p), self.bucket, f"{prefix.strip('/')}/{p.relative_to(local).as_posix()}")
        return self.url(prefix)

    def keys(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` as key tail -> size (the server's own listing)."""
        c = self.client()
        out: dict[str, int] = {}
        base = prefix.strip("/") + "/"
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for o in page.get("Contents", []):
                out[o["Key"][len(base):]] = o["Size"]
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,  # nothing of the machine's own chain leaks in
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on a free localhost port, point the standard chain at it, make the bucket."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request on the test's stderr
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL_S3")}
    os.environ.update(ENV, AWS_ENDPOINT_URL_S3=endpoint)
    _forget_clients()
    try:
        s = S3Server(endpoint, BUCKET)
        s.client().create_bucket(Bucket=BUCKET)
        yield s
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
        _forget_clients()


def _forget_clients() -> None:
    """fsspec keeps one S3 filesystem per set of arguments, and the endpoint is not one of them (it comes
    from the environment): a client made for a server an earlier test module stopped would be handed
    to the next module's `FsspecReader` in the same process, and refused."""
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
