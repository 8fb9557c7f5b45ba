"""Files on a store: `s3://bucket/key`, or any URI that pyarrow or fsspec knows, beside local paths.

A local path stays a `pathlib.Path` and takes exactly the code path it always took. A URI becomes a
StorePath, which offers the part of Path's interface klpipe uses (`name`, `parent`, `/`,
`with_name`, `exists`, `is_file`, `is_dir`, `iterdir`, `stat`, `read_text`, `unlink`), so finding
inputs, default output names, shard parts and their markers work on a store with no code of
their own. What differs lives here (resolving a URI, reading), in store_errors.py (a store's failures as one
line), download.py (local copies, for readers that need them) and upload.py (writing, which must
never leave half an object under a final name).

The filesystem behind a URI is pyarrow's own where pyarrow has one (s3, gs, hdfs, abfs), else
fsspec's for that protocol (with its package installed), wrapped for pyarrow: one code path
either way. Credentials and the endpoint come from where those libraries look; for S3 that is the
standard AWS chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and
~/.aws/config and credentials, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (an S3-compatible store),
AWS_REGION.

Every failure of a store becomes one line naming the URI (StoreError, store_errors.py).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeAlias, TypeGuard

import pyarrow as pa
import pyarrow.fs as pafs

from klpipe.errors import InputError, StoreError, first_line
from klpipe.storage.store_errors import StoreOrInputError, missing, store_error

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from 3.13; only the type checker reads it

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_GLOB_CHARACTERS = re.compile(r"[*?\[]")

# Stores whose objects become visible only once their upload completes, whole (upload.py relies on
# it); pyarrow's type names, and the fsspec protocols of the same stores.
OBJECT_STORES = frozenset({"s3", "gcs", "abfs"})
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


class StoreStat(NamedTuple):
    """What `Path.stat()` answers that klpipe reads, for an object on a store."""

    st_size: int
    st_mtime: float


class StorePath:
    """A file or directory (a prefix) on a store, named by its URI: the part of pathlib.Path klpipe uses.

    Equal, hashed and sorted by URI; `str()` is the URI, which every message names. Listing a
    directory hands out children that remember what the listing said about them, so filtering a
    directory's files costs no request per file.
    """

    __slots__ = ("_info", "_rest", "_root", "uri")

    def __init__(self, uri: str, *, _root: str | None = None, _rest: str | None = None,
                 _info: pafs.FileInfo | None = None):
        match = _SCHEME.match(uri)
        if match is None:
            raise InputError(f"{uri}: not a URI")
        scheme, rest = match.group(1).lower(), uri[match.end():].rstrip("/")
        netloc = rest.split("/", 1)[0]
        if not netloc:
            raise InputError(f"{uri}: names no bucket or host")
        self.uri = f"{scheme}://{rest}"
        self._root = _root or f"{scheme}://{netloc}"  # one filesystem per bucket (or host)
        # The path below the bucket, decoded as pyarrow decodes URIs; the filesystem is only resolved
        # (for S3 without an endpoint, a request for the bucket's region) when it is first needed.
        self._rest = urllib.parse.unquote(rest[len(netloc):]) if _rest is None else _rest
        self._info = _info

    # -- names: no request --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.uri.rsplit("/", 1)[1] if self.uri != self._root else self.uri.split("://", 1)[1]

    @property
    def root(self) -> StorePath:
        """The bucket (or host) itself."""
        return self if self.uri == self._root else StorePath(self._root, _rest="")

    @property
    def parent(self) -> StorePath:
        if self.uri == self._root:
            return self
        return StorePath(self.uri.rsplit("/", 1)[0], _root=self._root, _rest=self._rest.rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(f"{self.uri}/{name}", _root=self._root, _rest=f"{self._rest}/{name}")

    def with_name(self, name: str) -> StorePath:
        return self.parent / name

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"StorePath({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __lt__(self, other: StorePath) -> bool:
        return self.uri < other.uri

    # -- what pyarrow needs to open it ------------------------------------------------------------

    @property
    def filesystem(self) -> pafs.FileSystem:
        return _filesystem(self._root)

    @property
    def fs_path(self) -> str:
        """The path inside `filesystem` (`bucket/key` on S3)."""
        return _root_path(self._root) + self._rest

    # -- questions: a request each (a listed child answers from its listing) ----------------------

    def info(self) -> pafs.FileInfo:
        if self._info is None:
            try:
                return self.filesystem.get_file_info(self.fs_path)
            except OSError as exc:
                raise store_error(self, exc) from None
        return self._info

    def exists(self) -> bool:
        return bool(self.info().type != pafs.FileType.NotFound)

    def is_file(self) -> bool:
        return bool(self.info().type == pafs.FileType.File)

    def is_dir(self) -> bool:
        return bool(self.info().type == pafs.FileType.Directory)

    def stat(self) -> StoreStat:
        info = self.info()
        if info.type != pafs.FileType.File:
            raise missing(self)
        return StoreStat(info.size, info.mtime.timestamp() if info.mtime else 0.0)

    def iterdir(self) -> Iterator[StorePath]:
        yield from self._list(recursive=False)

    def walk_files(self) -> list[StorePath]:
        """Every file under this prefix, at any depth, sorted."""
        return sorted(p for p in self._list(recursive=True) if p.is_file())

    def _list(self, recursive: bool) -> list[StorePath]:
        try:
            infos = self.filesystem.get_file_info(pafs.FileSelector(self.fs_path, recursive=recursive))
        except FileNotFoundError:
            raise missing(self) from None
        except OSError as exc:
            raise store_error(self, exc) from None
        base = len(_root_path(self._root))
        return [StorePath(f"{self._root}{info.path[base:]}", _root=self._root, _rest=info.path[base:], _info=info)
                for info in infos]

    # -- contents -----------------------------------------------------------------------------------

    def open_input_file(self) -> pa.NativeFile:
        """A pyarrow random-access file; its `metadata()` holds what the store says about the object."""
        try:
            return self.filesystem.open_input_file(self.fs_path)
        except FileNotFoundError:
            raise missing(self) from None
        except OSError as exc:
            raise store_error(self, exc) from None

    def read_bytes(self) -> bytes:
        with self.open_input_file() as stream:
            try:
                contents: bytes = stream.read()
            except OSError as exc:
                raise store_error(self, exc) from None
        return contents

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.filesystem.delete_file(self.fs_path)
        except FileNotFoundError:
            if not missing_ok:
                raise missing(self) from None
        except OSError as exc:
            raise store_error(self, exc) from None

    def object_metadata(self) -> dict[str, str]:
        """What the store says about the object without reading it (S3: ETag, Last-Modified, Content-Length)."""
        with self.open_input_file() as stream:
            return {_text(key): _text(value) for key, value in (stream.metadata() or {}).items()}

    def appears_whole(self) -> bool:
        """True on an object store, where a written object becomes visible only once its upload completes."""
        fs = self.filesystem
        if fs.type_name in OBJECT_STORES:
            return True
        handler = getattr(fs, "handler", None)  # fsspec's, wrapped
        protocol = getattr(getattr(handler, "fs", None), "protocol", ())
        protocols = {protocol} if isinstance(protocol, str) else set(protocol)
        return bool(protocols & OBJECT_STORE_PROTOCOLS)


Location: TypeAlias = Path | StorePath


# -- resolving ----------------------------------------------------------------------------------------


def location(raw: str | os.PathLike[str] | StorePath) -> Location:
    """A local Path, or a StorePath for a URI (`file://` URIs are local paths)."""
    if isinstance(raw, (StorePath, Path)):
        return raw
    name = os.fspath(raw)
    match = _SCHEME.match(name)
    if match is None:
        return Path(name)
    if match.group(1).lower() == "file":
        return Path(urllib.parse.unquote(urllib.parse.urlparse(name).path))
    return StorePath(name)


def is_remote(path: object) -> TypeIs[StorePath]:
    return isinstance(path, StorePath)


def is_glob(path: Location) -> TypeGuard[StorePath]:
    """A URI with `*`, `?` or `[` in it: a pattern klpipe expands (the shell expands local ones)."""
    return is_remote(path) and bool(_GLOB_CHARACTERS.search(path.uri))


def expand(raw: str | os.PathLike[str] | StorePath) -> list[Location]:
    """The locations `raw` names: a URI pattern's matching files, sorted; anything else, itself.

    A pattern matches one path component per component, as a shell's does (`*` never crosses a
    `/`); the listing starts at the longest prefix without a wildcard.
    """
    path = location(raw)
    if not is_glob(path):
        return [path]
    parts = path.uri.split("/")  # scheme:, "", bucket, key components...
    fixed = next(i for i, part in enumerate(parts) if _GLOB_CHARACTERS.search(part))
    if fixed < 3:
        raise InputError(f"{path}: a pattern cannot be in the bucket (or host) name; list the buckets one by one")
    base = StorePath("/".join(parts[:fixed]))
    pattern = parts[fixed:]
    if not base.exists():
        raise missing(path)
    matches: list[Location] = []
    for candidate in base.walk_files():
        rest = candidate.uri[len(base.uri) + 1:].split("/")
        if len(rest) == len(pattern) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(rest, pattern, strict=True)):
            matches.append(candidate)
    if not matches:
        raise InputError(f"{path}: no file matches this pattern")
    return matches


def identity(path: Location) -> str:
    """What two names of one file have in common: the URI, or the resolved local path."""
    return path.uri if isinstance(path, StorePath) else str(path.resolve())


def check_output(path: Location) -> None:
    """Refuse, before any work, an output on a store whose bucket (or host) does not exist.

    Writing is only tried at the end, so this is what keeps hours of compute from ending in `no
    such bucket`; an unreachable store or refused credentials fail here too. Credentials allowed to
    write under a prefix but not to look at the bucket pass: write permission itself cannot be
    tested without writing, and shows at the upload.
    """
    if not is_remote(path):
        return
    root = path.root
    try:
        missing_bucket = not root.exists()
    except StoreError as exc:
        if "access denied" not in str(exc):
            raise StoreError(str(exc).replace(root.uri, path.uri, 1)) from None
        return
    if missing_bucket:
        raise StoreError(f"{path}: no such bucket {root.name!r}")


def staging_dir() -> Path:
    """The local directory where a file bound for a store is written first: $TMPDIR, else the system's."""
    return Path(tempfile.gettempdir())


