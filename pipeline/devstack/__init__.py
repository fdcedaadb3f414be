"""The embedded development stack: local servers standing in for Kafka and a cloud bucket.

``process`` (one server subprocess on a loopback port: free port, log file,
readiness wait, stop), ``broker`` (Tansu, the Kafka-protocol broker),
``gcs_emulator`` (fake-gcs-server), ``s3_server`` (a journaled moto S3 under the
broker's log), ``stack`` (``rlpipe up``/``down`` and the state file that says
where the running stack listens) and ``launcher`` (``rlpipe run``: a whole local
run as child processes).  Producers and consumers import these only inside the
functions that need them: production points at a real cluster and bucket.
"""
