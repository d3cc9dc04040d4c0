"""The checksum manifest of a checkpoint directory: build it, read it, verify against it.

`manifest.json` = `{"format": 1, "files": {relpath: {"sha256": hex, "size": bytes}}}`
lists every file of the step directory except itself (relpaths use `/`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 4 << 20
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class CheckpointCorruptError(Exception):
    """A checkpoint file is missing, has the wrong size or checksum, or is unreadable.

    `relpath` names the first offending file relative to the step directory,
    `reason` says what is wrong with it.
    """

    def __init__(self, checkpoint_dir: Path, relpath: str, reason: str):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.relpath = relpath
        self.reason = reason
        super().__init__(f"checkpoint {self.checkpoint_dir} is corrupt: {relpath}: {reason}")


def list_files(directory: Path) -> list[str]:
    """All regular files under `directory` (relpaths with `/`), sorted, manifest excluded."""
    out = []
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            rel = Path(dirpath, name).relative_to(directory).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def _hash_file(path: Path, sync: bool) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest(), size


def _hash_many(directory: Path, relpaths: list[str], sync: bool) -> list[tuple[str, int]]:
    workers = max(1, min(8, os.cpu_count() or 1, len(relpaths)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda rel: _hash_file(directory / rel, sync), relpaths))


def file_digests(directory: Path, relpaths: list[str], *, sync: bool = False) -> dict[str, dict]:
    """`{relpath: {"sha256": hex, "size": bytes}}` of files under `directory` (a manifest's
    entries), hashed in parallel; `sync` fsyncs each one too."""
    results = _hash_many(directory, relpaths, sync)
    return {rel: {"sha256": sha, "size": size} for rel, (sha, size) in zip(relpaths, results)}


def build_manifest(directory: Path) -> dict:
    """Hashes and fsyncs every file under `directory`; returns the manifest dict."""
    return {"format": MANIFEST_FORMAT, "files": file_digests(directory, list_files(directory), sync=True)}


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def read_manifest(directory: Path) -> dict:
    """Parses and validates `directory/manifest.json`.

    Raises CheckpointCorruptError naming manifest.json when it is unreadable or
    malformed, ValueError when it declares a format this version does not know.
    """
    path = directory / MANIFEST_NAME
    try:
        data = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(directory, MANIFEST_NAME, f"unreadable ({e})") from e
    if not isinstance(data, dict) or "format" not in data:
        raise CheckpointCorruptError(directory, MANIFEST_NAME, "not an object with a 'format' field")
    if data["format"] != MANIFEST_FORMAT:
        raise ValueError(
            f"{path}: manifest format {data['format']!r} is not supported (this jrl reads format "
            f"{MANIFEST_FORMAT})"
        )
    files = data.get("files")
    if not isinstance(files, dict):
        raise CheckpointCorruptError(directory, MANIFEST_NAME, "'files' is not an object")
    for rel, entry in files.items():
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or "" in parts or rel == MANIFEST_NAME:
            raise CheckpointCorruptError(directory, MANIFEST_NAME, f"invalid file entry {rel!r}")
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and _SHA256_HEX.match(entry["sha256"])
            and isinstance(entry.get("size"), int)
            and entry["size"] >= 0
        )
        if not ok:
            raise CheckpointCorruptError(directory, MANIFEST_NAME, f"malformed entry for {rel!r}")
    return data


def _presence_problem(path: Path, listed_size: int) -> str | None:
    """What is wrong with a listed file that one `stat` can tell: missing, not reachable
    (a directory on its path that may not be searched: "unreadable (...)"), or its size."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as e:
        return f"unreadable ({e})"
    if not stat.S_ISREG(st.st_mode):
        return "missing"
    if st.st_size != listed_size:
        return f"size {st.st_size} bytes, manifest says {listed_size}"
    return None


def _file_problem(directory: Path, rel: str, entry: dict) -> str | None:
    path = directory / rel
    if problem := _presence_problem(path, entry["size"]):
        return problem
    try:
        sha, _ = _hash_file(path, sync=False)
    except OSError as e:
        return f"unreadable ({e})"
    if sha != entry["sha256"]:
        return "SHA-256 does not match the manifest"
    return None


def check_listed_sizes(directory: Path, manifest: dict) -> None:
    """Raises CheckpointCorruptError naming the first (sorted) listed file that is missing,
    out of reach (`_presence_problem`) or whose size differs from the manifest's: one `stat`
    per file, nothing read or hashed."""
    for rel in sorted(manifest["files"]):
        if problem := _presence_problem(directory / rel, manifest["files"][rel]["size"]):
            raise CheckpointCorruptError(directory, rel, problem)


def verify_against_manifest(directory: Path, manifest: dict) -> None:
    """Raises CheckpointCorruptError naming the first (sorted) file that does not match.

    Every listed file must exist as a regular file with the listed size and SHA-256;
    then no unlisted file may exist (an extra file could change what Orbax reads).
    """
    listed = sorted(manifest["files"])
    workers = max(1, min(8, os.cpu_count() or 1, len(listed)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        problems = pool.map(lambda rel: _file_problem(directory, rel, manifest["files"][rel]), listed)
        for rel, problem in zip(listed, problems):
            if problem is not None:
                raise CheckpointCorruptError(directory, rel, problem)
    unlisted = sorted(set(list_files(directory)) - set(listed))
    if unlisted:
        raise CheckpointCorruptError(directory, unlisted[0], "file is not listed in the manifest")
