"""Gemma 3 / Gemma 4 text models in PyTorch, over a static preallocated KV cache.

One forward runs T new tokens per row at absolute positions against the cache as it stands, then commits
their keys/values. Nothing is allocated per token on the host and every shape is fixed by (B, T), so a
forward of a given T can be captured in a CUDA graph and replayed.

Cache semantics (shared with the JAX model, see docs/design.md, "The KV cache"):
- sliding layers keep a ring of at least `window + k_max` slots (a rejected draft never overwrites a
  position still inside the next query's window; GemmaConfig.cache_slots); full layers keep every position
  (both rounded up to whole splits of the decode attention's blocks). Each slot stores the absolute position
  written there; masks come from stored positions.
- two ways to run a chunk. A *decode* forward (`commit_first=True`; what the engines run for every verify,
  T <= decode_width(k_max)) writes its positions and keys/values into their slots first, layer by layer, and each
  row attends over the cache alone, to the slots holding positions <= its own. A row then reads exactly
  the slots, values and reduction order that a one-token forward at its position reads: with one fixed
  forward width (the engines' invariant mode) its logits are bitwise those of plain decoding. A *prefill*
  forward (long chunks, which could overwrite ring slots their own first rows still need) attends over
  the cached slots with position < its first position, plus itself causally, and commits at the end.
- Rolling back rejected drafts is free either way: the next chunk starts at the first rejected position
  and overwrites their slots; until then their positions lie beyond every query and are masked.
- k_eq_v layers store one tensor, the normed raw K projection, which *is* V; K is rebuilt from it
  (times k_norm's weight, then RoPE at the stored positions) when read.
- KV-shared layers read their producer's cache and the producer's new keys/values of this chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models import decode_attention_torch, fp8, fp8_torch, skinny_gemm
from specdec.models.config import (FULL, SLIDING, GemmaConfig, LayerSpec, RopeSpec, check_tp_parts, rope_inv_freq,
                                   tp_split_axis, vocab_rows)
from specdec.models.decode_plan import SPLIT_MAX_ROWS, reduction_splits
from specdec.models.memory import free_bytes


# Experts are gathered per token while that reads fewer weights than running every expert densely.
def _gather_experts(num_tokens: int, top_k: int, num_experts: int) -> bool:
    return num_tokens * top_k < num_experts


def rope_tables(spec: RopeSpec, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_len, head_dim] in float32, indexed by absolute position. Computed on the CPU
    whatever the default device (the meta device of from_checkpoint has no values to give, and its
    arange would import torch's Python meta kernels and sympy: seconds of every cold start)."""
    positions = torch.arange(max_len, dtype=torch.float32, device="cpu")
    freqs = positions[:, None] * torch.tensor(rope_inv_freq(spec, head_dim), device="cpu")[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, cfg: GemmaConfig) -> torch.Tensor:
    """Gemma RMSNorm in float32: Gemma 3 scales by (1 + w) with rsqrt, Gemma 4 by w with pow(-0.5)
    (each as its reference does it, so low bits match); weight None is Gemma 4's scale-free v-norm."""
    xf = x.float()
    mean_sq = xf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps
    normed = xf * (torch.pow(mean_sq, -0.5) if cfg.is_gemma4 else torch.rsqrt(mean_sq))
    if weight is not None:
        normed = normed * (cfg.norm_weight_offset + weight.float())
    return normed.type_as(x)


