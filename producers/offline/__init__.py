"""Offline datasets on the producer side: logged data in, token trajectories out, and the
evaluation of what was trained on them back in the online environment.

Flow::

    npz + metadata (Smart Buildings layout) --import_smart_buildings--\\
    simulator days --generate_building_dataset (same layout) ---------> datasets/<name>/ (steps + card)
    CSV / Parquet + column mapping --import_table--------------------/
    datasets/<name>/ --dataset_to_trajectories--> runs/<run>/trajectories/... --`rlpipe replay --train`--> adapter
    adapter --evaluate_building--> runs/<run>/eval/*.json (vs the logged and the random policy)

Modules:
- ``episodes``: a time-sorted log cut into episodes and per-day steps tables (both
  importers), and ``DatasetImportError``.
- ``smart_buildings``: the Smart Buildings layout (``google/sbsim`` partitions): metadata
  (JSON, or a pickle read by an allow-list unpickler behind ``--trust-pickle``), partition
  checks and ``import_smart_buildings``.
- ``table``: ``import_table``, a CSV or Parquet log with a column mapping.
- ``generation``: building telemetry generation: simulated ``building-hvac`` days under
  scripted controllers, written in the Smart Buildings layout and imported like real data.
- ``trajectories``: logged building steps rendered as the online prompt (by the
  environment itself) and written as trajectory batches (``dataset_to_trajectories``).
- ``evaluation``: ``evaluate_building``, held-out days played by the adapter, the base
  model, the logged controller and the environment's scripted policies.
- ``cli``: the ``rlpipe datasets`` commands.

The card, partition and scan side of datasets, which the learner reads too, is
``pipeline.io.datasets``.
"""
