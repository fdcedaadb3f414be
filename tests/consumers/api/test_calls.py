"""Which requests on the log make one split forward_backward (``consumers.api.calls.split_end``)."""

from __future__ import annotations

from consumers.api.calls import SplitCall, split_end
from pipeline.io.bus.records import ConsumedEvent
from schemas.api import ApiRequestAccepted
from schemas.events import make_event


def _logged(seq: int, offset: int, op: str = "forward_backward", partition: int = 0) -> ConsumedEvent:
    call = ApiRequestAccepted(request_id=f"s.train.0.{seq}", tenant="t", session_id="s", op=op, model_id="s:train:0",
                              seq_id=seq, base_model="/m", body_path="x", body_sha256="0" * 64)
    return ConsumedEvent("ns.requests", partition, offset, "s:train:0", make_event("s.train.0", call))


def test_the_requests_of_one_split_call_are_those_logged_before_its_first():
    # the SDK sent 2, 3, 4 at once, then 1 (the first) last; 5 is the next call, logged after
    pending = {2: _logged(2, 10), 3: _logged(3, 11), 4: _logged(4, 12), 5: _logged(5, 14)}
    assert split_end(pending, _logged(1, 13)) == 4
    assert split_end({2: _logged(2, 14)}, _logged(1, 13)) is None  # a call of its own: no split
    assert split_end({2: _logged(2, 10, "optim_step")}, _logged(1, 13)) is None
    assert split_end({2: _logged(2, 10, partition=1)}, _logged(1, 13)) is None
    assert split_end({3: _logged(3, 10)}, _logged(1, 13)) is None  # 2 not read: nothing after a gap
    assert split_end(pending, _logged(1, 13, "optim_step")) is None
    split = SplitCall(1, 4, None, datums_before=1024)
    assert split.covers(4) and not split.covers(5) and not split.covers(None)
    assert split.describe(2) == ("request 2 of the 4 the SDK split one forward_backward into (its datum 0 is datum "
                                 "1024 of the call)")
