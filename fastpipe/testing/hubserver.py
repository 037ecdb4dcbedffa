"""A loopback server that answers the Hugging Face Hub's HTTP API as `huggingface_hub` calls it, for data set
repositories held in memory: revision info, tree listing, paths-info, resolve (with Range), the write permission
check, preupload and commit. `huggingface_hub` is pointed at it with HF_ENDPOINT.

For the tests and the benchmarks, as devserver.py is for plain HTTP: real sockets, real requests, no network. Every
request is recorded (method, path, the Range asked, the bytes sent, and whether it carried the expected token), so
that a test can count the bytes a reader fetched and check that a token went only where it should. With `token`
set, every request must carry it (`Authorization: Bearer TOKEN`): the others get 401, as a private repository's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)$")
REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
LFS = (".tar", ".npz", ".jpg", ".parquet")  # files the Hub stores in LFS (by their attributes), with a sha256


@dataclass
class Repo:
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)  # each commit's title, oldest first
    read_only: bool = False  # the token may read it, not write it (someone else's repository)
    sha: str = ""  # the head commit's id

    def commit(self, title: str) -> str:
        self.commits.append(title)
        self.sha = hashlib.sha1(f"{len(self.commits)} {title}".encode()).hexdigest()
        return self.sha


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int  # bytes of the answer's body
    authorised: bool  # carried the server's token (always True when the server has none)


class Hub:
    """The repositories (data sets only) and the requests answered, shared by the handler threads."""

    def __init__(self, token: str | None = None, latency: float = 0.0, cdn: bool = False):
        self.token, self.lock, self.latency = token, threading.Lock(), latency  # latency: seconds added to each answer
        # cdn: the Hub's resolve sends each .tar to a signed URL on another server (as the real Hub sends LFS files to
        # its CDN), valid while `signature` is unchanged (change it: the URLs it gave expire)
        self.cdn, self.cdn_url, self.signature = cdn, "", "s1"
        self.refuse_commits = False  # answer every commit 500 (a Hub failing after the work is done)
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []

    def create(self, repo_id: str, files: dict[str, bytes] | None = None) -> Repo:
        repo = self.repos[repo_id] = Repo(dict(files or {}))
        repo.commit("initial commit")
        return repo

    def fetched(self, suffix: str = "") -> int:
        """Bytes sent by resolve requests for paths ending in `suffix`."""
        return sum(r.sent for r in self.requests if "/resolve/" in r.path and r.path.endswith(suffix))


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: with Nagle, each answer waits for an ACK

    def log_message(self, *args):  # quiet
        pass

    def _route(self, method: str) -> None:
        path = unquote(urlsplit(self.path).path)
        self._asked, self._logged = (method, path), False
        time.sleep(self.hub.latency)
        try:
            if path.startswith("/cdn/"):
                self._cdn(path)
            elif self.hub.token and self.headers.get("authorization") != f"Bearer {self.hub.token}":
                self._json(401, {"error": "Invalid credentials in Authorization header"})
            else:
                self._dispatch(method, path)
        finally:
            if not self._logged:  # no answer made it out
                self._log(0)

    def _log(self, sent: int) -> None:
        """The request, in `requests` before its answer leaves: a client that has its answer finds it there."""
        self._logged = True
        method, path = self._asked
        authorised = self.headers.get("authorization") == f"Bearer {self.hub.token}" if self.hub.token else True
        with self.hub.lock:
            self.hub.requests.append(Request(method, path, self.headers.get("range"), sent, authorised))

    def _dispatch(self, method: str, path: str) -> None:
        if method == "POST" and path == "/api/validate-yaml":
            self._validate_yaml()
            return
        if method == "GET" and path == "/_requests":  # for a client in another process (the benchmarks)
            with self.hub.lock:
                self._json(200, [vars(r) for r in self.hub.requests])
            return
        routes = [
            ("GET", rf"/api/datasets/{REPO}/auth-check(/write)?", self._auth_check),
            ("GET", rf"/api/datasets/{REPO}(/revision/(?P<rev>[^/]+))?", self._info),
            ("GET", rf"/api/datasets/{REPO}/tree/(?P<rev>[^/]+)(/(?P<path>.*))?", self._tree),
            ("POST", rf"/api/datasets/{REPO}/paths-info/(?P<rev>[^/]+)", self._paths_info),
            ("POST", rf"/api/datasets/{REPO}/preupload/(?P<rev>[^/]+)", self._preupload),
            ("POST", rf"/api/datasets/{REPO}/commit/(?P<rev>[^/]+)", self._commit),
            ("GET", rf"/datasets/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self._resolve),
            ("HEAD", rf"/datasets/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self._resolve),
        ]
        for verb, pattern, answer in routes:
            m = re.fullmatch(pattern, path)
            if verb == method and m:
                repo = self.hub.repos.get(m["repo"])
                if repo is None:
                    self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                else:
                    answer(repo, m)
                return
        self._json(404, {"error": f"no route for {method} {path}"})

    def _validate_yaml(self) -> None:
        """A card's YAML header must parse (as the Hub checks it before a commit that holds a README.md)."""
        content = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))["content"]
        try:
            import yaml

            header = content.split("---")[1] if content.startswith("---") else ""
            yaml.safe_load(header)
        except ImportError:
            pass
        except Exception as e:
            self._json(400, {"errors": [{"message": f"invalid YAML: {e}"}]})
            return
        self._json(200, {"errors": [], "warnings": []})

    def _auth_check(self, repo: Repo, m) -> None:
        if repo.read_only and m.group(m.lastindex or 0) == "/write":
            self._json(403, {"error": "You don't have the rights to write to this repository"})
            return
        self._json(200, {"accessRequest": None})

    def _info(self, repo: Repo, m) -> None:
        self._json(200, {"id": m["repo"], "sha": repo.sha, "private": bool(self.hub.token),
                         "siblings": [{"rfilename": p} for p in sorted(repo.files)]})

    def _entries(self, repo: Repo, paths: list[str]) -> list[dict]:
        folders = {"/".join(p.split("/")[:i]) for p in repo.files for i in range(1, p.count("/") + 1)}
        out = []
        for p in paths:
            if p in repo.files:
                data = repo.files[p]
                entry = {"type": "file", "path": p, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                if p.endswith(LFS):  # the Hub keeps these in LFS, and lists each one's sha256
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                out.append(entry)
            elif p in folders:
                out.append({"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest()})
        return out

    def _tree(self, repo: Repo, m) -> None:
        base = (m["path"] or "").strip("/")
        recursive = parse_qs(urlsplit(self.path).query).get("recursive", ["false"])[0].lower() == "true"
        under = [p for p in repo.files if not base or p.startswith(base + "/")]
        names = set()
        for p in under:
            rest = p[len(base) + 1:] if base else p
            parts = rest.split("/")
            for depth in range(1, len(parts) + 1 if recursive else 2):
                names.add("/".join(filter(None, [base, *parts[:depth]])))
        if base and not under and base not in repo.files:
            self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            return
        self._json(200, self._entries(repo, sorted(names)))

    def _form(self) -> dict[str, list[str]]:
        body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
        return parse_qs(body)

    def _paths_info(self, repo: Repo, m) -> None:
        self._json(200, self._entries(repo, self._form().get("paths", [])))

    def _preupload(self, repo: Repo, m) -> None:
        files = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))["files"]
        self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                   for f in files]})

    def _commit(self, repo: Repo, m) -> None:
        lines = self.rfile.read(int(self.headers.get("content-length") or 0)).splitlines()
        if self.hub.refuse_commits:
            self._json(500, {"error": "Internal Error"})
            return
        title = ""
        with self.hub.lock:
            for item in map(json.loads, filter(None, lines)):
                value = item["value"]
                if item["key"] == "header":
                    title = value.get("summary", "")
                elif item["key"] == "file":
                    content = value["content"]
                    repo.files[value["path"]] = (base64.b64decode(content) if value.get("encoding") == "base64"
                                                 else content.encode())
                elif item["key"] in ("deletedFile", "deletedFolder"):
                    gone = value["path"].rstrip("/")
                    for p in [p for p in repo.files if p == gone or p.startswith(gone + "/")]:
                        del repo.files[p]
            sha = repo.commit(title)
        host = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        self._json(200, {"commitUrl": f"{host}/datasets/{m['repo']}/commit/{sha}", "commitOid": sha})

    def _resolve(self, repo: Repo, m) -> None:
        data = repo.files.get(m["path"])
        if data is None:
            self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            return
        if self.hub.cdn and m["path"].endswith(".tar"):
            self._answer(302, b"", "text/plain", {"Location": f"{self.hub.cdn_url}/cdn/{m['repo']}/{m['path']}"
                                                              f"?sig={self.hub.signature}"})
            return
        self._range(data, {"X-Repo-Commit": repo.sha})

    def _cdn(self, path: str) -> None:
        """A signed URL the resolve sent a client to: no token wanted (a client must not send it here)."""
        if parse_qs(urlsplit(self.path).query).get("sig") != [self.hub.signature]:
            self._json(403, {"error": "Request has expired"})
            return
        org, name, rel = path[len("/cdn/"):].split("/", 2)
        repo = self.hub.repos.get(f"{org}/{name}")
        data = repo.files.get(rel) if repo else None
        if data is None:
            self._json(404, {"error": "not found"})
        else:
            self._range(data, {})

    def _range(self, data: bytes, extra: dict) -> None:
        # hash() of bytes is computed once per object (a sha1 of a whole shard on every range would be the cost)
        status, headers = 200, {"ETag": f'"{hash(data) & (2**64 - 1):x}"', "Accept-Ranges": "bytes", **extra}
        asked = RANGE_RE.match(self.headers.get("range") or "")
        if asked:
            start = int(asked[1])
            end = min(int(asked[2]) + 1 if asked[2] else len(data), len(data))
            if start >= len(data):
                self._json(416, {"error": "range not satisfiable"})
                return
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            status, data = 206, data[start:end]
        self._answer(status, data, "application/octet-stream", headers)

    def _json(self, status: int, body, headers: dict | None = None) -> None:
        self._answer(status, json.dumps(body).encode(), "application/json", headers)

    def _answer(self, status: int, body: bytes, kind: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self._log(len(body) if self.command != "HEAD" else 0)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")


def serve_hub(hub: Hub) -> tuple[ThreadingHTTPServer, str]:
    """Start a server for `hub` on a free loopback port, in a daemon thread; returns it and its endpoint URL (for
    HF_ENDPOINT). Stop it with server.shutdown(); server.server_close()."""
    handler = type("HubHandler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="hub-server").start()
    if hub.cdn:  # another origin (another port), stopped with the Hub's server
        cdn = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        cdn.daemon_threads = True
        threading.Thread(target=cdn.serve_forever, daemon=True, name="hub-cdn").start()
        hub.cdn_url = f"http://127.0.0.1:{cdn.server_address[1]}"
        stop = server.shutdown
        server.shutdown = lambda: (cdn.shutdown(), cdn.server_close(), stop())
    return server, f"http://127.0.0.1:{server.server_address[1]}"


__all__ = ["Hub", "Repo", "Request", "serve_hub"]
