"""Parameter-tree paths as plain names, the one spelling used for optimizer groups, sharding rules,
checkpoint checks and error messages: ("moe_layers", "attn", "q_b_proj", "kernel") / "moe_layers/attn/...".
"""

from __future__ import annotations


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_names(key_path) -> tuple[str, ...]:
    """A jax key path as a tuple of plain names."""
    return tuple(_key_name(entry) for entry in key_path)


def path_string(key_path) -> str:
    """A jax key path as "a/b/c"."""
    return "/".join(path_names(key_path))
