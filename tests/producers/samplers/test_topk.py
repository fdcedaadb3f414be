"""Top-k rows as two arrays (``TopKRows``): the same rows as the lists of (token, logprob) they replace, and the
cells the SDK's decoder drops where a row has fewer entries than K."""

from __future__ import annotations

import numpy as np
import pytest
from tinker.types.topk_logprobs import MASK_LOGPROB

from producers.samplers.base import SampleOutput
from producers.samplers.engine import SampleResult
from producers.samplers.topk import MISSING_LOGPROB, TopKRows


def random_rows(n: int, k: int, seed: int) -> list:
    """``n`` rows of 0 to ``k`` entries (every 5th None), most likely first, float32-exact logprobs."""
    rng = np.random.default_rng(seed)
    rows: list = []
    for i in range(n):
        length = int(rng.integers(0, k + 1))
        ids = rng.choice(150_000, length, replace=False).tolist()
        values = np.sort(rng.normal(-3.0, 2.0, length).astype(np.float32))[::-1].tolist()
        rows.append(None if i % 5 == 2 else list(zip(ids, values, strict=True)))
    return rows


def test_the_missing_cell_is_the_one_the_sdks_decoder_drops() -> None:
    assert MISSING_LOGPROB == MASK_LOGPROB


def test_rows_read_back_as_the_lists_they_were_built_from() -> None:
    rows = random_rows(300, 5, seed=3)
    topk = TopKRows.from_rows(rows, 5)
    assert topk.ids_NK.shape == topk.logprobs_NK.shape == (300, 5) and len(topk) == 300
    assert topk == [row or None for row in rows]  # a row of none is None, as the SDK decodes it
    assert list(topk) == [row or None for row in rows] and topk[-1] == (rows[-1] or None)
    assert topk.lengths().tolist() == [len(row or []) for row in rows]
    for n, row in enumerate(rows):  # each row from column 0, the rest (0, MISSING_LOGPROB)
        filled = len(row or [])
        assert topk.ids_NK[n, :filled].tolist() == [t for t, _ in row or []]
        assert topk.logprobs_NK[n, :filled].tolist() == [v for _, v in row or []]
        assert topk.ids_NK[n, filled:].tolist() == [0] * (5 - filled)
        assert topk.logprobs_NK[n, filled:].tolist() == [MISSING_LOGPROB] * (5 - filled)
    assert topk[10:20] == [row or None for row in rows[10:20]] and isinstance(topk[10:20], TopKRows)
    assert TopKRows.from_rows(rows).k == max(len(row or []) for row in rows)
    assert topk != TopKRows.from_rows(rows[:-1], 5) and topk != [*rows[:-1], [(1, -1.0)]]


def test_a_row_longer_than_k_is_refused_naming_it() -> None:
    rows = [[(1, -0.1)], None, [(1, -0.1), (2, -0.2), (3, -0.3)], [(4, -0.4), (5, -0.5), (6, -0.6)]]
    with pytest.raises(ValueError, match=r"row 2 has 3 entries, more than k=2"):
        TopKRows.from_rows(rows, 2)
    assert TopKRows.from_rows(rows, 3).lengths().tolist() == [1, 0, 3, 3]  # rows as long as k fit


def test_only_last_blanks_the_rows_before_the_last_n() -> None:
    rows = [None, [(3, -0.5)], [(4, -0.25), (6, -1.0)], [(5, -1.0)]]
    topk = TopKRows.from_rows(rows, 2)
    assert topk.only_last(2) == [None, None, [(4, -0.25), (6, -1.0)], [(5, -1.0)]]
    assert topk.only_last(4) == rows and topk == rows  # the rows it was made from are not changed


def test_ranked_matrices_leave_out_the_cells_a_cut_removed() -> None:
    """-inf (outside a top-k or top-p cut) sorts last in an engine's ranked row: those cells become missing."""
    ids = np.array([[7, 2, 9], [4, 1, 8]])
    logprobs = np.array([[-0.5, -1.25, -np.inf], [-np.inf, -np.inf, -np.inf]])
    topk = TopKRows.from_ranked(ids, logprobs)
    assert topk == [[(7, -0.5), (2, -1.25)], None]
    assert topk.ids_NK.tolist() == [[7, 2, 0], [0, 0, 0]] and topk.ids_NK.dtype == np.int32


def test_samples_and_results_given_lists_keep_them_as_rows() -> None:
    sample = SampleOutput([4, 2], [-1.5, -0.25], "stop", topk_logprobs=[[(4, -1.5), (9, -1.75)], [(2, -0.25)]])
    result = SampleResult([sample], None, [None, [(3, -0.5)]])
    assert isinstance(sample.topk_logprobs, TopKRows) and isinstance(result.topk_prompt_logprobs, TopKRows)
    assert sample.topk_logprobs == [[(4, -1.5), (9, -1.75)], [(2, -0.25)]]
    with pytest.raises(ValueError, match="2 tokens but 1 rows"):
        SampleOutput([4, 2], [-1.5, -0.25], "stop", topk_logprobs=[[(4, -1.5)]])
    with pytest.raises(ValueError, match="int32"):
        TopKRows(np.zeros((1, 2), np.int64), np.zeros((1, 2), np.float32))
