"""The errors the event log raises: each says why in one line and names what to do.

``BusError`` and its subclasses are failures outside the caller (the broker, the
network, the group); the ``ValueError`` ones are settings or names the caller can fix.
"""

from __future__ import annotations


class BusError(RuntimeError):
    """Talking to the event log failed; the message says why and what to do.

    ``transient``: whether the same call may succeed when tried again (the broker away, the group rebalancing); a
    caller that waits out an outage (``consumers.broker_wait``) raises the others at once.
    """

    transient = True

    def __init__(self, *args: object, transient: bool | None = None) -> None:
        super().__init__(*args)
        if transient is not None:
            self.transient = transient


class BusUnavailableError(BusError):
    """The broker cannot be reached (or refuses the connection) within the connect timeout."""


class PublishError(BusError):
    """The broker did not accept an event."""


class RewindError(BusError):
    """Records a consumer fetched could not be put back: going on would skip them."""

    transient = False  # the consumer must be closed and a new one started


class CommitError(BusError):
    """Consumer offsets could not be committed (the events will be delivered again)."""


class BusConfigError(ValueError):
    """A bus setting that cannot work (bad address, missing password file)."""


class UnknownTopicError(ValueError):
    """A topic that does not exist, or a name that is neither a topic kind nor a topic."""


class WrongEventTypeError(ValueError):
    """An event published to a topic it does not belong on."""
