"""`ops.causal_selection`: the selection a top-k keeping every visible key makes, built without scoring any."""

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.ops.causal_attention import causal_selection
from pallas_kernels.masks import selected_mask, visible_keys


def test_causal_selection_is_the_top_ks_set_of_every_visible_key_valid_slots_first():
    # Three packed segments and trailing padding (id 0); a top-k of 12 slots over 12 keys keeps every visible one.
    segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 0], [4] * 12])
    num_keys = segment_ids.shape[1]
    visible = visible_keys(segment_ids, segment_ids)
    scores = jnp.where(visible, jax.random.normal(jax.random.key(0), visible.shape), -jnp.inf)
    values, ranked = jax.lax.top_k(scores, num_keys)
    ranked = jnp.where(values > -jnp.inf, ranked, -1)

    selection = causal_selection(segment_ids, num_keys)
    assert selection.dtype == jnp.int32 and selection.shape == ranked.shape
    np.testing.assert_array_equal(selected_mask(selection, num_keys), selected_mask(ranked, num_keys))
    np.testing.assert_array_equal(selected_mask(selection, num_keys), visible)
    valid = np.asarray(selection >= 0)
    np.testing.assert_array_equal(valid, np.asarray(ranked >= 0))  # the same count, first in each row
    np.testing.assert_array_equal(valid.sum(-1), np.asarray(visible).sum(-1))
