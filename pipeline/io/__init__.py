"""Transport and storage: how records move between the two sides and where they rest.

``bus`` (the Kafka event log: connection, admin, publisher, group consumer,
follower, tail), ``store`` (the object store, create-only), ``archive`` (Parquet
trajectory batches in the store), ``datasets`` (offline steps datasets: the card,
day partitions, scans), ``steps_arrays`` (steps tables and episode starts built
from column arrays, for the importers), ``registry`` (adapter versions, committed by a manifest)
and ``steplog`` (the learner's per-step objects).  Producers, the
learner and the tools all read and write through these; none of them starts a
server.
"""
