"""Analysis: what the runs left in the store and the event log, for people to read.

``report`` (``rlpipe report``: one run's numbers, figures and page) and ``runs``
(``rlpipe runs``: every run's progress and status, and deleting one).  They read
through ``pipeline.io`` and the contracts in ``schemas``; nothing on the training
path imports them.  Offline datasets are inspected through ``pipeline.io.datasets``,
the same module their importers write with.
"""