def store_failure(path: str | Location, exc: BaseException) -> StoreOrInputError | None:
    """For an error met while reading `path`: the error to raise when the store itself failed (not the
    file's contents), else None, and the caller says what is wrong with the file."""
    if not is_remote(path):
        return None
    if isinstance(exc, FileNotFoundError):
        return missing(path)
    if "AWS Error" in first_line(exc):
        return store_error(path, exc)
    return None



# -- filesystems --------------------------------------------------------------------------------------


@functools.cache
def _resolve(root: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, the path of `root` in it) for `scheme://netloc`: pyarrow's, else fsspec's, wrapped."""
    try:
        filesystem, path = pafs.FileSystem.from_uri(root)
        return filesystem, path
    except OSError as exc:  # pyarrow knows the scheme but cannot set it up (S3 resolving a bucket's region)
        raise store_error(StorePath(root, _rest=""), exc) from None
    except pa.ArrowNotImplementedError as exc:  # a pyarrow built without this filesystem (S3, GCS, HDFS)
        raise InputError(f"{root}: this pyarrow cannot open such URIs ({first_line(exc)}); pyarrow's wheels "
                         "from PyPI can") from None
    except pa.ArrowInvalid as exc:  # a scheme pyarrow does not know
        if "Unrecognized filesystem type" not in str(exc):
            raise InputError(f"{root}: not a store URI pyarrow understands ({first_line(exc)})") from None
    try:
        import fsspec
    except ImportError:
        raise InputError(f"{root}: pyarrow has no filesystem for this scheme, and fsspec (which might) is not "
                         "installed") from None
    try:
        fs, path = fsspec.core.url_to_fs(root)
    except (ImportError, ValueError) as exc:
        raise InputError(f"{root}: no filesystem for this scheme ({first_line(exc)})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _filesystem(root: str) -> pafs.FileSystem:
    return _resolve(root)[0]


def _root_path(root: str) -> str:
    return _resolve(root)[1].rstrip("/")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
