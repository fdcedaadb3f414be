"""The Tinker-compatible API's engine side: the SDK's training calls executed on a ``TrainingEngine``.

``worker`` is the trainer role (it executes each model's calls from ``<ns>.requests``
in ``seq_id`` order); ``ops`` is what it calls (one function per Tinker training
call, the SDK's own types in and out); ``translate`` turns the SDK's datums and
loss configurations into the engine's.  Every refusal is a
``schemas.api.ApiError`` with category ``user``, raised before anything changed.
"""