# oneDNN's inner product, which inductor runs for linears on the CPU; torch builds without it keep F.linear
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T. On the CPU in float32, by oneDNN: MKL's GEMM behind F.linear took 2.7x as long for the real
    270M's LM head at a decode forward's 8 rows on 2 cores (docs/journal). Autograd and torch.compile keep
    F.linear (inductor lowers oneDNN's op only for frozen weights)."""
    if (ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T; with `scale`, weight holds FP8 values and `scale` their rows' scales (fp8_torch). For a decode
    forward's few rows on a GPU, cuBLAS runs one tile per 128 output columns, so a weight of few columns (an o_proj,
    E4B's attention and per-layer projections, the 270M's layers) leaves most SMs idle: 0.2-2.2 TB/s on an H200.
    Compiled, the reduction there is split in slices whose products the kernel that reads them adds in float32
    (docs/journal, issue 11): on Hopper, for bf16 weights up to skinny_gemm.MAX_WEIGHT_BYTES and FP8 weights
    of any size, by skinny_gemm's kernel, which loads the weight while the kernel before it finishes (for bf16, a
    server's decode forwards of up to skinny_gemm.WIDE_MAX_ROWS rows too); else as a batched GEMM over
    `reduction_splits` slices. Eagerly, those adds would be kernels of their own, so it stays one GEMM."""
    if x.is_cuda and torch.compiler.is_compiling():
        rows, (columns, reduction) = x.numel() // x.shape[-1], weight.shape
        if skinny_gemm.takes(weight, rows):
            splits = skinny_gemm.splits(reduction) if scale is None else skinny_gemm.fp8_splits(rows, columns, reduction)
            products = torch.ops.specdec.split_products(x.reshape(rows, reduction).contiguous(), weight, splits,
                                                        scale)
            return sum_products(products, x)
        splits = reduction_splits(rows, columns, reduction)
        if splits > 1 and scale is None:
            return sum_products(split_products(x, weight, splits), x)
    return dense_linear(x, weight) if scale is None else fp8_torch.product(x, weight, scale)


def through(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """x through an nn.Linear of the model, in FP8 where GemmaModel.quantize_fp8 made it so."""
    return linear(x, module.weight, getattr(module, "weight_scale", None))


def split_products(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """One batched GEMM over `splits` slices of the reduction (views of the weight, not copies): the slices'
    products of x's rows [..., reduction] with weight.T, [splits, rows, columns], not yet summed."""
    columns, reduction = weight.shape
    part = reduction // splits
    rows = x.reshape(-1, splits, part).transpose(0, 1)  # [splits, rows, part]
    return torch.bmm(rows, weight.view(columns, splits, part).permute(1, 2, 0))


def sum_products(products: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The slices' products [splits, rows, columns] of x's rows added in float32, in x's dtype and leading shape."""
    total = products[0].float()
    for product in products[1:]:  # added one by one, which inductor fuses into the kernel that reads the sum
        total = total + product.float()
    return total.to(x.dtype).view(*x.shape[:-1], products.shape[-1])


def gelu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated activation: gelu_tanh(gate) * up."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP: down(gelu_tanh(gate(x)) * up(x)), weights in [out, in] layout."""
    return dense_linear(gelu_gate(dense_linear(x, gate), dense_linear(x, up)), down)


class RMSNorm(nn.Module):
    """rms_norm with its weight; `with_scale=False` is Gemma 4's v-norm."""

    def __init__(self, dim: int, cfg: GemmaConfig, with_scale: bool = True):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.cfg)


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    """The devices' `x` [N, ...] concatenated along the first dimension in rank order, [devices * N, ...]. A
    functional collective, so torch.compile traces it and CUDA graphs capture it."""
    from torch.distributed import _functional_collectives as collectives

    gather = getattr(collectives, "all_gather_single", None) or collectives.all_gather_tensor  # renamed in torch 2.13
    return gather(x.contiguous(), 0, group)


def sum_across(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of the devices' partial outputs of a row-parallel linear (tensor parallelism; group None:
    one device, nothing to sum). A functional collective, so torch.compile traces it and CUDA graphs capture it."""
    if group is None:
        return x
    from torch.distributed import _functional_collectives as collectives

    return collectives.all_reduce(x, "sum", group)


def gather_across(x: torch.Tensor, group) -> torch.Tensor:
    """The devices' slices of the last dimension of `x`, concatenated in rank order (the logits of a
    vocabulary-split LM head). A functional collective, as sum_across. Gathered along the first dimension and
    rearranged here: a gather along another dimension chunks and concatenates in a helper that torch.compile
    refuses to trace (torch 2.11)."""
    stacked = _gather_first(x, group).view(-1, *x.shape)  # [devices, ...]
    return stacked.movedim(0, -2).flatten(-2)


def sum_parts(partials: list[torch.Tensor], group) -> torch.Tensor:
    """The output of a row-parallel linear computed in parts (GemmaModel's `tp_parts`) from its parts' partial
    outputs: every device's parts gathered in rank order, added one by one in float32 and rounded once. One
    device holding every part and two devices holding half of them each add the same partials in the same
    order, so they agree to the bit (an all-reduce's order is the library's)."""
    if group is not None:
        partials = _gather_first(torch.stack(partials), group).unbind(0)  # every part, in rank order
    total = partials[0].float()
    for part in partials[1:]:
        total = total + part.float()
    return total.to(partials[0].dtype)


def lookup(table: torch.Tensor, tokens: torch.Tensor, first_row: int | None, group) -> torch.Tensor:
    """The rows of a token table for `tokens` [...] -> [..., D]. A table split by vocabulary over a
    tensor-parallel group holds rows first_row.. of the whole: each device gives zeros for the tokens it does
    not hold, and the sum across devices is every token's row, exactly, on every device."""
    if first_row is None:
        return F.embedding(tokens, table)
    local = tokens - first_row
    held = (local >= 0) & (local < table.shape[0])
    rows = F.embedding(local.clamp(0, table.shape[0] - 1), table)
    return sum_across(torch.where(held[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)), group)


class Packed(nn.Module):
    """Linears that read one input, run as one GEMM: at decode a small GEMM costs a launch (~4 us on an
    H100) however few rows it has, so q/k/v and gate/up packed make a layer 4 GEMMs instead of 7. The
    linears keep their checkpoint names; `pack` (after the weights are loaded) makes each weight a view
    into one packed matrix, and until then `project` concatenates them.

    In `parts` (GemmaModel's `tp_parts`), each part's rows of every linear are packed together, [parts, rows of a
    part, in], and the row-parallel linear `row_parallel` (whose input the parts split) becomes its parts'
    column slices, [parts, out, in / parts]: each part is then the matrix a device holding it alone would hold."""

    def __init__(self, names: tuple[str, ...], row_parallel: str, parts: int | None):
        super().__init__()
        self.names = names
        self.row_parallel = row_parallel
        self.parts = parts
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("packed_scale", None, persistent=False)  # FP8 weights' (fp8_torch)

    def linears(self) -> list[nn.Linear]:
        return [getattr(self, n) for n in self.names if hasattr(self, n)]

    def pack(self) -> None:
        linears = self.linears()
        scaled = hasattr(linears[0], "weight_scale")  # FP8 (fp8_torch): the scales pack as their rows do

        def by_rows(tensors):
            """The linears' rows in order; in parts, each part's rows of each: [parts, rows of a part, ...]."""
            if self.parts is None:
                return torch.cat(tensors)
            return torch.stack([torch.cat([t.chunk(self.parts)[part] for t in tensors]) for part in range(self.parts)])

        packed = by_rows([lin.weight.detach() for lin in linears])
        if scaled:
            self.packed_scale = by_rows([lin.weight_scale for lin in linears])
        if self.parts is not None:
            out = getattr(self, self.row_parallel)
            out.weight = nn.Parameter(torch.stack(out.weight.detach().chunk(self.parts, dim=-1)), requires_grad=False)
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0] // (self.parts or 1)
            lin.weight = nn.Parameter(packed[..., start : start + rows, :], requires_grad=False)
            if scaled:
                lin.weight_scale = self.packed_scale[..., start : start + rows]
            start += rows
        self.packed = packed

    def project(self, x: torch.Tensor, part: int = 0) -> list[torch.Tensor]:
        """x through every linear of `names` the module has, in that order (in `parts`: their rows of `part`)."""
        linears = self.linears()
        scale = None
        if self.parts is None and self.packed is not None:
            weight, scale = self.packed, self.packed_scale
        elif self.parts is None:
            weight = torch.cat([lin.weight for lin in linears])
            if hasattr(linears[0], "weight_scale"):
                scale = torch.cat([lin.weight_scale for lin in linears])
        else:  # packed as GemmaModel's constructors leave it: each linear's weight [parts, rows of a part, in]
            weight = self.packed[part]
            scale = None if self.packed_scale is None else self.packed_scale[part]
        return list(linear(x, weight, scale).split([lin.weight.shape[-2] for lin in linears], dim=-1))

    def combine(self, outputs, group) -> torch.Tensor:
        """The row-parallel linear's output: over `outputs` (one input per part, in `parts`; else the one input),
        summed across the tensor-parallel group."""
        out = getattr(self, self.row_parallel)
        if self.parts is None:
            return sum_across(through(outputs, out), group)
        scale = getattr(out, "weight_scale", None)  # FP8: the whole rows' scales, for every part
        return sum_parts([linear(x, out.weight[part], scale) for part, x in enumerate(outputs)], group)  # [parts, out, in]


