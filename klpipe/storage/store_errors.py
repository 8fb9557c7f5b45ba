"""One line naming the URI for every failure of a store (StoreError), from what pyarrow or fsspec said.

A missing bucket or key, credentials the store does not accept, access denied, an endpoint that
cannot be reached: each is told as such, with the environment variable to check. store.py raises
these, and this module sits below it: it reads a store's path only through the few members named in
`Located`, so it imports nothing from store.py.
"""

from __future__ import annotations

import os
import re
from typing import Protocol, TypeAlias

import pyarrow.fs as pafs

from klpipe.errors import InputError, StoreError, first_line


class Located(Protocol):
    """What an error here reads of a path on a store (store.StorePath has it all): no request but `exists`."""

    uri: str

    @property
    def name(self) -> str: ...

    @property
    def root(self) -> Located: ...

    @property
    def filesystem(self) -> pafs.FileSystem: ...

    @property
    def fs_path(self) -> str: ...

    def exists(self) -> bool: ...


def missing(path: Located) -> StoreOrInputError:
    """`no such file`, or `no such bucket` when it is the bucket that is missing (one more request, on this path
    only)."""
    root = path.root
    try:
        bucket_missing = path.uri != root.uri and not root.exists()
    except StoreError:
        bucket_missing = False
    if bucket_missing:
        return StoreError(f"{path}: no such bucket {root.name!r}")
    return InputError(f"{path}: no such file or directory")


StoreOrInputError: TypeAlias = InputError | StoreError


# AWS SDK error names (in pyarrow's messages) → what to tell the user.
_AWS_ERRORS = {
    "NO_SUCH_BUCKET": "no such bucket {bucket!r}",
    "INVALID_ACCESS_KEY_ID": "the store does not accept these credentials: the access key is unknown "
                             "(check AWS_ACCESS_KEY_ID or AWS_PROFILE)",
    "SIGNATURE_DOES_NOT_MATCH": "the store does not accept these credentials: the secret key does not match "
                                "(check AWS_SECRET_ACCESS_KEY or AWS_PROFILE)",
    "INVALID_CLIENT_TOKEN_ID": "the store does not accept these credentials (check AWS_ACCESS_KEY_ID or AWS_PROFILE)",
    "EXPIRED_TOKEN": "the credentials have expired (AWS_SESSION_TOKEN or the profile's)",
    "MISSING_AUTHENTICATION_TOKEN": "no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
    "ACCESS_DENIED": "access denied: these credentials may not do this here",
    "NETWORK_CONNECTION": "cannot reach the store{endpoint} (check AWS_ENDPOINT_URL and the network)",
}


def store_error(path: Located, exc: BaseException | str) -> StoreError:
    """One line naming the URI for a failure of the store, from pyarrow's (or fsspec's) message."""
    text = exc if isinstance(exc, str) else first_line(exc)
    code = re.search(r"AWS Error ([A-Z_]+)", text)
    name = code.group(1) if code else None
    if name == "ACCESS_DENIED" and "HeadObject" in text:
        # S3 answers HEAD with a bare 403, for refused credentials as for a refused permission; a
        # listing says which (one more request, on this error path only).
        name = _diagnose_denied(path) or name
    if name in _AWS_ERRORS:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        message = _AWS_ERRORS[name].format(bucket=path.root.name,
                                           endpoint=f" at {endpoint}" if endpoint else "")
        return StoreError(f"{path}: {message}")
    # Anything else: the library's own words, less request ids and the "When doing X for key Y" preamble.
    text = re.sub(r"\s*\(Request ID: [^)]*\)?", "", text)
    text = re.sub(r"^When [^:]*: ", "", text)
    return StoreError(f"{path}: store error ({text.strip()})")


def _diagnose_denied(path: Located) -> str | None:
    try:
        path.filesystem.get_file_info(pafs.FileSelector(path.fs_path, allow_not_found=True))
    except OSError as exc:
        code = re.search(r"AWS Error ([A-Z_]+)", first_line(exc))
        return code.group(1) if code else None
    return None

