"""glm5_jax: GLM-5 as a pure-function JAX model with a jitted training-step library."""

__version__ = "0.1.0"