class MLP(Packed):
    def __init__(self, hidden: int, intermediate: int, tp_group=None, parts: int | None = None):
        super().__init__(("gate_proj", "up_proj"), "down_proj", parts)
        self.tp_group = tp_group
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            return self.combine(gelu_gate(*self.project(x)), self.tp_group)
        return self.combine([gelu_gate(*self.project(x, part)) for part in range(self.parts)], self.tp_group)


@dataclass
class KVCache:
    """Preallocated per-layer key/value storage plus the absolute position held by each slot."""

    keys: list[torch.Tensor | None]  # per layer [B, n_kv, slots, head_dim]; None for KV-shared layers
    values: list[torch.Tensor | None]  # None also for k_eq_v layers (their keys tensor holds V)
    slot_pos: dict[str, torch.Tensor]  # kind -> [B, slots] int64, -1 = empty

    @classmethod
    def allocate(cls, cfg: GemmaConfig, batch: int, max_seq_len: int, k_max: int, dtype, device,
                 lookahead: int = 0) -> "KVCache":
        device = torch.device(device)
        cfg.check_cache_fits(batch, max_seq_len, k_max, dtype.itemsize, free_bytes("torch", device), str(device),
                             lookahead)
        layout = cfg.kv_cache_shapes(batch, max_seq_len, k_max, lookahead)
        zeros = lambda shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        keys = [zeros(entry[0]) if entry else None for entry in layout]
        values = [zeros(entry[0]) if entry and entry[1] else None for entry in layout]
        slots = cfg.cache_slots(max_seq_len, k_max, lookahead)
        slot_pos = {kind: torch.full((batch, n), -1, dtype=torch.long, device=device) for kind, n in slots.items()}
        return cls(keys, values, slot_pos)

    def reset(self) -> None:
        for pos in self.slot_pos.values():
            pos.fill_(-1)

    def slots(self, kind: str) -> int:
        return self.slot_pos[kind].shape[1]

    def rows(self, start: int, stop: int) -> "KVCache":
        """A view of rows start..stop-1: writes through it land in this cache."""
        sl = slice(start, stop)
        return KVCache(
            [k[sl] if k is not None else None for k in self.keys],
            [v[sl] if v is not None else None for v in self.values],
            {kind: pos[sl] for kind, pos in self.slot_pos.items()},
        )


