"""Data sets on the Hugging Face Hub: `hf://datasets/ORG/NAME[@REVISION][/FOLDER]`, through `huggingface_hub`
(`pip install 'fastpipe[hf]'`).

Listing and metadata go through huggingface_hub's `HfFileSystem`; reads are fastpipe's own: one GET per byte range,
exactly the bytes asked (HfFileSystem's files read ahead a block, and retry 5xx by themselves), bounded in time
and size, so that `Remote` retries them as it retries every store's. Writing is one commit (`commit`): a converted
set appears on the Hub whole or not at all, and the repository's history gets one entry per conversion.

The token is huggingface_hub's own: HF_TOKEN or the local login (`hf auth login`), or `storage_options={"token":
...}`. fastpipe never writes it anywhere nor puts it in a message; the URL cannot hold one (urls.check_url).
The endpoint is HF_ENDPOINT's, read when a client is made (huggingface_hub reads it once, at import).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fastpipe.errors import ConfigError, DataError, MissingDependency
from fastpipe.store.urls import HUB_URL

WHOLE = 64 << 20  # bytes: the most a whole-object read asks for (remote.SMALL_OBJECT)


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise MissingDependency("hf:// data sets need huggingface_hub: pip install 'fastpipe[hf]'") from None
    return huggingface_hub


class HubError(DataError):
    """An HTTP error from the Hub or its CDN, named by the hf:// path and the status only (a CDN URL is signed)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status  # what clients.transient and clients.refused look at

    def __reduce__(self):
        return type(self), (str(self), self.status)


def parts(url: str) -> tuple[str, str | None, str]:
    """(repository id, revision or None, folder in the repository) of a checked hf:// URL."""
    m = HUB_URL.fullmatch(url.rstrip("/"))
    if not m:
        raise ConfigError(f"{url}: expected hf://datasets/ORG/NAME[@REVISION][/FOLDER]")
    return m["repo"], m["revision"], m["path"].strip("/")


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def open_hub(url: str, options: dict, timeout: float):
    """The filesystem client for `url` and its root path ("datasets/ORG/NAME[@REV][/FOLDER]")."""
    fs_class = _fs_class()
    fs = fs_class(endpoint=endpoint(), token=options.get("token"), skip_instance_cache=True)
    fs.read_timeout = timeout
    fs.min_rate = float(os.environ.get("FASTPIPE_REMOTE_MIN_RATE", 1 << 20))  # as Remote's deadline
    return fs, url.split("://", 1)[1].rstrip("/")


def _fs_class():
    hub = _hub()

    class HubFileSystem(hub.HfFileSystem):
        """HfFileSystem whose reads are single exact GETs (see the module's docstring). Where the Hub sends a file
        elsewhere (its LFS files to a CDN, by a signed URL), that URL is kept and asked directly, without the token,
        until it expires: a shard's ranges cost one request to the Hub's resolver, not one each (the Hub limits
        resolver requests per user)."""

        read_timeout, min_rate = 60.0, float(1 << 20)

        def cat_file(self, path, start=None, end=None, **kwargs):
            """Bytes [start, end); start None: from 0 (Remote asks a whole object as [0, its size limit + 1))."""
            if end is None:
                end = WHOLE + 1
            if start is not None and end <= start:
                return b""
            span = {"range": f"bytes={start or 0}-{end - 1}"}
            direct = self.__dict__.setdefault("_direct", {}).get(path)
            if direct is not None:
                try:
                    return self._get(direct, span, path, start, end)
                except PermissionError:  # expired: ask the Hub again
                    self._direct.pop(path, None)
            url = self.url(path)  # resolves the repository and revision (cached per client)
            return self._get(url, {**self._api._build_hf_headers(), **span}, path, start, end, remember=True)

        def _get(self, url: str, headers: dict, path: str, start, end, remember: bool = False) -> bytes:
            want = end - (start or 0)
            deadline = time.monotonic() + self.read_timeout + want / self.min_rate  # a trickle is cut off too
            # httpx drops the token on a redirect to another host, and a kept URL is asked without it
            with hub.utils.get_session().stream("GET", url, headers=headers, timeout=self.read_timeout,
                                                follow_redirects=True) as r:
                if r.status_code == 416 and not start:
                    return b""  # an empty object
                if r.status_code == 404:
                    raise FileNotFoundError(path)
                if r.status_code in (401, 403) and not remember:
                    raise PermissionError(r.status_code)
                if r.status_code in (401, 403):
                    raise HubError(f"hf://{path}: the Hub refuses it (HTTP {r.status_code}): a private or gated "
                                   f"repository needs a token with access (HF_TOKEN, or hf auth login), and a gated "
                                   f"one its terms accepted on its Hub page", r.status_code)
                if r.status_code >= 400 or (start and r.status_code != 206):
                    raise HubError(f"hf://{path}: the Hub answers HTTP {r.status_code}"
                                   + (" to a byte range (it should be 206)" if r.status_code < 400 else ""),
                                   r.status_code if r.status_code >= 400 else 502)
                if remember and str(r.url) != url:
                    self._direct[path] = str(r.url)
                chunks, got = [], 0
                for chunk in r.iter_bytes():
                    got += len(chunk)
                    if got > want:
                        raise DataError(f"hf://{path}: the server sends more than the {want} bytes asked")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"hf://{path}: no complete answer within {deadline:.0f} s")
                    chunks.append(chunk)
            return b"".join(chunks)

    return HubFileSystem


