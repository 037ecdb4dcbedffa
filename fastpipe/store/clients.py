"""The store clients: an fsspec filesystem for a URL, with fastpipe's timeouts and the client's own retries off.

`store.remote.Remote` retries every request itself: bounded, with jitter, counted in `loader.stats`, ending in an
error that names the URL and byte range. Each store's client has a retry loop of its own, longer and silent:
botocore and s3fs count attempts; gcsfs makes 6, sleeping about 1, 2, 4, 8 and 16 s between them, its count
fixed when its class is defined; the Azure SDK retries 3 times after about 15, 18 and 24 s. Stacked under ours
they multiply the attempts and hide them, so each is switched off here, where the client is made; and each gets
the same connect and read timeout, so that a read that stalls fails in `timeout` seconds on every store.

Also here, as each client reports them: which errors are worth another try (`transient`), which mean the
credentials were refused or missing (`refused`), and a read held to a size limit whatever the server sends
(`cat_bounded`).

An http(s) client follows a redirect only within the origin it asked (scheme, host and port), at most
MAX_REDIRECTS hops: a server that sends a request elsewhere (`CrossOriginRedirect`) would have another host serve the
photos, lists, manifests and shards that this one was trusted for, and would learn what is read.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import types

from fastpipe.errors import ConfigError, DataError, MissingDependency
from fastpipe.store import hub
from fastpipe.store.urls import redact

PROTOCOL_EXTRAS = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs",
                   "http": "aiohttp", "https": "aiohttp", "hf": "fastpipe[hf]"}
FAMILY = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "https": "http"}
GCSFS_RETRYING = ("_request", "_get_file_request", "_get_file_concurrent")  # gcsfs's @retry_request methods
STORE_VARIABLES = ("AWS_", "AZURE_", "GOOGLE_", "GCSFS_", "STORAGE_EMULATOR_HOST", "HF_")  # what the clients read
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}  # 409 is S3's "operation aborted, try again"
MAX_REDIRECTS = 5  # hops an http(s) request may take, each within its origin
# Errors of a client's own making, which no retry changes: huggingface_hub's offline mode (HF_HUB_OFFLINE), an HTTP
# request the client itself finds malformed (an empty token's header), an unsupported scheme
NEVER_AGAIN = {"OfflineModeIsEnabled", "LocalProtocolError", "UnsupportedProtocol", "InvalidURL"}


def store_environment() -> dict[str, str]:
    """The variables the store clients read (credentials and endpoints), as they are now."""
    return {k: v for k, v in os.environ.items() if k.startswith(STORE_VARIABLES)}


def open_fs(url: str, options: dict, timeout: float):
    """The fsspec filesystem and root path for `url`, with bounded timeouts and the client's own retries off."""
    try:
        import fsspec.core
    except ImportError as e:
        raise MissingDependency("remote data sets need fsspec: pip install fsspec") from e
    protocol = url.split("://", 1)[0].lower()
    family = FAMILY.get(protocol, protocol)
    if family == "hf":
        return hub.open_hub(url, options, timeout)
    opts = copy.deepcopy(options)  # the defaults below go into nested dicts: not into the caller's
    if family in _OPTIONS:
        _OPTIONS[family](opts, timeout)
    try:
        if family == "gs" and os.environ.get("STORAGE_EMULATOR_HOST"):
            fs, root = _plain_gcsfs(url, opts)
        else:
            fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **opts)  # a client of our own (Remote)
    except ImportError as e:
        extra = PROTOCOL_EXTRAS.get(protocol, f"the fsspec implementation for {protocol}://")
        raise MissingDependency(f"{url}: reading {protocol}:// needs {extra}: pip install {extra}") from e
    except ValueError as e:
        raise ConfigError(f"{url}: {e}") from e
    if family in _RETRIES_OFF:
        _RETRIES_OFF[family](fs)
    return fs, root


def _aiohttp_timeout(timeout: float):
    import aiohttp

    # no total: a 64 MB range on a slow link may take minutes while bytes keep coming
    return aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)


def _http_options(opts: dict, timeout: float) -> None:
    client = opts.setdefault("client_kwargs", {})
    client.setdefault("timeout", _aiohttp_timeout(timeout))
    client["trace_configs"] = [*client.get("trace_configs", ()), _same_origin_only()]  # every request of the client
    # aiohttp counts the redirect that fails: one more lets MAX_REDIRECTS be followed
    opts["max_redirects"] = min(int(opts.get("max_redirects", MAX_REDIRECTS)), MAX_REDIRECTS) + 1