@dataclass
class ChunkContext:
    """Per-forward tensors shared by every layer of a kind (built once per forward)."""

    cos: dict[str, torch.Tensor]  # kind -> [B, T, 1, hd] for the new tokens
    sin: dict[str, torch.Tensor]
    cached_cos: dict[str, torch.Tensor]  # kind -> [B, 1, S, hd] at stored positions (k_eq_v rebuild)
    cached_sin: dict[str, torch.Tensor]
    cache_mask: dict[str, torch.Tensor]  # kind -> [B, 1, T, 1, S] bool, True = may attend (Attention's row order)
    # decode: kind -> the lowest and highest stored position each row attends, [B, T] each (cache_mask's bounds, and
    # what decode_attention_torch's kernel reads instead of it)
    attended: dict[str, tuple[torch.Tensor, torch.Tensor]]
    chunk_mask: dict[str, torch.Tensor] | None  # kind -> [B, 1, T, 1, T]; None: committed first (decode)
    slots: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # kind -> (rows, slot, position) to write
    pending_writes: list  # prefill: (layer index, stored keys [B,n_kv,T,hd], values or None, first KV head)

    @property
    def committed_first(self) -> bool:
        return self.chunk_mask is None


def _write_kv(cache: KVCache, index: int, slots, keys: torch.Tensor, values: torch.Tensor | None,
              first_head: int = 0) -> None:
    """Store a chunk's keys (and values) [B, n_kv, T, hd] of layer `index` at their slots (the last
    `slots` tokens when the chunk is longer than a ring), as KV heads first_head.. of the cache. Indexed in the
    cache's own layout: written through a transposed view, the compiled CUDA forward copied each layer's whole
    cache out and back per forward (a 31B step on an H200 took 1.2 ms longer)."""
    rows, slot, _ = slots
    n = slot.shape[1]
    heads = torch.arange(first_head, first_head + keys.shape[1], device=keys.device)[None, :, None]
    where = (rows[:, :, None], heads, slot[:, None, :])  # -> [B, n_kv, n]
    cache.keys[index].index_put_(where, keys[:, :, -n:])
    if values is not None:
        cache.values[index].index_put_(where, values[:, :, -n:])


class Attention(Packed):
    def __init__(self, cfg: GemmaConfig, spec: LayerSpec, tp_group=None, parts: int | None = None):
        super().__init__(("q_proj", "k_proj", "v_proj"), "o_proj", parts)
        self.tp_group = tp_group
        self.spec = spec
        self.num_heads = cfg.num_heads
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_logit_softcapping
        hd, nkv, h = spec.head_dim, spec.num_kv_heads, cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg)
        if spec.owns_cache:
            self.k_proj = nn.Linear(h, nkv * hd, bias=False)
            self.k_norm = RMSNorm(hd, cfg)
            if not spec.k_eq_v:
                self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_norm = RMSNorm(hd, cfg, with_scale=False) if cfg.is_gemma4 else None

    def _keys_from_stored(self, stored: torch.Tensor, cos, sin) -> torch.Tensor:
        """k_eq_v: K = RoPE(k_norm.weight * normed raw K), from the stored normed raw K ([B, n_kv, S, hd])."""
        k = (stored.float() * self.k_norm.weight.float()).type_as(stored)
        return apply_rope(k, cos, sin)

    def project_kv(self, raw: list[torch.Tensor], ctx: ChunkContext):
        """New keys/values of this chunk, [B, n_kv, T, hd] each, and what the cache stores for them, from the
        raw K (and V) projections [B, T, n_kv * hd]."""
        B, T, _ = raw[0].shape
        hd, kind = self.spec.head_dim, self.spec.kind
        raw_k = raw[0].view(B, T, -1, hd)
        if self.spec.k_eq_v:
            v = self.v_norm(raw_k).transpose(1, 2)
            k = self._keys_from_stored(v, ctx.cos[kind].transpose(1, 2), ctx.sin[kind].transpose(1, 2))
            return k, v, (v, None)
        k = apply_rope(self.k_norm(raw_k), ctx.cos[kind], ctx.sin[kind]).transpose(1, 2)
        v = raw[1].view(B, T, -1, hd)
        if self.v_norm is not None:
            v = self.v_norm(v)
        v = v.transpose(1, 2)
        return k, v, (k, v)

    def forward(self, x, ctx: ChunkContext, cache: KVCache, shared_kv: dict):
        if self.parts is None:
            return self.combine(self._attend(self.project(x), 0, ctx, cache, shared_kv), self.tp_group)
        return self.combine([self._attend(self.project(x, part), part, ctx, cache, shared_kv)
                             for part in range(self.parts)], self.tp_group)

    def _attend(self, projected: list[torch.Tensor], part: int, ctx: ChunkContext, cache: KVCache, shared_kv: dict):
        """Attention of one part's query heads over its KV heads (in `parts`; else of every head here) from their
        projections [q, then k and v where this layer has them], [B, T, heads * hd], before o_proj."""
        spec = self.spec
        hd, kind = spec.head_dim, spec.kind
        nkv = spec.num_kv_heads // (self.parts or 1)
        groups = self.num_heads // spec.num_kv_heads
        heads = slice(part * nkv, (part + 1) * nkv)  # this part's KV heads of the cache
        in_part = (lambda t: t) if (self.parts or 1) == 1 else (lambda t: t[:, heads])
        q, *raw_kv = projected
        B, T, _ = q.shape
        q = apply_rope(self.q_norm(q.view(B, T, nkv * groups, hd)), ctx.cos[kind], ctx.sin[kind])
        # [B, n_kv, T*groups, hd], rows by token, then query head: head h uses kv head h // groups. In this order
        # the output is [B, T, heads*hd] without a copy where there is one KV head (the 270M: one kernel a layer).
        q = q.view(B, T, nkv, groups, hd).transpose(1, 2).reshape(B, nkv, T * groups, hd)

        if spec.owns_cache:
            k_new, v_new, stored = self.project_kv(raw_kv, ctx)
            if ctx.committed_first:
                _write_kv(cache, spec.index, ctx.slots[kind], *stored, first_head=heads.start)
            else:
                ctx.pending_writes.append((spec.index, *stored, heads.start))
                shared_kv[spec.index, part] = (k_new, v_new)
        elif not ctx.committed_first:
            k_new, v_new = shared_kv[spec.kv_source, part]
        k_old = in_part(cache.keys[spec.kv_source])
        v_old = cache.values[spec.kv_source]
        if v_old is None:  # k_eq_v: the stored tensor is V; rebuild K at the stored positions
            v_old = k_old
            k_old = self._keys_from_stored(k_old, ctx.cached_cos[kind], ctx.cached_sin[kind])
        else:
            v_old = in_part(v_old)

        if ctx.committed_first and decode_attention_torch.takes(q, k_old, self.softcap):
            return torch.ops.specdec.decode_attention(q, k_old, v_old, cache.slot_pos[kind], *ctx.attended[kind],
                                                      self.scale, groups)
        # Decode: the cache alone. Prefill: [cached slots | this chunk] without concatenating the cache;
        # scores are joined for one softmax, then split again for the value products.
        parts = [(k_old, v_old, ctx.cache_mask[kind])]
        if not ctx.committed_first:
            parts.append((k_new, v_new, ctx.chunk_mask[kind]))
        scores = torch.cat([q @ k.transpose(-1, -2) for k, _, _ in parts], dim=-1) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        mask = torch.cat([m for _, _, m in parts], dim=-1)
        width = scores.shape[-1]
        scores = scores.view(B, nkv, T, groups, width).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(B, nkv, T * groups, width)
        widths = [v.shape[2] for _, v, _ in parts]
        out, *rest = [p @ v for p, (_, v, _) in zip(probs.split(widths, dim=-1), parts)]
        for product in rest:  # not sum(): its 0 + out would be a kernel of its own
            out = out + product
        return out.view(B, nkv, T, groups, hd).transpose(1, 2).reshape(B, T, nkv * groups * hd)


