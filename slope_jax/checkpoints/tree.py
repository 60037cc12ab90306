"""Nested parameter dicts ↔ flat `{"a/b": leaf}` maps (the names the loader, the writer and the orbax store use)."""

from __future__ import annotations


def flatten(tree: dict, prefix: str = "", leaf: type | None = None) -> dict:
    """`{"layers": {"wq": x}}` → `{"layers/wq": x}`. Nested dicts are descended into unless they are `leaf`s."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not (leaf is not None and isinstance(v, leaf)):
            out.update(flatten(v, prefix + k + "/", leaf))
        else:
            out[prefix + k] = v
    return out


def unflatten(flat: dict) -> dict:
    """Inverse of `flatten`."""
    out: dict = {}
    for k, v in flat.items():
        node = out
        parts = k.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out