def check_writable(url: str, options: dict, retry) -> None:
    """The repository exists and the token may write to it: said before any conversion work. `retry`: Remote's."""
    hub = _hub()
    repo, _, _ = parts(url)
    api = hub.HfApi(endpoint=endpoint(), token=options.get("token"))
    try:
        retry(lambda: api.auth_check(repo, repo_type="dataset", write=True), url)
    except DataError as e:  # RemoteError, with the Hub's error as its cause
        status = getattr(getattr(e.__cause__, "response", None), "status_code", None)
        if isinstance(e.__cause__, hub.errors.RepositoryNotFoundError):
            raise DataError(f"{url}: no data set repository {repo} that this token may see; create it first "
                            f"(`hf repos create {repo} --repo-type dataset`), or check HF_TOKEN / `hf auth login`"
                            ) from None
        if status in (401, 403):
            raise DataError(f"{url}: this token may not write to {repo} (HTTP {status}); set HF_TOKEN to a token "
                            f"with write access, or `hf auth login`") from None
        raise DataError(f"cannot write to {url} (nothing was converted yet): {e}") from None


def commit(url: str, files: list[tuple[Path, str]], message: str, options: dict, retry, staging: Path,
           remove: list[str] = ()) -> str:
    """Every (local file, path relative to the URL's folder) in one commit, and the paths in `remove` deleted in
    it; returns the commit's id. A failure says that the converted files are kept in `staging` for the same
    command to upload again."""
    hub = _hub()
    repo, revision, folder = parts(url)
    ops = [hub.CommitOperationAdd(path_in_repo="/".join(filter(None, [folder, rel])), path_or_fileobj=str(local))
           for local, rel in files]
    ops += [hub.CommitOperationDelete(path_in_repo="/".join(filter(None, [folder, rel]))) for rel in remove]
    api = hub.HfApi(endpoint=endpoint(), token=options.get("token"))
    try:
        info = retry(lambda: api.create_commit(repo, ops, commit_message=message, repo_type="dataset",
                                               revision=revision), url)
    except DataError as e:
        raise DataError(f"uploading to {url} failed: {e}; the converted files are kept in {staging}: run the same "
                        f"command again to upload them") from None
    return info.oid


def pinned(url: str, options: dict) -> str:
    """`url` at the commit its revision names now (hf://datasets/ORG/NAME@SHA/FOLDER): what an index of shards
    in someone else's repository records, so that their next push does not change what it describes."""
    hub = _hub()
    repo, revision, folder = parts(url)
    info = hub.HfApi(endpoint=endpoint(), token=options.get("token")).dataset_info(repo, revision=revision)
    return f"hf://datasets/{repo}@{info.sha}" + (f"/{folder}" if folder else "")


__all__ = ["HubError", "check_writable", "commit", "endpoint", "open_hub", "parts", "pinned"]
