"""The URL and path policy: what a data set's URL and the paths inside a data set may be, checked in one place.

- A data set URL names a folder in a store. It never carries credentials (`http://user:password@host`,
  `s3://KEY:SECRET@bucket`): they would end up in run records, bench JSON, logs and error messages. They come
  from the store's environment (AWS_*, GOOGLE_*, AZURE_*) or `storage_options`, held in memory only. A query string
  or fragment (a pre-signed token) is refused for the same reason.
- A path inside a data set (a shard, an index, a preview listed in dataset.json) is plain relative text with
  nothing a store or an HTTP client would decode or normalise: no percent escapes, no `.`/`..` or empty
  segments, no backslash, no `?`/`#`, no control characters, no scheme. What is checked is then exactly what is
  requested, on every protocol (an HTTP client turns `%2e%2e/other` into `../other`, and the server into
  `/other`: another prefix's data).
- `redact(text)` takes the secrets out of every URL or path in a text: the user:password@ of a URL, and the value
  of every query (or fragment) parameter, whatever its name: a pre-signed URL's token may be called anything
  (X-Amz-Signature, sig, password, passwd, ...). Every message the CLI prints goes through it, and so does every
  string written from SRC's rows and names (rejected.jsonl, a sample's path): a list row is text from outside.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from fastpipe.errors import ConfigError

# A scheme and its userinfo, up to the '@' that ends it: a secret may hold '/' (AWS secret keys do), which would end a
# URL's host part, and '@' (then every '@'-ended run without '/', '?' or '#' that follows is the secret's too). One
# slash is enough: a URL read as a path on disk ('https://a:b@h/x' as Path) keeps only one.
_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*:/+)(?P<info>[^\s@]*)@(?:[^\s@/?#]*@)*")
# A query or fragment: from '?' or '#' to a space, or to a closing quote (one followed by what follows a quoted string
# in a repr or JSON text: a quote inside a value is part of it).
_QUERY = re.compile(r"[?#](?:[^\s#'\"]|['\"](?![\s,\])}:]|$))*")
_PARAMETER = re.compile(r"(?P<key>(?:^[?#]|&)[^=&]*=)[^&]*")
_BAD_PATH = re.compile(r"[%\\?#\x00-\x1f\x7f]")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def redact(text: str) -> str:
    """`text` with the secrets of every URL or path in it replaced by ***: a URL's user:password@, and the value of
    every query and fragment parameter (`?X-Amz-Signature=***&X-Amz-Expires=***`). The same text again is unchanged."""
    text = _CREDENTIALS.sub(_hide, str(text))
    return _QUERY.sub(lambda q: _PARAMETER.sub(lambda m: f"{m['key']}***", q[0]), text)


def _hide(m: re.Match) -> str:
    # In hf://datasets/org/set@v2 the '@' names a revision: what comes before it is a path, not a user and password
    if m["scheme"].lower().startswith("hf:") and "/" in m["info"]:
        return m[0]
    return f"{m['scheme']}***@"


def holds_secret(text: str) -> bool:
    """Whether `text` holds what redact() takes out: a name that cannot be written as it is."""
    return redact(text) != text


# A data set repository on the Hugging Face Hub, at a revision (a branch, tag or commit; a pull request's
# refs/pr/N), and a folder in it. Names as the Hub allows them: letters, digits, '-', '_', '.', neither first nor
# last a '-' or '.', no '--' or '..' (so no name is '.' or '..').
_HUB_NAME = r"(?![\w.-]*(?:--|\.\.))[A-Za-z0-9_](?:[\w.-]*[A-Za-z0-9_])?"
HUB_URL = re.compile(rf"hf://datasets/(?P<repo>{_HUB_NAME}/{_HUB_NAME})(?:@(?P<revision>refs/pr/\d+|"
                     rf"(?!\.+(?:/|$))[\w.-]+))?(?P<path>(?:/[\w.-]+)*)/?")


def check_url(url: str, what: str = "URL") -> str:
    """A data set's URL, refused (with the credentials redacted) when it carries credentials, a query or a
    fragment, or has no place to point to."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "hf":
        return _check_hub(url, what)
    if "@" in url:  # in the host part, or after a secret holding '/': no store's folder name needs one
        raise ConfigError(f"{what} {redact(url)}: credentials in a URL are refused (they would be written into "
                          f"run folders, bench results and logs); give them through the store's environment "
                          f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
                          f"AZURE_STORAGE_CONNECTION_STRING, ...) or storage_options, and drop them from the URL")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ConfigError(f"{what} {redact(url)}: a data set URL names a folder; a query string or fragment (e.g. "
                          f"a pre-signed token) is refused: pass headers or tokens through storage_options")
    if (not parts.netloc and parts.scheme.lower() != "file") or re.search(r"[\s\x00-\x1f\x7f]", url):
        raise ConfigError(f"{what} {redact(url)}: expected SCHEME://HOST-OR-BUCKET/PREFIX, e.g. s3://bucket/sets/v1")
    return url


def _check_hub(url: str, what: str) -> str:
    m = HUB_URL.fullmatch(url)
    if not m or any(seg in (".", "..") for seg in m["path"].split("/")):
        raise ConfigError(f"{what} {redact(url)}: expected hf://datasets/ORG/NAME[@REVISION][/FOLDER] (a data set "
                          f"repository on the Hugging Face Hub; plain names, no query; the token comes from HF_TOKEN "
                          f"or `hf auth login`, never from the URL)")
    return url


def check_location(text, what: str = "data set"):
    """A folder or a URL as given: a URL is checked (check_url), a folder is returned as it is."""
    if isinstance(text, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        check_url(text, what)
    return text


def check_relative(rel, where: str) -> str:
    """A path inside a data set's folder as a store will request it: '/'-separated plain names, nothing that an
    HTTP client, a server or a store decodes or normalises. Raises ConfigError naming `where` otherwise."""
    problem = None
    if not isinstance(rel, str) or not rel:
        problem = "a non-empty relative path"
    elif rel.startswith("/") or _SCHEME.match(rel):
        problem = "a relative path (no leading /, no scheme)"
    elif _BAD_PATH.search(rel):
        problem = "plain names (no %-escapes, backslash, ?, # or control characters)"
    elif any(seg in ("", ".", "..") for seg in rel.split("/")):
        problem = "a path inside the data set's folder (no '.', '..' or empty segments)"
    if problem:
        raise ConfigError(f"{where} should be {problem} (holds {str(rel)[:80]!r})")
    return rel


__all__ = ["check_location", "check_relative", "check_url", "holds_secret", "redact"]


URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(text: str | os.PathLike, what: str) -> Path:
    """A local filesystem path; a URL (s3://, gs://, http://, pipe:...) is refused with a clear message instead
    of becoming a local folder named 's3:'."""
    s = os.fspath(text)
    if URL_RE.match(s) or s.startswith("pipe:"):
        raise ConfigError(f"{what} {redact(s)!r} is a URL: here a local folder is needed (a data set in object storage "
                          f"is read by train, bench and make_loader, and written by `shard SRC URL`); copy the data "
                          f"to a local disk (e.g. `aws s3 sync`, `gsutil -m rsync`) and pass that folder")
    return Path(s)
