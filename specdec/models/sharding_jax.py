"""Tensor parallelism for the JAX model: the mesh, how weights and the cache split over its "tp" axis, and
the forward in parts (`tp_parts`) that computes the same bits on every mesh of a size dividing the parts."""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import jax
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specdec.models.config import GemmaConfig, check_tensor_parallel, tp_split_axis
from specdec.models.fp8_jax import Fp8Weight
from specdec.models.gemma_jax import Cache, Params, Parts, forward, layer_prefix, pack_projections, pack_rows

TP_AXIS = "tp"


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D tensor-parallel mesh over the first `num_devices` devices (all by default)."""
    devices = jax.devices()[: num_devices or len(jax.devices())]
    return Mesh(np.array(devices), (TP_AXIS,))


def check_mesh(cfg: GemmaConfig, mesh: Mesh) -> None:
    """Every split dimension must divide evenly over the mesh; raised before anything is compiled."""
    check_tensor_parallel(cfg, mesh.shape[TP_AXIS])


def param_partition_spec(cfg: GemmaConfig, name: str, tp: int, param=None):
    """The mesh axis on the dimension config.tp_split_axis names (none: replicated; dimensions past the
    split one are whole). In parts (`tp` the parts), a packed weight (jax_gemma.pack_projections) splits by row.
    For an FP8 `param` (a pytree of values and scales), the specs of both: its scales split as its rows do, and
    stay whole where the reduction splits."""
    axis = 0 if "+" in name else tp_split_axis(cfg, name, tp)
    spec = P() if axis is None else P(*[None] * axis, TP_AXIS)
    if isinstance(param, Fp8Weight):
        return Fp8Weight(spec, spec if axis == 0 else P())
    return spec


def packed_params(params: Params) -> Params:
    """One device's weights with q/k/v and gate/up packed (jax_gemma.pack_projections), or their shapes.
    Weights already packed (from_checkpoint's, another engine's) come back as they are; others are copied
    packed, beside the caller's."""
    shapes = jax.eval_shape(pack_projections, params)
    if shapes.keys() == params.keys():
        return params  # packed already, or nothing to pack
    if all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params)):
        return shapes
    return _pack_fn(params)


_pack_fn = jax.jit(pack_projections)


def shard_params(params: Params, cfg: GemmaConfig, mesh: Mesh, parts: Parts | None = None) -> Params:
    """Weights split over the mesh; in `parts`, a layer at a time, split into whole parts and then packed in parts on
    each device (pack_on_devices), so that a device holds no more than one layer's weights twice."""
    if parts is None:
        check_mesh(cfg, mesh)
    tp = mesh.shape[TP_AXIS] if parts is None else parts.count

    def place(names) -> Params:
        return {name: jax.device_put(params[name], _named(mesh, param_partition_spec(cfg, name, tp, params[name])))
                for name in names}

    if parts is None:
        return place(params)
    placed = {}
    for _, names in itertools.groupby(sorted(params), key=layer_prefix):
        placed.update(pack_on_devices(place(names), mesh, parts))
    return placed


def _named(mesh: Mesh, specs):
    """NamedShardings over `mesh` for a spec or a pytree of them (an FP8 weight's)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def pack_on_devices(params: Params, mesh: Mesh, parts: Parts) -> Params:
    """jax_gemma.pack_projections(params, parts.count) of weights split by row over the mesh, each device packing
    its own rows: a device holds consecutive whole parts, so its rows packed part by part are its block of the
    packed whole. Packing the whole 31B on one GPU before splitting it held the packed projections beside the
    weights there, and then that GPU's block as well: more than an H200 holds (docs/journal)."""
    return pack_projections(params, pack=lambda weights: _row_packer(mesh, parts.local, len(weights))(*weights))


@functools.cache
def _row_packer(mesh: Mesh, local: int, count: int) -> Callable:
    """pack_rows of `count` weights in `local` parts on each device of the mesh, from and into row blocks."""
    by_row = P(TP_AXIS)
    return jax.jit(shard_map(lambda *weights: pack_rows(list(weights), local), mesh=mesh,
                             in_specs=(by_row,) * count, out_specs=by_row))



def cache_specs(cache: Cache):
    """Keys/values [B, n_kv, S, hd] split by KV head; slot positions replicated."""
    by_head = P(None, TP_AXIS, None, None)
    return {
        "keys": [None if k is None else by_head for k in cache["keys"]],
        "values": [None if v is None else by_head for v in cache["values"]],
        "slot_pos": {kind: P() for kind in cache["slot_pos"]},
    }


def cache_shardings(cache: Cache, mesh: Mesh):
    return _named(mesh, cache_specs(cache))


def forward_in_parts(cfg: GemmaConfig, mesh: Mesh, parts: Parts, params, cache: Cache, **static) -> Callable:
    """jax_gemma.forward in `parts` as one program over the mesh: (params, tokens, positions, cache) -> forward's
    (logits, hidden, cache). Each device runs its parts on its blocks of the weights and the cache (shard_map);
    the collectives are the forward's own (sum_parts' gathers, the lookups' sums, the LM head's gather), so no
    partitioner chooses where they go or in which order a reduction adds."""
    param_specs = {name: param_partition_spec(cfg, name, parts.count, param) for name, param in params.items()}
    specs = cache_specs(cache)

    def body(params, tokens, positions, cache):
        return forward(params, cfg, tokens, positions, cache, parts=parts, **static)

    hidden_spec = P() if static.get("hidden_layers") else None
    return shard_map(body, mesh=mesh, in_specs=(param_specs, P(), P(), specs), out_specs=(P(), hidden_spec, specs),
                     check_vma=False)


# -- the fused decode loop's state ---------------------------------------------------------------------
