"""optax's Muon, run one layer at a time over stacked parameters.

`optax.contrib.scale_by_muon` flattens every batch axis of a leaf (layers L, experts E, heads H) into one and
orthogonalises all of its matrices at once. On a sharded pod that materialises every layer's gathered
matrices and Newton-Schulz intermediates together: GLM-5's 75 MoE layers needed 725 GB of temporaries per
v5p chip. Here a leaf with a leading layer axis is orthogonalised under `jax.lax.map` over that axis, so only
one layer's matrices are live at a time. The update equals `scale_by_muon`'s (same momentum, bias correction
and Newton-Schulz; tested) and the state is the same `MuonState`, so checkpoints do not change.
"""

from __future__ import annotations

from typing import Callable

import jax
import optax
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon


def _drop_leading_axis(dims: MuonDimensionNumbers) -> MuonDimensionNumbers:
    shift = lambda axes: axes - 1 if isinstance(axes, int) else tuple(a - 1 for a in axes)
    return MuonDimensionNumbers(reduction_axis=shift(dims.reduction_axis), output_axis=shift(dims.output_axis))


def scale_by_muon_layerwise(
    dims_fn: Callable, layer_stacked_fn: Callable, *, ns_steps: int, beta: float, eps: float,
) -> optax.GradientTransformation:
    """`scale_by_muon(nesterov=True)` with `dims_fn(tree)` giving each leaf's `MuonDimensionNumbers` and
    `layer_stacked_fn(tree)` a bool per leaf: True where axis 0 is a layer axis to map over."""

    def leaf_muon(dims: MuonDimensionNumbers) -> optax.GradientTransformation:
        return scale_by_muon(ns_steps=ns_steps, beta=beta, eps=eps, nesterov=True, weight_dimension_numbers=dims)

    def init_fn(params):
        return leaf_muon(MuonDimensionNumbers()).init(params)

    def update_fn(updates, state, params=None):
        del params

        def update_leaf(update, mu, dims, layer_stacked):
            if not layer_stacked:
                out, new = leaf_muon(dims).update(update, MuonState(state.count, mu, state.ns_coeffs))
                return out, new.mu
            per_layer = leaf_muon(_drop_leading_axis(dims))

            def one_layer(update_and_mu):
                out, new = per_layer.update(update_and_mu[0], MuonState(state.count, update_and_mu[1],
                                                                        state.ns_coeffs))
                return out, new.mu
            return jax.lax.map(one_layer, (update, mu))

        results = jax.tree.map(update_leaf, updates, state.mu, dims_fn(updates), layer_stacked_fn(updates))
        new_updates, new_mu = jax.tree.transpose(jax.tree.structure(updates), jax.tree.structure((0, 0)), results)
        return new_updates, MuonState(optax.safe_increment(state.count), new_mu, state.ns_coeffs)

    return optax.GradientTransformation(init_fn, update_fn)