class CrossOriginRedirect(DataError):
    """A server's redirect to another origin (scheme, host, port), refused before anything is asked of it. `asked`
    and `target`, redacted: what a caller that refuses one object only (a photo of a list) names."""

    def __init__(self, asked: str, target: str):
        self.asked, self.target = redact(asked), redact(target)
        super().__init__(f"{self.asked} redirects to {self.target}, another origin (scheme, host, port): refused, "
                         f"redirects are followed within one origin only; give the URL the data is served from")

    def __reduce__(self):  # from a worker process, with both URLs (the default would call __init__(message))
        return type(self), (self.asked, self.target)


def origin(url) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a yarl URL, the port given or the scheme's own: http://h and http://h:80 are one."""
    return (url.scheme.lower(), (url.host or "").lower(), url.port)


def _same_origin_only():
    """aiohttp's hook before each redirect is followed: one that leaves the origin of the URL asked raises instead
    (aiohttp closes the answer and follows nothing), naming both URLs."""
    import aiohttp
    from yarl import URL

    async def on_redirect(session, context, params) -> None:
        answer = params.response.headers
        location = answer.get("Location") or answer.get("URI") or ""
        try:
            target = params.url.join(URL(location))
            same = origin(target) == origin(params.url) and target.is_absolute()
        except ValueError:
            target, same = location, False
        if not same:
            raise CrossOriginRedirect(str(params.url), str(target))

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(on_redirect)
    return trace


