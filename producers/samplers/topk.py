"""Top-k logprob rows as two arrays, from the engine that ranks them to the encoder that puts them on the wire.

A call's top-k rows are up to ``MAX_TOPK_SAMPLE_CELLS`` cells (about a million).  As Python ``(token, logprob)``
tuples they were built one by one from the engine's output and flattened again, one by one, into the SDK's dense
matrices.  ``TopKRows`` holds them in that dense form from the start: N x K int32 ids and float32 logprobs, row n
the n-th position's most likely tokens, most likely first, and the cells a row leaves holding id 0 and
``MISSING_LOGPROB`` (the Tinker SDK's ``MASK_LOGPROB``, which its decoder drops), so encoding them is two copies.

A row with no entry is None (prompt position 0, which nothing predicts; a row ``prompt_logprobs_last_n`` blanks),
as the SDK decodes it.  Row by row, ``TopKRows`` reads as the ``list[TopK | None]`` it replaces (indexing,
iterating, slicing, ``==`` against such a list), so code that looks at a few rows need not know the arrays.
float32 loses nothing: both engines compute logprobs in float32, and the wire carries float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

TopK = list[tuple[int, float]]  # the most likely tokens at one position and their logprobs, most likely first

MISSING_LOGPROB = -99999.0  # tinker.types.topk_logprobs.MASK_LOGPROB (tests/producers/samplers/test_topk.py)


@dataclass(frozen=True, eq=False)
class TopKRows(Sequence[TopK | None]):
    """N rows of at most K (token, logprob) entries: ``ids_NK`` int32, ``logprobs_NK`` float32, each row's entries
    in its first columns, most likely first, and (0, ``MISSING_LOGPROB``) in the columns after them."""

    ids_NK: np.ndarray
    logprobs_NK: np.ndarray

    def __post_init__(self) -> None:
        if self.ids_NK.ndim != 2 or self.ids_NK.shape != self.logprobs_NK.shape:
            raise ValueError(f"top-k ids {self.ids_NK.shape} and logprobs {self.logprobs_NK.shape} must be two "
                             "matrices of one shape (positions x K)")
        if self.ids_NK.dtype != np.int32 or self.logprobs_NK.dtype != np.float32:
            raise ValueError(f"top-k ids are int32 and logprobs float32, got {self.ids_NK.dtype} and "
                             f"{self.logprobs_NK.dtype}; build them with TopKRows.from_ranked or from_rows")

    @property
    def k(self) -> int:
        """The columns: the most entries a row can hold."""
        return self.ids_NK.shape[1]

    @classmethod
    def from_ranked(cls, ids_NK: Any, logprobs_NK: Any) -> TopKRows:
        """An engine's ranked matrices (each row most likely first) with the cells of logprob -inf, tokens that a
        top-k or top-p cut removed and that cannot be drawn, left as missing (they sort last, so entries stay
        in the first columns)."""
        logprobs = np.asarray(logprobs_NK, np.float32)
        missing = ~np.isfinite(logprobs)
        ids = np.where(missing, 0, np.asarray(ids_NK)).astype(np.int32)
        return cls(ids, np.where(missing, np.float32(MISSING_LOGPROB), logprobs))

    @classmethod
    def from_rows(cls, rows: Sequence[TopK | None], k: int | None = None) -> TopKRows:
        """Rows as lists of (token, logprob) (None or [] for a row with none), ``k`` columns wide (default: the
        longest row's).  Filled cell m (of M, row after row) is row ``row_M[m]``, column m - (the cells of the
        rows before it).  A row longer than ``k`` is refused (ValueError naming it)."""
        if isinstance(rows, TopKRows):
            return rows
        lengths_N = np.fromiter((0 if row is None else len(row) for row in rows), np.int64, len(rows))
        width = int(lengths_N.max(initial=0)) if k is None else k
        too_long_rows = np.flatnonzero(lengths_N > width)
        if too_long_rows.size:
            n = int(too_long_rows[0])
            raise ValueError(f"top-k row {n} has {lengths_N[n]} entries, more than k={width} columns hold; "
                             "pass a k at least the longest row's, or none to use it")
        # token, logprob, token, logprob, ...: float64 holds every int32 id exactly
        pairs = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(row for row in rows if row)),
                            np.float64, 2 * int(lengths_N.sum()))
        row_M, column_M = cells(lengths_N)
        ids_NK = np.zeros((len(rows), width), np.int32)
        logprobs_NK = np.full((len(rows), width), MISSING_LOGPROB, np.float32)
        ids_NK[row_M, column_M] = pairs[0::2]
        logprobs_NK[row_M, column_M] = pairs[1::2]
        return cls(ids_NK, logprobs_NK)

    @classmethod
    def blank(cls, n: int, k: int) -> TopKRows:
        """``n`` rows of none (each None), ``k`` columns wide."""
        return cls(np.zeros((n, k), np.int32), np.full((n, k), MISSING_LOGPROB, np.float32))

    @classmethod
    def concatenate(cls, parts: Sequence[TopKRows], k: int) -> TopKRows:
        """The rows of ``parts``, one after another (``k`` columns wide when there are none; else the parts')."""
        if not parts:
            return cls.blank(0, k)
        return cls(np.concatenate([part.ids_NK for part in parts]),
                   np.concatenate([part.logprobs_NK for part in parts]))

    def lengths(self) -> np.ndarray:
        """The entries of each row (0: the row is None)."""
        return np.count_nonzero(self.logprobs_NK != MISSING_LOGPROB, axis=1)

    def only_last(self, last_n: int) -> TopKRows:
        """These rows with all but the last ``last_n`` None (``prompt_logprobs_last_n``)."""
        blank = max(len(self) - last_n, 0)
        ids_NK, logprobs_NK = self.ids_NK.copy(), self.logprobs_NK.copy()
        ids_NK[:blank], logprobs_NK[:blank] = 0, MISSING_LOGPROB
        return TopKRows(ids_NK, logprobs_NK)

    def __len__(self) -> int:
        return self.ids_NK.shape[0]

    @overload
    def __getitem__(self, index: int) -> TopK | None: ...

    @overload
    def __getitem__(self, index: slice) -> TopKRows: ...

    def __getitem__(self, index: int | slice) -> TopK | TopKRows | None:
        if isinstance(index, slice):
            return TopKRows(self.ids_NK[index], self.logprobs_NK[index])
        filled = self.logprobs_NK[index] != MISSING_LOGPROB
        if not filled.any():
            return None
        return list(zip(self.ids_NK[index][filled].tolist(), self.logprobs_NK[index][filled].tolist(), strict=True))

    def __iter__(self) -> Iterator[TopK | None]:
        for n in range(len(self)):
            yield self[n]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TopKRows):
            return len(self) == len(other) and list(self) == list(other)
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # holds arrays: equal rows, no hash

    def __repr__(self) -> str:
        return f"TopKRows({len(self)} x {self.k})"


def cells(counts_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the M entries of rows holding ``counts_N`` entries each go, row after row: entry m's row and column."""
    row_M = np.repeat(np.arange(counts_N.size), counts_N)
    return row_M, np.arange(row_M.size) - np.repeat(np.cumsum(counts_N) - counts_N, counts_N)