class Router(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.norm = RMSNorm(cfg.hidden_size, cfg, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root_size = cfg.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Experts(nn.Module):
    def __init__(self, cfg: GemmaConfig, tp_group=None):
        """`tp_group`: split by expert over the group when the experts divide (config.tp_split_axis): each
        device runs the chosen experts it holds, and the devices' outputs are summed."""
        super().__init__()
        e, mi, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.tp_group, self.first_expert = e, tp_group, None
        shard = group_shard(tp_group)
        if shard is not None and tp_split_axis(cfg, "experts.down_proj", shard[1]) == 0:
            e //= shard[1]
            self.first_expert = shard[0] * e
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * mi, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, mi))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights/index [N, k] (the router's, over every expert) -> [N, H]; static shapes either
        way (graph-capturable). The path depends on the whole model's expert count, so each device of a
        split computes its experts as one device would."""
        n, k = index.shape
        held = self.gate_up_proj.shape[0]
        if self.first_expert is not None:  # the chosen experts another device holds weigh 0 here
            index = index - self.first_expert
            weights = torch.where((index >= 0) & (index < held), weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
            index = index.clamp(0, held - 1)
        if _gather_experts(n, k, self.num_experts):
            gate, up = torch.einsum("nh,nkih->nki", x, self.gate_up_proj[index]).chunk(2, dim=-1)
            out = torch.einsum("nki,nkhi->nkh", gelu_gate(gate, up), self.down_proj[index])
            out = (out * weights[..., None].to(out.dtype)).sum(dim=1)
        else:  # every expert held over every token, weighted by its routing weight (0 where not chosen)
            dense_weights = torch.zeros(n, held, dtype=weights.dtype, device=x.device).scatter_add(1, index, weights)
            out = torch.zeros_like(x)
            for e in range(held):
                gate, up = dense_linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                y = dense_linear(gelu_gate(gate, up), self.down_proj[e])
                out = out + y * dense_weights[:, e : e + 1].to(y.dtype)
        return out if self.first_expert is None else sum_across(out, self.tp_group)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, spec: LayerSpec, tp_group=None, parts: int | None = None):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, spec, tp_group, parts)
        self.mlp = MLP(h, spec.intermediate_size, tp_group, parts)
        self.input_layernorm = RMSNorm(h, cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg)
        self.pre_feedforward_layernorm = RMSNorm(h, cfg)
        self.post_feedforward_layernorm = RMSNorm(h, cfg)
        self.gemma4 = cfg.is_gemma4
        if cfg.is_gemma4:
            self.register_buffer("layer_scalar", torch.ones(1))
        self.has_ple = cfg.has_per_layer_inputs
        if self.has_ple:
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(h, p, bias=False)
            self.per_layer_projection = nn.Linear(p, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, cfg)
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(cfg)
            self.experts = Experts(cfg, tp_group)
            self.post_feedforward_layernorm_1 = RMSNorm(h, cfg)
            self.post_feedforward_layernorm_2 = RMSNorm(h, cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, cfg)

    def forward(self, x, per_layer_input, ctx: ChunkContext, cache: KVCache, shared_kv: dict):
        residual = x
        x = residual + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx, cache, shared_kv))
        residual = x
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            flat = residual.reshape(-1, residual.shape[-1])
            weights, index = self.router(flat)
            moe_out = self.experts(self.pre_feedforward_layernorm_2(flat), weights, index).reshape(residual.shape)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe_out)
        x = residual + self.post_feedforward_layernorm(h)
        if self.has_ple:
            gated = gelu_gate(through(x, self.per_layer_input_gate), per_layer_input)
            x = x + self.post_per_layer_input_norm(through(gated, self.per_layer_projection))
        if self.gemma4:
            x = x * self.layer_scalar
        return x


def group_shard(tp_group) -> tuple[int, int] | None:
    """(this device's rank, the group's size) of a tensor-parallel group, as checkpoint.shard_index takes it;
    None without a group."""
    if tp_group is None:
        return None
    import torch.distributed as dist

    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _vocab_share(cfg: GemmaConfig, name: str, shard: tuple[int, int] | None) -> slice | None:
    """This device's rows of token table `name`; None when it is whole (no tensor parallelism, a vocabulary
    the devices do not divide, or no such table)."""
    from specdec.models.checkpoint import shard_index

    vocab = vocab_rows(cfg, name)
    index = shard_index(cfg, name, (vocab,), shard) if vocab else (...,)
    return None if index == (...,) else index[0]


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding left uninitialised (the checkpoint's weights replace it): on the meta device, where
    from_checkpoint builds the model, nn.Embedding's own normal_ init would import torch's Python meta
    kernels and sympy, seconds of every cold start."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class GemmaModel(nn.Module):
    """The text model; parameter names are the checkpoint's stripped HF names."""

    def __init__(self, cfg: GemmaConfig, max_seq_len: int = 4096, tp_group=None, tp_parts: int | None = None):
        """`tp_group`: a torch.distributed group over which the model runs tensor-parallel; `cfg` is then this
        device's share (GemmaConfig.shard): the outputs of o_proj and down_proj are summed across it, and the
        token tables it splits by vocabulary (config.tp_split_axis) are looked up across it, the LM head's
        logits gathered from it.

        `tp_parts`: every split weight is computed in that many parts on any number of devices that divides it, so
        that they all compute the same bits (check_tp_parts says how)."""
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        self.tp_parts = tp_parts
        devices = 1 if tp_group is None else group_shard(tp_group)[1]
        self.parts = None if tp_parts is None else tp_parts // devices  # the parts this device computes
        h = cfg.hidden_size
        # This device's rows of each token table (None: the table is whole).
        self.vocab_share = {name: _vocab_share(cfg, name, group_shard(tp_group))
                            for name in ("embed_tokens.weight", "embed_tokens_per_layer.weight")}
        self.embed_tokens = _embedding(self._rows("embed_tokens.weight"), h)
        self.layers = nn.ModuleList([DecoderLayer(cfg, spec, tp_group, self.parts) for spec in cfg.layers])
        self.norm = RMSNorm(h, cfg)
        if not cfg.tie_word_embeddings:  # split as the embedding is: the same vocabulary
            self.lm_head = nn.Linear(h, self._rows("embed_tokens.weight"), bias=False)
        if cfg.has_per_layer_inputs:
            ple = cfg.num_layers * cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = _embedding(self._rows("embed_tokens_per_layer.weight"), ple)
            self.per_layer_model_projection = nn.Linear(h, ple, bias=False)
            self.per_layer_projection_norm = RMSNorm(cfg.hidden_size_per_layer_input, cfg)
        self.max_seq_len = max_seq_len
        self._build_rope_tables()

    def _build_rope_tables(self) -> None:
        for kind in (SLIDING, FULL):
            cos, sin = rope_tables(self.cfg.rope[kind], self.cfg.kind_head_dim(kind), self.max_seq_len)
            self.register_buffer(f"cos_{kind}", cos, persistent=False)
            self.register_buffer(f"sin_{kind}", sin, persistent=False)

    @classmethod
    def from_checkpoint(cls, path, dtype=torch.float32, device="cpu", max_seq_len: int = 4096,
                        tp_group=None, tp_parts: int | None = None, fp8: bool = False) -> "GemmaModel":
        """`tp_group`: load this device's share of a tensor-parallel model over the group (each device reads
        only its slices of the split weights); `tp_parts`: as __init__'s; `fp8`: the linears in FP8
        (quantize_fp8)."""
        from specdec.models.checkpoint import load_checkpoint

        shard = group_shard(tp_group)
        cfg, tensors = load_checkpoint(path, framework="pt", dtype=dtype, device=device, shard=shard)
        if tp_parts is not None:
            check_tp_parts(cfg, tp_parts, 1 if shard is None else shard[1])
        if shard is not None:
            cfg = cfg.shard(shard[1])
        with torch.device("meta"):
            model = cls(cfg, max_seq_len, tp_group, tp_parts)
        model.load_state_dict(tensors, strict=True, assign=True)
        model._build_rope_tables()  # non-persistent buffers are rebuilt off the meta device
        del tensors  # packing frees each separate weight only once nothing else holds it (else: twice the memory)
        model = model.to(device).eval()
        return (model.quantize_fp8() if fp8 else model).pack_projections()

    @classmethod
    def random(cls, cfg: GemmaConfig, dtype=torch.bfloat16, device="cpu", max_seq_len: int = 4096,
               seed: int = 0, tp_group=None, tp_parts: int | None = None, fp8: bool = False) -> "GemmaModel":
        """Random weights of a config, drawn on the device (benchmarks at real shapes; gemma_jax.random_params
        is the JAX twin): matrices ~ N(0, 1/fan_in), norms and scalars at their neutral value. Each matrix is
        drawn whole from its own seed, so the devices of a tensor-parallel model (`tp_group`: this device
        keeps its slices) hold slices of one model."""
        from specdec.models.checkpoint import expected_shapes, shard_index

        shard = group_shard(tp_group)
        if tp_parts is not None:
            check_tp_parts(cfg, tp_parts, 1 if shard is None else shard[1])
        local = cfg if shard is None else cfg.shard(shard[1])
        with torch.device("meta"):
            model = cls(local, max_seq_len, tp_group, tp_parts)
        model = model.to(dtype).to_empty(device=device)  # cast on the meta device: nothing allocated in fp32
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        neutral = 1.0 - cfg.norm_weight_offset  # Gemma 3 norms scale by (1 + w), Gemma 4 by w
        with torch.no_grad():
            for i, (name, shape) in enumerate(sorted(expected_shapes(cfg).items())):
                if len(shape) == 1:
                    tensors[name].fill_(neutral)
                    continue
                gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
                whole = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, shape[-1] ** -0.5, generator=gen)
                tensors[name].copy_(whole[shard_index(cfg, name, shape, shard)])
        model._build_rope_tables()
        del tensors, whole  # as in from_checkpoint: packing must be the weights' last holder
        model = model.to(device).eval()
        return (model.quantize_fp8() if fp8 else model).pack_projections()

    def quantize_fp8(self) -> "GemmaModel":
        """Every linear that fp8.quantizes as FP8 values and a `weight_scale` per output row (fp8_torch), in place,
        one weight at a time, before packing; a tied LM head gets an FP8 copy of its own as `lm_head`, so the token
        table keeps its rows. Under tensor parallelism, a row-parallel linear's scales are its whole rows': each
        device count (and parts) quantizes to one device's bits."""
        if self.cfg.tie_word_embeddings:
            table = self.embed_tokens.weight
            self.lm_head = nn.Linear(table.shape[1], table.shape[0], bias=False, device="meta")
            self.lm_head.weight = nn.Parameter(table.detach(), requires_grad=False)  # quantized below, as a copy
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and fp8.quantizes(f"{name}.weight", module.weight.shape):
                split_rows = tp_split_axis(self.cfg, f"{name}.weight", 1) == 1  # this device holds some columns
                values, scale = fp8_torch.quantize(module.weight.detach(), self.tp_group if split_rows else None)
                module.weight = nn.Parameter(values, requires_grad=False)
                module.register_buffer("weight_scale", scale)
        return self

    def pack_projections(self) -> "GemmaModel":
        """Pack each layer's q/k/v and gate/up weights (Packed), in place, once the weights are where they stay."""
        for module in self.modules():
            if isinstance(module, Packed):
                module.pack()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def fp8(self) -> bool:
        """Whether the linears are FP8 (quantize_fp8)."""
        return hasattr(getattr(self, "lm_head", None), "weight_scale")

    def allocate_cache(self, batch: int, k_max: int = 8, max_seq_len: int | None = None, lookahead: int = 0) -> KVCache:
        n = max_seq_len or self.max_seq_len
        if n > self.max_seq_len:
            raise ValueError(f"cache of {n} positions exceeds the model's RoPE tables ({self.max_seq_len})")
        return KVCache.allocate(self.cfg, batch, n, k_max, self.dtype, self.embed_tokens.weight.device, lookahead)

    def _scale(self, value: float) -> float:
        """A scale rounded to the weights' dtype first, as the reference embeddings do; a Python float,
        so no host-to-device copy happens inside a captured graph."""
        return float(torch.tensor(value, dtype=self.dtype))

    def _rows(self, name: str) -> int:
        """Rows of this device's share of a token table."""
        share = self.vocab_share[name]
        return vocab_rows(self.cfg, name) if share is None else share.stop - share.start

    def _first_row(self, name: str) -> int | None:
        share = self.vocab_share[name]
        return None if share is None else share.start

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding table's rows of `tokens`, unscaled, whole on every device (EAGLE-3 heads embed with
        them)."""
        return lookup(self.embed_tokens.weight, tokens, self._first_row("embed_tokens.weight"), self.tp_group)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embeddings(tokens) * self._scale(self.cfg.hidden_size**0.5)

    def _per_layer_inputs(self, tokens: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T = tokens.shape
        p = cfg.hidden_size_per_layer_input
        table = lookup(self.embed_tokens_per_layer.weight, tokens, self._first_row("embed_tokens_per_layer.weight"),
                       self.tp_group)
        token_part = (table * self._scale(p**0.5)).view(B, T, cfg.num_layers, p)
        context = through(embeds, self.per_layer_model_projection) * (cfg.hidden_size**-0.5)
        context = self.per_layer_projection_norm(context.view(B, T, cfg.num_layers, p))
        return (context + token_part) * (2.0**-0.5)

    def _context(self, positions: torch.Tensor, cache: KVCache, commit_first: bool) -> ChunkContext:
        """RoPE rows, masks and slots of a chunk. Committing first, the chunk's positions enter their slots
        now and each row may attend to the stored positions <= its own; otherwise to the stored positions
        before the chunk (`cache_mask`) and to the chunk causally (`chunk_mask`)."""
        B, T = positions.shape
        start = positions[:, :1]  # chunks are contiguous: positions[:, t] = start + t
        ctx = ChunkContext({}, {}, {}, {}, {}, {}, None if commit_first else {}, {}, [])
        dt = self.dtype
        causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
        rows = torch.arange(B, device=positions.device)[:, None]
        for kind in (SLIDING, FULL):
            n = cache.slots(kind)
            pos = positions[:, -n:]
            ctx.slots[kind] = (rows, pos % n, pos)
            if commit_first:
                cache.slot_pos[kind].index_put_(ctx.slots[kind][:2], pos)
            cos_t, sin_t = getattr(self, f"cos_{kind}"), getattr(self, f"sin_{kind}")
            ctx.cos[kind] = cos_t[positions].to(dt)[:, :, None, :]
            ctx.sin[kind] = sin_t[positions].to(dt)[:, :, None, :]
            stored = cache.slot_pos[kind]
            ctx.cached_cos[kind] = cos_t[stored.clamp(min=0)].to(dt)[:, None]
            ctx.cached_sin[kind] = sin_t[stored.clamp(min=0)].to(dt)[:, None]
            window = self.cfg.sliding_window if kind == SLIDING else None
            if commit_first:  # positions <= its own, and inside the window; never an empty slot (-1)
                lowest = (positions - window + 1).clamp(min=0) if window else torch.zeros_like(positions)
                ctx.attended[kind] = (lowest, positions)
                cache_mask = (stored[:, None, :] >= lowest[:, :, None]) & (stored[:, None, :] <= positions[:, :, None])
            else:
                cache_mask = ((stored >= 0) & (stored < start))[:, None, :].expand(B, T, -1)
                if window:
                    cache_mask = cache_mask & (stored[:, None, :] > positions[:, :, None] - window)
            chunk_mask = causal[None].expand(B, T, T)
            if window:
                chunk_mask = chunk_mask & (positions[:, None, :] > positions[:, :, None] - window)
            ctx.cache_mask[kind] = cache_mask[:, None, :, None]
            if not commit_first:
                ctx.chunk_mask[kind] = chunk_mask[:, None, :, None]
        return ctx

    def _commit(self, ctx: ChunkContext, cache: KVCache) -> None:
        """Prefill: write the chunk's keys/values and positions into their slots after the last layer."""
        for index, k, v, first_head in ctx.pending_writes:
            _write_kv(cache, index, ctx.slots[self.cfg.layers[index].kind], k, v, first_head)
        for kind, (rows, slot, pos) in ctx.slots.items():
            cache.slot_pos[kind].index_put_((rows, slot), pos)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        hidden_layers: tuple[int, ...] = (),
        last_only: bool = False,
        commit_first: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens [B, T] at positions [B, T] (contiguous per row) and commit them to the cache.
        Returns float32 logits [B, T, V] ([B, 1, V] with last_only) and, when hidden_layers is given,
        the hidden states after those layers, [B, T, len(hidden_layers), H]. `commit_first` runs it as a
        decode forward (module docstring); it needs T <= decode_width(k_max) of the cache's ring."""
        cfg = self.cfg
        x = self._embed(tokens)
        per_layer = self._per_layer_inputs(tokens, x) if cfg.has_per_layer_inputs else None
        ctx = self._context(positions, cache, commit_first)
        shared_kv: dict = {}
        # Taps by position, compared one by one: once calls have tapped different layers, torch.compile's
        # automatic dynamic shapes make the indices symbolic, and a dict keyed by them would miss.
        taps = [None] * len(hidden_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, per_layer[:, :, i] if per_layer is not None else None, ctx, cache, shared_kv)
            for n, tapped in enumerate(hidden_layers):
                if tapped == i:
                    taps[n] = x
        if not commit_first:
            self._commit(ctx, cache)
        hidden = torch.stack(taps, dim=2) if hidden_layers else None
        x = self.norm(x[:, -1:] if last_only else x)
        own_head = hasattr(self, "lm_head")  # untied, or a tied head's FP8 copy (quantize_fp8)
        head = self.lm_head.weight if own_head else self.embed_tokens.weight
        scale = getattr(self.lm_head, "weight_scale", None) if own_head else None

        def product(rows, scale):  # FP8 rows by their scales; bf16 or float32 rows by dense_linear (oneDNN on the CPU)
            return dense_linear(x, rows) if scale is None else linear(x, rows, scale)

        if self.parts is None:
            logits = product(head, scale)
        else:  # the vocabulary's parts as devices holding them alone compute them
            scales = [None] * self.parts if scale is None else scale.chunk(self.parts)
            logits = torch.cat([product(rows, part_scale) for rows, part_scale in zip(head.chunk(self.parts), scales)],
                               dim=-1)
        if self.vocab_share["embed_tokens.weight"] is not None:  # this device's share of the vocabulary
            logits = gather_across(logits, self.tp_group)
        logits = logits.float()
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits, hidden
