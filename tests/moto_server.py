"""A real S3-compatible server for the tests: moto's, over HTTP on 127.0.0.1, with IAM enforced.

`moto_server` runs as a child process on a free port (its state is its own, never the test
process's), so klpipe reaches it exactly as it reaches S3: pyarrow's AWS SDK client, the standard
AWS variables, requests over HTTP. Once two IAM users are made (one allowed every S3 action, one
denied every one), the server is told to authenticate every request after that: unknown access
keys, wrong secrets and denied actions are refused as S3 refuses them. Users: `writer` (every S3
action), `reader` (get and list only) and `denied` (an explicit deny of every S3 action). Stopped
by its pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import free_ports

REGION = "us-east-1"
ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
DENY_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Action": "s3:*", "Resource": "*"}]}
# S3 authorises a listing (ListObjectsV2) as s3:ListBucket; moto from 5.2.6 asks for s3:ListObjectsV2: both named,
# so the reader may read and list under either, and nothing more.
READ_ONLY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket", "s3:ListObjectsV2", "s3:HeadObject",
                                   "s3:HeadBucket"], "Resource": "*"}]}


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # user -> (access key id, secret)

    @classmethod
    def start(cls, log: Path, host: str = "127.0.0.1") -> S3Server:
        """On `host`: 127.0.0.1, or the address of a private bridge a test made (tests/ray_hosts)."""
        (port,) = free_ports(1, host)
        server = Path(sys.executable).with_name("moto_server")
        with open(log, "wb") as out:
            process = subprocess.Popen([str(server), "-H", host, "-p", str(port)], stdout=out,
                                       stderr=subprocess.STDOUT)
        self = cls(f"http://{host}:{port}", process)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        iam = self._client("iam", "setup", "setup")
        for user, policy in (("writer", ALLOW_ALL), ("reader", READ_ONLY), ("denied", DENY_ALL)):
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName=user, PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            self.keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        # From here on every request is authenticated and authorised, as on S3.
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request, timeout=10).close()
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def env(self, user: str = "writer", **changes: str) -> dict[str, str]:
        """The standard AWS variables for `user` against this server, and nothing from the machine's own config."""
        key, secret = self.keys[user]
        env = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            # Never the machine's profiles, and never the instance metadata service (an address off this machine).
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        env.update(changes)
        return env

    def client(self, user: str = "writer"):
        return self._client("s3", *self.keys[user])

    def _client(self, service: str, key: str, secret: str):
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=key,
                            aws_secret_access_key=secret)

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys_under(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def read(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, body: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=body)
