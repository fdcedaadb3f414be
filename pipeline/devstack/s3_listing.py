"""Fast ListObjectsV2 for the local S3 server: a sorted index of each bucket's keys.

Tansu lists a partition's record batches on every fetch that has data, so the
cost of a listing is paid per event read.  moto's own listing (its generic XML
serializer over a sorted copy of the whole bucket) took about half a second per
thousand objects, and a sorted copy of the bucket per page still about 18 ms.
Tansu gives up listing when the fetch's wait (``fetch_max_wait_ms``) runs out, and
then answers as if the partition held nothing new, so a slow listing starves its
readers.  ``ListingIndex`` keeps the keys sorted across
listings (it catches up with the store by a set difference, done in C), finds a
page's start by bisection and keeps each object's XML entry until the object is
written again, so a page costs about what its own keys cost; a request that
names no ``max-keys`` (Tansu's) gets every key in one page.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any
from xml.sax.saxutils import escape

MAX_KEYS = 1000  # the most keys a request may ask for with max-keys (S3's limit)
# A request that names no max-keys gets one page of up to this many: Tansu lists a partition whole on every
# fetch (and gives up when its fetch wait runs out), so one request beats a thousand-key page at a time.
UNNAMED_PAGE_KEYS = 1_000_000


class ListingIndex:
    """One bucket's keys in order, brought up to date with moto's store at each listing."""

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._known: set[str] = set()
        self._entries: dict[str, tuple[Any, str]] = {}  # key -> (moto's object, its <Contents> element)
        self._lock = threading.Lock()

    def page(self, store: Any, prefix: str, after: str, limit: int) -> tuple[list[str], bool, str]:
        """The ``<Contents>`` elements of up to ``limit`` keys under ``prefix`` after ``after``.

        Also whether more keys follow, and the last key of the page (the continuation token).
        """
        with self._lock:
            self._catch_up(store)
            start = bisect.bisect_right(self._keys, after) if after >= prefix else bisect.bisect_left(self._keys, prefix)
            contents: list[str] = []
            last, truncated = "", False
            for key in self._keys[start:]:
                if not key.startswith(prefix):
                    break
                if len(contents) == limit:
                    truncated = True
                    break
                element = self._element(store, key)
                if element is not None:  # None: deleted since the catch-up
                    contents.append(element)
                    last = key
            return contents, truncated and bool(last), last

    def _catch_up(self, store: Any) -> None:
        current = set(store)  # moto's key store is a dict; copied in C, so a concurrent write cannot break it
        added, removed = current - self._known, self._known - current
        if removed:
            self._keys = [key for key in self._keys if key not in removed]
            for key in removed:
                self._entries.pop(key, None)
        if len(added) > 1 and (not self._keys or min(added) > self._keys[-1]):
            self._keys.extend(sorted(added))  # the usual case: new record batches sort after the rest
        else:
            for key in added:
                bisect.insort(self._keys, key)
        self._known = current

    def _element(self, store: Any, key: str) -> str | None:
        item = store.get(key)
        if item is None:
            return None
        cached = self._entries.get(key)
        if cached is not None and cached[0] is item:
            return cached[1]
        modified = item.last_modified.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        element = (f"<Contents><Key>{escape(key)}</Key><LastModified>{modified}</LastModified>"
                   f"<ETag>{escape(item.etag)}</ETag><Size>{item.size}</Size>"
                   "<StorageClass>STANDARD</StorageClass></Contents>")
        self._entries[key] = (item, element)
        return element


def list_objects_v2(index: ListingIndex, store: Any, name: str, query: dict[str, str]) -> bytes:
    """The ListObjectsV2 answer for ``query`` (prefix, continuation-token / start-after, max-keys)."""
    prefix = query.get("prefix", "")
    limit = max(1, min(MAX_KEYS, int(query["max-keys"]))) if "max-keys" in query else UNNAMED_PAGE_KEYS
    after = max(query.get("continuation-token", ""), query.get("start-after", ""))
    contents, truncated, last = index.page(store, prefix, after, limit)
    token = f"<NextContinuationToken>{escape(last)}</NextContinuationToken>" if truncated else ""
    return ('<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(name)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(contents)}</KeyCount>"
            f"<MaxKeys>{limit}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
            f"{''.join(contents)}{token}</ListBucketResult>").encode()
