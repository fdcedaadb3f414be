"""The Tinker-compatible API's engine side: the trainer role (``worker``) and the SDK-to-engine translation."""
