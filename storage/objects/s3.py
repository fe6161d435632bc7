"""S3 (and S3-compatible: MinIO, moto, ...) object store through boto3.

URL: ``s3://bucket/prefix?endpoint_url=http://host:port&region=us-east-1&access_key_id=..&
secret_access_key=..&config=/path/to/s3.ini``. Anything not in the URL comes from the config
file (INI section [s3] with the same keys) and then boto3's usual chain (AWS_* environment,
~/.aws). Throttling and transient errors are retried by botocore's adaptive retry mode; what
still fails surfaces as ObjectStoreError and the engine's uploader retries with backoff.
"""
from __future__ import annotations

import configparser
from urllib.parse import parse_qs, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .store import ObjectNotFound, ObjectStore, ObjectStoreError

MULTIPART_THRESHOLD = 16 << 20
PART_SIZE = 16 << 20


class S3ObjectStore(ObjectStore):
    """Keys live under ``prefix/`` in ``bucket``; objects over 16 MiB use multipart upload."""

    def __init__(self, url: str, probe: bool = False) -> None:
        self.url = url
        parts = urlsplit(url)
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        opts = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if "config" in opts:
            cp = configparser.ConfigParser()
            cp.read(opts["config"])
            if cp.has_section("s3"):
                opts = {**dict(cp.items("s3")), **opts}
        connect_timeout = float(opts.get("connect_timeout", 3))
        read_timeout = float(opts.get("read_timeout", 20))
        retries = {"max_attempts": int(opts.get("max_attempts", 4)), "mode": "adaptive"}
        if probe:       # the start-up check: a black-holed endpoint fails in seconds
            connect_timeout, read_timeout = min(connect_timeout, 2.0), min(read_timeout, 3.0)
            retries = {"max_attempts": 2, "mode": "standard"}
        cfg = Config(retries=retries, connect_timeout=connect_timeout, read_timeout=read_timeout,
                     max_pool_connections=32,
                     s3={"addressing_style": opts.get("addressing_style", "path")})
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=opts.get("endpoint_url"),
            region_name=opts.get("region") or opts.get("region_name"),
            aws_access_key_id=opts.get("access_key_id"),
            aws_secret_access_key=opts.get("secret_access_key"), config=cfg)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes | memoryview) -> None:
        try:
            if len(data) <= MULTIPART_THRESHOLD:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data))
                return
            self._put_multipart(self._key(key), memoryview(data))
        except (BotoCoreError, ClientError) as e:
            raise ObjectStoreError(f"put {key}: {e}") from e

    def _put_multipart(self, key: str, data: memoryview) -> None:
        up = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)
        uid = up["UploadId"]
        try:
            parts = []
            for n, pos in enumerate(range(0, len(data), PART_SIZE), start=1):
                r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=uid,
                                            PartNumber=n, Body=bytes(data[pos:pos + PART_SIZE]))
                parts.append({"PartNumber": n, "ETag": r["ETag"]})
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid,
                                                  MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid)
            except (BotoCoreError, ClientError):
                pass
            raise

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if end is not None and end <= start:
            return b""
        rng = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._key(key), Range=rng)
            return r["Body"].read()
        except (BotoCoreError, ClientError) as e:
            raise _key_error("get", key, e) from e

    def size(self, key: str) -> int:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        except (BotoCoreError, ClientError) as e:
            raise _key_error("head", key, e) from e

    def delete(self, keys: list[str]) -> None:
        try:
            for i in range(0, len(keys), 1000):
                chunk = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
                self.client.delete_objects(Bucket=self.bucket,
                                           Delete={"Objects": chunk, "Quiet": True})
        except (BotoCoreError, ClientError) as e:
            raise ObjectStoreError(f"delete: {e}") from e

    def list(self, prefix: str = "") -> list[str]:
        full = self._key(prefix)
        cut = len(self.prefix) + 1 if self.prefix else 0
        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full):
                out.extend(o["Key"][cut:] for o in page.get("Contents", []))
        except (BotoCoreError, ClientError) as e:
            raise ObjectStoreError(f"list: {e}") from e
        return sorted(out)

    def check(self) -> None:
        """HeadBucket first (a missing bucket or wrong credentials say so), then the
        write/read/delete round trip."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise ObjectStoreError(f"bucket {self.bucket!r} does not exist") from e
            if code in ("403", "AccessDenied", "Forbidden"):
                raise ObjectStoreError(f"access to bucket {self.bucket!r} denied (check the "
                                       "credentials)") from e
            raise ObjectStoreError(f"bucket {self.bucket!r}: {e}") from e
        except BotoCoreError as e:
            raise ObjectStoreError(str(e)) from e
        super().check()

    def close(self) -> None:
        self.client.close()


def _key_error(op: str, key: str, e: BotoCoreError | ClientError) -> ObjectStoreError:
    """The error to raise for a failed request about one key: ObjectNotFound where S3 says the
    key does not exist, else ObjectStoreError naming the operation."""
    code = e.response.get("Error", {}).get("Code") if isinstance(e, ClientError) else None
    if code in ("NoSuchKey", "404"):
        return ObjectNotFound(key)
    return ObjectStoreError(f"{op} {key}: {e}")
