"""Listing a real S3 endpoint (moto server): a flat prefix split at probed keys, every key listed once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import pipeline.io.source as source
from pipeline.config import DEFAULT_EXTENSIONS
from pipeline.io.keys import object_uri, uri_path
from pipeline.io.source import S3Keys, S3Range, list_unit, plan_listing
from pipeline.storage import open_fs

EXT = DEFAULT_EXTENSIONS


def listed(fs, root, tasks):
    groups = plan_listing(fs, root, EXT, tasks)
    uris = [e[0] for g in groups for unit in g for e in list_unit(fs, unit, EXT)]
    return groups, uris


@pytest.fixture(scope="module")
def flat_bucket(s3):
    """A flat prefix of 345 keys (seven 50-key LIST pages here), a few nested keys and odd names beside it."""
    s3.create_bucket(Bucket="flat-listing")
    keys = [f"flat/img{i:06d}.jpg" for i in range(300)] + [f"flat/z/{i}.jpg" for i in range(40)]
    keys += ["flat/Ärger.jpg", "flat/a b.jpg", "flat/~tilde.jpg", "flat/notes.txt", "other/x.jpg"]
    keys += ["flat/", "flat/z/"]  # folder markers, as the S3 console makes them: keys equal to a prefix
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket="flat-listing", Key=k, Body=b"x"), keys))
    return sorted(k for k in keys if k.startswith("flat/") and k.endswith(".jpg"))


def test_s3_flat_prefix_is_split_at_probed_keys_and_lists_every_key_once(s3_server, flat_bucket, monkeypatch):
    monkeypatch.setattr(source, "S3_PAGE", 50)  # LIST pages of 50 keys, so 345 keys behave like 345,000
    prefixes: list[str] = []
    list_page = source._list_page
    monkeypatch.setattr(source, "_list_page", lambda fs, bucket, prefix, *a, **k: prefixes.append(prefix)
                        or list_page(fs, bucket, prefix, *a, **k))
    fs, root = open_fs("s3://flat-listing/flat")
    groups = plan_listing(fs, root, EXT, 8)
    # Leaves are split one level deeper only until there are enough ranges: every probe is a LIST call.
    assert len(prefixes) <= 55, len(prefixes)  # 73 when every leaf was split a level at a time
    prefixes.clear()
    uris = [uri_path(e[0]) for g in groups for unit in g for e in list_unit(fs, unit, EXT)]  # bucket/key
    # A range lists under the common prefix of its first key and the next range's first key: narrower LISTs.
    assert sum(p.startswith("flat/img000") for p in prefixes) >= 8, prefixes
    ranges = [u for g in groups for u in g]
    assert len(groups) == 8 and len(ranges) >= 16 and all(isinstance(u, S3Range) for u in ranges)
    assert sorted(uris) == [f"flat-listing/{k}" for k in flat_bucket]
    assert len(uris) == len(set(uris))
    one, uris_one = listed(fs, root, 1)  # one task: no probing, one range from the first key to the end
    assert [type(u) for g in one for u in g] == [S3Range] and [uri_path(u) for u in uris_one] == sorted(uris)


def test_s3_small_prefix_is_one_page_without_probing(s3_server, s3):
    s3.create_bucket(Bucket="small-listing")
    for k in ("p/a.jpg", "p/b/c.jpg"):
        s3.put_object(Bucket="small-listing", Key=k, Body=b"x", )
    fs, root = open_fs("s3://small-listing/p")
    groups, uris = listed(fs, root, 8)
    assert [type(u) for g in groups for u in g] == [S3Keys]
    assert sorted(uris) == ["s3://small-listing/p/a.jpg", "s3://small-listing/p/b/c.jpg"]


def test_s3_keys_that_are_prefixes_of_each_other_are_listed_once(s3_server, s3, monkeypatch):
    """Random short keys over a small alphabet ("p/a", "p/a.jpg", "p/a/b.jpg", the marker "p/", non-ASCII): every
    planned range, listed under the common prefix of its bounds, adds up to each image exactly once."""
    import random

    monkeypatch.setattr(source, "S3_PAGE", 7)
    rng = random.Random(3)
    keys = {"p/"}
    while len(keys) < 120:
        keys.add("p/" + "".join(rng.choice("ab/.Äz~") for _ in range(rng.randint(0, 6))) + rng.choice(["", ".jpg"]))
    s3.create_bucket(Bucket="prefix-listing")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket="prefix-listing", Key=k, Body=b"x"), sorted(keys)))
    fs, root = open_fs("s3://prefix-listing/p")
    want = sorted(object_uri("s3", f"prefix-listing/{k}") for k in keys if source.matches(k, EXT))
    for tasks in (3, 8):
        groups, uris = listed(fs, root, tasks)
        assert len(groups) == tasks and sum(len(g) for g in groups) > tasks
        assert sorted(uris) == want and len(uris) == len(set(uris))
