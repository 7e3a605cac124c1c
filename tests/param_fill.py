"""Parameters for tests without compiling `init`: its pytree (from `jax.eval_shape`) filled from numpy the way
`init` fills it: norm scales 1, biases 0, every other leaf normal with std `config.initializer_range` (or `std`)."""

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.transformer import init


def random_params(config, seed, std=None):
    rng = np.random.default_rng(seed)
    std = config.initializer_range if std is None else std

    def fill(path, leaf):
        name = path[-1].key
        if name == "scale":
            value = np.ones(leaf.shape)
        elif name in ("bias", "e_score_correction_bias"):
            value = np.zeros(leaf.shape)
        else:
            value = std * rng.standard_normal(leaf.shape)
        # Cast on the host: a cast on the device would compile one program per leaf shape.
        return jnp.asarray(value.astype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(fill, jax.eval_shape(lambda: init(config, jax.random.key(0))))
