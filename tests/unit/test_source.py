"""Fast unit tests of pipeline.io.source: planning and listing local key ranges, dropping done and carried objects."""

from __future__ import annotations

import os

import numpy as np

import pipeline.io.source as source
from pipeline.config import DEFAULT_EXTENSIONS
from pipeline.io.keys import identity_hash, member, uri_hash
from pipeline.io.source import LocalFiles, list_unit, listing_blocks, plan_listing
from pipeline.storage import open_fs

EXT = DEFAULT_EXTENSIONS


def listed(fs, root, tasks):
    groups = plan_listing(fs, root, EXT, tasks)
    uris = [e[0] for g in groups for unit in g for e in list_unit(fs, unit, EXT)]
    return groups, uris


def test_member_is_a_vectorised_binary_search():
    keys = np.array([-7, 0, 3, 99], np.int64)
    assert member(keys, np.array([3, 4, -7, 100, 99], np.int64)).tolist() == [True, False, True, False, True]
    assert member(np.empty(0, np.int64), np.array([1], np.int64)).tolist() == [False]


def test_local_nested_and_flat_folders_list_every_image_once(tmp_path, monkeypatch):
    for d in range(5):
        (tmp_path / f"d{d}" / "deeper").mkdir(parents=True)
        for i in range(3):
            (tmp_path / f"d{d}" / f"{i}.jpg").write_bytes(b"x")
        (tmp_path / f"d{d}" / "deeper" / "z.PNG").write_bytes(b"x")
    for i in range(50):
        (tmp_path / f"flat{i:03d}.jpeg").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("no")
    (tmp_path / ".hidden.jpg").write_bytes(b"x")
    monkeypatch.setattr(source, "LOCAL_SPLIT_FILES", 10)  # the 52 files directly in the root: split 4 ways
    fs, root = open_fs(str(tmp_path))
    groups, uris = listed(fs, root, 4)
    assert len(groups) == 4
    assert sum(1 for g in groups for u in g if isinstance(u, LocalFiles)) == 4
    assert len(uris) == len(set(uris)) == 5 * 4 + 50
    assert all(u.startswith("file://" + str(tmp_path)) for u in uris)
    assert not any(u.endswith((".txt", ".hidden.jpg")) for u in uris)
    entry = next(e for g in groups for unit in g for e in list_unit(fs, unit, EXT))
    st = os.stat(entry[0].removeprefix("file://"))
    assert entry[1:] == (st.st_size, None, int(st.st_mtime * 1_000_000))


def test_listing_blocks_skip_done_and_hand_over_carried(tmp_path):
    for i in range(30):
        (tmp_path / f"{i:02d}.jpg").write_bytes(b"x" * i)
    fs, root = open_fs(str(tmp_path))
    groups = plan_listing(fs, root, EXT, 1)
    entries = {e[0]: e for g in groups for unit in g for e in list_unit(fs, unit, EXT)}
    uris = sorted(entries)
    done = np.unique(np.array([uri_hash(u) for u in uris[:10]], np.int64))
    previous = np.unique(np.array([identity_hash(u, None, entries[u][1], entries[u][3]) for u in uris[10:25]],
                                  np.int64))
    reports = []
    blocks = list(listing_blocks(fs, groups[0], EXT, done=done, previous=previous,
                                 report=lambda *args: reports.append(args)))
    fresh = [u for b in blocks for u in b.column("uri").to_pylist()]
    assert sorted(fresh) == uris[25:]
    assert sum(r[0] for r in reports) == 20 and sum(r[1] for r in reports) == 10  # listed (new + carried), done
    carried = np.concatenate([r[3] for r in reports if r[3] is not None])
    assert sorted(carried.tolist()) == previous.tolist()