def _s3_options(opts: dict, timeout: float) -> None:
    cfg = opts.setdefault("config_kwargs", {})
    cfg.setdefault("connect_timeout", timeout)
    cfg.setdefault("read_timeout", timeout)
    cfg.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    if os.environ.get("AWS_ENDPOINT_URL") and "endpoint_url" not in opts.get("client_kwargs", {}):
        opts.setdefault("client_kwargs", {})["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]


def _gs_options(opts: dict, timeout: float) -> None:
    opts.setdefault("requests_timeout", _aiohttp_timeout(timeout))
    if os.environ.get("STORAGE_EMULATOR_HOST"):  # Google's variable for a local GCS server (tests, CI)
        # an emulator needs no credentials: without this gcsfs looks for them first, the cloud's metadata server
        # included
        opts.setdefault("token", "anon")


def _plain_gcsfs(url: str, opts: dict):
    """gcsfs's JSON-API client for an emulator. gcsfs >= 2025 hands out, by default, a client that first asks
    each bucket's type over gRPC, which an emulator does not speak: it waited 60 s per bucket before falling back
    (seen with gcp-storage-emulator). Its switch (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT) is read once, at import."""
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem(skip_instance_cache=True, **opts), GCSFileSystem._strip_protocol(url)


def _az_options(opts: dict, timeout: float) -> None:
    opts.setdefault("connection_timeout", timeout)
    opts.setdefault("read_timeout", timeout)


def _s3_retries_off(fs) -> None:
    if hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own loop, on top of botocore's (set to 1 attempt above)


def _gs_retries_off(fs) -> None:
    # gcsfs wraps these in @retry_request(retries=6) at class definition: the instance gets the plain methods.
    # A gcsfs without them (renamed in a later release) keeps its own retries under ours: slower, still bounded.
    for name in GCSFS_RETRYING:
        method = getattr(type(fs), name, None)
        if hasattr(method, "__wrapped__"):
            setattr(fs, name, types.MethodType(method.__wrapped__, fs))


def _az_retries_off(fs) -> None:
    # The Azure SDK reads these from its policy object at each request (a request may override them; adlfs's
    # don't); the policy is shared by every container and blob client made from this service client.
    policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
    for name in ("total_retries", "connect_retries", "read_retries", "status_retries"):
        if isinstance(getattr(policy, name, None), int):
            setattr(policy, name, 0)


def transient(e: BaseException) -> bool:
    """Worth another try: a 5xx or throttling status, a reset or refused connection, a timeout. Not: a missing
    object, a refused credential, a bad request."""
    status = _status(e)
    if status is not None:
        return status in RETRY_STATUS
    if refused(e) or isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    if type(e).__name__ in NEVER_AGAIN:  # the same request would meet the same refusal
        return False
    if isinstance(e, (TimeoutError, asyncio.TimeoutError, ConnectionError, OSError)):
        return True
    return type(e).__module__.split(".")[0] in ("aiohttp", "botocore", "urllib3", "requests", "google", "azure",
                                                      "httpx", "httpx2", "httpcore")


def refused(e: BaseException) -> bool:
    """The store said no to these credentials, or there are none: retrying will not change that."""
    if isinstance(e, PermissionError) or _status(e) in (401, 403):
        return True
    if "Credential" in type(e).__name__ or "Authentication" in type(e).__name__:  # botocore, google-auth, Azure
        return True
    return type(e) is OSError and str(e).startswith("Forbidden")  # gcsfs's 403 is a plain OSError


def brief(e: BaseException) -> str:
    """The first line of a store's error (the Azure SDK's go on with request ids and headers); fastpipe's own verdict
    on an answer (a redirect elsewhere: both URLs) in full."""
    return str(e) if isinstance(e, DataError) else (str(e).strip().splitlines() or [""])[0][:200]


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status", None)  # aiohttp
    if status is None:
        status = getattr(e, "status_code", None)  # the Azure SDK (HttpResponseError)
    if status is None and type(e).__module__.startswith("gcsfs"):
        status = getattr(e, "code", None)  # gcsfs.retry.HttpError
    response = getattr(e, "response", None)  # botocore's a dict, huggingface_hub's an HTTP response
    if status is None and isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    elif status is None and response is not None:
        status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


class ObjectTooLarge(DataError):
    """A store answered with more bytes than were asked for, or than a small object may have."""


async def cat_bounded(fs, path: str, start: int | None, end: int | None, limit: int) -> bytes:
    """Bytes [start, end) of `path`, or (start None) the whole object, never more than `limit` bytes: a whole object
    is asked for as the range [0, limit], and a store that sends more (an HTTP server ignoring Range, an endless
    body) is cut off as soon as it does, not read into memory."""
    if getattr(fs, "protocol", None) in (("http", "https"), "http", "https") or type(fs).__name__ == "HTTPFileSystem":
        return await _http_cat(fs, path, start, end, limit)
    try:
        data = await fs._cat_file(path, start=0 if start is None else start, end=limit + 1 if end is None else end)
    except Exception as e:
        if start is None and _unsatisfiable(e):  # the range [0, limit] of an empty object
            return b""
        raise
    if len(data) > limit:
        raise ObjectTooLarge(f"{len(data)} bytes or more, over the limit of {limit}")
    return data


def _unsatisfiable(e: BaseException | None) -> bool:
    """HTTP 416, as each store's client reports it (s3fs turns botocore's into an OSError, the cause kept)."""
    while e is not None:
        response = getattr(e, "response", None)
        codes = (getattr(e, "status", None), getattr(e, "status_code", None), getattr(e, "code", None),
                 response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None)
        if 416 in codes or "InvalidRange" in str(e) or "range is not satisfiable" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


async def _http_cat(fs, url: str, start: int | None, end: int | None, limit: int) -> bytes:
    """fsspec's HTTP read, with the size checked before the body is read (Content-Length) and while it is."""
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    if start is not None:
        headers["Range"] = f"bytes={start}-{end - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
        fs._raise_not_found_for_status(r, url)
        if r.status not in (200, 206):  # a redirect without a Location: its page is not the object
            raise DataError(f"{redact(url)}: the server answers {r.status} {r.reason or ''}, not the object")
        if r.content_length is not None and r.content_length > limit:
            raise ObjectTooLarge(f"the server announces {r.content_length} bytes, over the limit of {limit}"
                                 + (" (it ignores Range requests)" if start is not None else ""))
        chunks, got = [], 0
        async for chunk in r.content.iter_any():
            got += len(chunk)
            if got > limit:
                raise ObjectTooLarge(f"the server sends more than the limit of {limit} bytes")
            chunks.append(chunk)
    return b"".join(chunks)


_OPTIONS = {"http": _http_options, "s3": _s3_options, "gs": _gs_options, "az": _az_options}
_RETRIES_OFF = {"s3": _s3_retries_off, "gs": _gs_retries_off, "az": _az_retries_off}


def installed_protocols() -> dict[str, bool]:
    """Which remote protocols this environment can read (for `fastpipe doctor`)."""
    return {p: importlib.util.find_spec(m) is not None
            for p, m in (("s3", "s3fs"), ("gs", "gcsfs"), ("az", "adlfs"), ("http", "aiohttp"),
                         ("hf", "huggingface_hub"))}


__all__ = ["MAX_REDIRECTS", "PROTOCOL_EXTRAS", "CrossOriginRedirect", "ObjectTooLarge", "brief", "cat_bounded",
           "installed_protocols", "open_fs", "origin", "refused", "store_environment", "transient"]
