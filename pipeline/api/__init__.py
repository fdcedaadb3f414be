"""The Tinker-compatible API's gateway: wire format (``wire``), tenants, the gateway's logic and its ASGI app."""
