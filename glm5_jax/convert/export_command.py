"""`glm5 export-hf` (see glm5_jax.convert.commands)."""

from glm5_jax.convert.commands import export_main as main  # noqa: F401
