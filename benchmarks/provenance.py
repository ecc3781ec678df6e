"""Which committed tree a benchmark ran, checked on the machine that ran it.

The GPU machine gets a copy of the working tree whose git metadata can lag the tree it
holds, so `git status` there cannot say whether the files are a commit's. Before a GPU
run, `python -m benchmarks.provenance` (on the development machine) refuses an
uncommitted tree and writes .mok_source.json: HEAD and the git blob id of every file it
tracks. Carried with the run, it lets `source_state()` on the GPU machine hash the files
that are there and compare: results then say git_commit = that commit and git_dirty =
false only if every tracked file is byte-identical to the commit's and no source file
outside it came along. Where git shows commits after the stamped one (a stamp left
behind on the development machine), git is asked instead.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
STAMP = REPO / ".mok_source.json"


def blob_id(path: Path) -> str:
    """git's object id of a file's bytes (sha1 of "blob <size>\\0" + content)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=30, check=True).stdout


def write_stamp(path: Path = STAMP) -> dict:
    """HEAD and its tracked files' blob ids; raises if tracked files differ from HEAD."""
    changed = _git("status", "--porcelain", "--untracked-files=no").strip()
    if changed:
        raise SystemExit("benchmarks.provenance: the tree has uncommitted changes; commit "
                         "first:\n" + changed)
    blobs = {}
    for line in _git("ls-tree", "-r", "HEAD").splitlines():
        meta, name = line.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob" and mode in ("100644", "100755"):
            blobs[name] = sha
    stamp = {"commit": _git("rev-parse", "HEAD").strip(), "blobs": blobs}
    path.write_text(json.dumps(stamp) + "\n")
    return stamp


def _git_state() -> tuple[Optional[str], Optional[bool]]:
    try:
        commit = _git("rev-parse", "HEAD").strip() or None
        return commit, bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    except Exception:
        return None, None


def source_state() -> tuple[Optional[str], Optional[bool], list]:
    """(commit, dirty, files that differ): from the stamp when there is one, else git."""
    if not STAMP.exists():
        commit, dirty = _git_state()
        return commit, dirty, []
    stamp = json.loads(STAMP.read_text())
    if (REPO / ".git").exists() and _head_is_newer(stamp["commit"]):
        return _git_state() + ([],)  # a stale stamp left behind here: git knows better
    differ = [name for name, sha in sorted(stamp["blobs"].items())
              if not (REPO / name).is_file() or blob_id(REPO / name) != sha]
    # Source files that travelled but are not in the stamp (added since) count too.
    differ += [name for name in _source_files() if name not in stamp["blobs"]]
    return stamp["commit"], bool(differ), differ


SOURCE_DIRS = ("megatron_mok", "benchmarks", "csrc", "scripts", "tests")
SOURCE_SUFFIXES = (".py", ".sh", ".cu", ".cuh", ".cpp", ".h")


def _source_files() -> list:
    return [str(p.relative_to(REPO)) for d in SOURCE_DIRS for p in sorted((REPO / d).rglob("*"))
            if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]


def _head_is_newer(stamped: str) -> bool:
    """git works here and HEAD is a commit other than the stamped one whose history
    contains it (the stamp predates later commits), so the stamp is stale."""
    try:
        head = _git("rev-parse", "HEAD").strip()
        if head == stamped:
            return False
        subprocess.run(["git", "merge-base", "--is-ancestor", stamped, head], cwd=REPO,
                       capture_output=True, timeout=30, check=True)
        return True
    except Exception:
        return False


def main() -> int:
    stamp = write_stamp()
    print(f"{STAMP.name}: {stamp['commit']} ({len(stamp['blobs'])} files)")
    commit, dirty, differ = source_state()
    assert commit == stamp["commit"] and not dirty, differ[:5]
    return 0


if __name__ == "__main__":
    sys.exit(main())
