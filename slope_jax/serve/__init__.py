"""Serving: the `PrefillEngine` API, the request boundary, multi-process start-up and the per-host launcher."""
