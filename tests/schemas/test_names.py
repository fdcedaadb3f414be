import pytest

from schemas.names import MAX_NAME_LENGTH, InvalidNameError, validate_name


@pytest.mark.parametrize("good", ["demo", "run-1", "a.b_c", "X9", "a" * MAX_NAME_LENGTH])
def test_good_names(good):
    assert validate_name(good) == good


@pytest.mark.parametrize(
    "bad", ["", "..", "a/b", "a\\b", "../x", "a..b", ".hidden", "-flag", "sp ace", "é", "a" * (MAX_NAME_LENGTH + 1)]
)
def test_bad_names(bad):
    with pytest.raises(InvalidNameError):
        validate_name(bad, "run_id")
