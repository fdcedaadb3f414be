"""Offline datasets on the producer side."""
