"""`glm5 import-hf` (see glm5_jax.convert.commands)."""

from glm5_jax.convert.commands import import_main as main  # noqa: F401
