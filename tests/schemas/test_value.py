"""The value run's configuration refuses settings that cannot work, in one line naming the field."""

from __future__ import annotations

import pytest

from schemas.value import OfflineValueConfig


@pytest.mark.parametrize("field", ["water_range_k", "air_range_k"])
def test_an_offline_setpoint_range_must_run_from_low_to_high(field: str) -> None:
    """Refused here rather than once the dataset has been read, where the grid's error names no field."""
    low, high = OfflineValueConfig.model_fields[field].default
    with pytest.raises(ValueError, match=rf"{field} \({high}, {low}\) must be \(low, high\)"):
        OfflineValueConfig(**{field: (high, low)})
    with pytest.raises(ValueError, match=field):
        OfflineValueConfig(**{field: (low, low)})
    assert getattr(OfflineValueConfig(**{field: (low, high)}), field) == (low, high)
