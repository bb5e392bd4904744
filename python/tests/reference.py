"""Pure-PyTorch float64 reference of the MLA decode layer: DESIGN.md §4, one function per stage, and
the same step on D decode-context-parallel ranks (run_layer_dcp), merged by LSE as DESIGN.md says.

Quantizes where the kernels do and nowhere else: bf16 after the RMSNorms and q_b_proj, e4m3 for the
query and the cache rows, bf16 for the latent and the output. All math on the CPU in float64.
NOTE: torch converts float64 to bf16 / e4m3 through float32, which may round a float64 value that lies
within 2^-24 of a rounding boundary differently from the C++ reference (direct rounding); that is far
below the tolerances the tests use.
"""

import math

import torch

Q_LORA_RANK = 1536
KV_LORA_RANK = 512
ROPE_DIM = 64
NOPE_DIM = 128
QK_HEAD_DIM = NOPE_DIM + ROPE_DIM  # 192
V_HEAD_DIM = 128
KEY_DIM = KV_LORA_RANK + ROPE_DIM  # 576
PAGE_SIZE = 64
E4M3_MAX = 448.0
QA_OFFSET, KVA_OFFSET, KPE_OFFSET, GATE_OFFSET = 0, 1536, 2048, 2112


def projected_width(num_heads: int) -> int:
    return GATE_OFFSET + num_heads * V_HEAD_DIM


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Rounds to bfloat16 (nearest even), back in float64."""
    return x.to(torch.bfloat16).to(torch.float64)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """OCP e4m3fn codes of x (nearest even, saturating to +-448; clamp keeps NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of e4m3fn codes (a float8_e4m3fn or uint8 tensor)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32).to(torch.float64)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(x * rsqrt(mean(x^2) + eps) * weight) over the last dimension."""
    return bf16(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight)


def query_values(layer, projected: torch.Tensor) -> torch.Tensor:
    """[ql | q_rope] of every row before quantization (§4 steps 1-3), [rows, H, 576] float64 on the CPU;
    `layer` is a mla_decode.LayerTensors."""
    heads = layer.num_heads
    q_a = _f64(projected[:, QA_OFFSET:KVA_OFFSET])
    q_normed = rms_norm(q_a, _f64(layer.q_a_norm), layer.rms_eps)
    q = bf16(q_normed @ _f64(layer.q_b_proj).T).reshape(-1, heads, QK_HEAD_DIM)
    q_latent = torch.einsum("rhd,hdc->rhc", q[:, :, :NOPE_DIM], _f64(layer.w_uk_t))
    return torch.cat([q_latent, q[:, :, NOPE_DIM:]], dim=-1)


def key_values(layer, projected: torch.Tensor) -> torch.Tensor:
    """[kv_normed | k_pe] of every row before quantization (§4 steps 1, 5), [rows, 576] float64 on the CPU."""
    kv_normed = rms_norm(_f64(projected[:, KVA_OFFSET:KPE_OFFSET]), _f64(layer.kv_a_norm), layer.rms_eps)
    return torch.cat([kv_normed, _f64(projected[:, KPE_OFFSET:GATE_OFFSET])], dim=-1)


def cache_rows(layer, projected: torch.Tensor) -> torch.Tensor:
    """The e4m3 cache row of every row's token, [rows, 576]."""
    return e4m3(key_values(layer, projected) / layer.k_scale)


def query_stage(layer, projected: torch.Tensor):
    """Query stage of every row (§4 steps 1-5): (query codes [rows, H, 576], cache-row codes [rows, 576]),
    e4m3 on the CPU."""
    return e4m3(query_values(layer, projected) / layer.q_scale), cache_rows(layer, projected)


def write_cache(cache: torch.Tensor, slots: torch.Tensor, cache_rows: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `cache` with row r's codes at slot slots[r] (page slot // 64, offset slot % 64)
    wherever slots[r] >= 0."""
    written = cache.detach().cpu().view(torch.uint8).clone()
    for r, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written[slot // PAGE_SIZE, slot % PAGE_SIZE] = cache_rows[r].view(torch.uint8)
    return written


def dcp_global_positions(local_length: int, rank: int, size: int, interleave: int) -> torch.Tensor:
    """Global position of each local token j in [0, local_length) of DCP rank `rank` of `size`:
    ((j // I) * D + k) * I + j % I (DESIGN.md §4 core). size = 1: j itself."""
    j = torch.arange(local_length)
    return ((j // interleave) * size + rank) * interleave + j % interleave


def attention_partial(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                      q: int, softmax_scale: float, k_scale: float, totals: torch.Tensor = None, rank: int = 0,
                      size: int = 1, interleave: int = 1):
    """Bottom-right causal attention over one paged cache (§4 core): the whole context, or under DCP
    rank `rank`'s shard with the global causal bound from `totals`. `query` [rows, H, 576] codes,
    `cache` [pages, 64, 576] codes. Returns (latent [rows, H, 512] float64, not rounded; lse [rows, H]
    natural log): 0 and -inf where a row sees nothing and for rows of missing requests."""
    query_values = e4m3_values(query.cpu())
    rows, heads, _ = query_values.shape
    latent = torch.zeros(rows, heads, KV_LORA_RANK, dtype=torch.float64)
    lse = torch.full((rows, heads), -math.inf, dtype=torch.float64)
    cache, block_table, lengths = cache.cpu(), block_table.cpu(), lengths.cpu()
    totals = lengths if totals is None else totals.cpu()
    for b in range(lengths.shape[0]):
        length, total = int(lengths[b]), int(totals[b])
        if length == 0:
            continue
        positions = torch.arange(length)
        pages = block_table[b, positions // PAGE_SIZE].long()
        keys = e4m3_values(cache[pages, positions % PAGE_SIZE])  # [L, 576]
        global_positions = dcp_global_positions(length, rank, size, interleave)
        for i in range(q):
            # Local token j is visible to row i iff its global position is <= T - q + i.
            visible = global_positions <= total - q + i
            if not visible.any():
                continue
            logits = softmax_scale * query_values[b * q + i] @ keys[visible].T  # [H, visible]
            row_lse = torch.logsumexp(logits, dim=-1)
            weights = torch.exp(logits - row_lse[:, None])
            latent[b * q + i] = k_scale * weights @ keys[visible, :KV_LORA_RANK]
            lse[b * q + i] = row_lse
    return latent, lse


def lse_merge(partials):
    """Merges (latent, lse) partials of the same rows and heads (§4 split-KV and DCP): lse = ln sum
    exp(lse_p), latent = sum exp(lse_p - lse) latent_p; a part that saw nothing (lse_p = -inf) weighs
    exactly 0, and where every part saw nothing the result is 0 and -inf."""
    lse_parts = torch.stack([lse for _, lse in partials])  # [P, rows, H]
    largest = lse_parts.max(dim=0).values
    shift = torch.where(torch.isfinite(largest), largest, torch.zeros_like(largest))
    lse = shift + torch.log(torch.exp(lse_parts - shift).sum(dim=0))
    weights = torch.where(torch.isfinite(lse), torch.exp(lse_parts - lse), torch.zeros_like(lse_parts))
    latent = sum(weight[:, :, None] * part_latent for weight, (part_latent, _) in zip(weights, partials))
    return latent, lse


def attention_core(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                   q: int, softmax_scale: float, k_scale: float) -> torch.Tensor:
    """attention_partial over the whole context, the latent rounded to bf16 [rows, H, 512] (0 where a
    row sees nothing; rows of missing requests are 0)."""
    latent, _ = attention_partial(query, cache, block_table, lengths, q, softmax_scale, k_scale)
    return bf16(latent)


def value_stage(latent: torch.Tensor, w_uv: torch.Tensor, projected: torch.Tensor, zero_rows: torch.Tensor,
                num_heads: int) -> torch.Tensor:
    """out = bf16((latent . W_UV) * sigmoid(gate)) as [rows, H*128] float64; `zero_rows` are exactly 0."""
    gate = _f64(projected[:, GATE_OFFSET:projected_width(num_heads)]).reshape(-1, num_heads, V_HEAD_DIM)
    value = torch.einsum("rhc,hcd->rhd", latent, _f64(w_uv))
    out = bf16(value * torch.sigmoid(gate)).reshape(latent.shape[0], -1)
    out[zero_rows] = 0.0
    return out


def softmax_scale(layer) -> float:
    return layer.q_scale * layer.k_scale / math.sqrt(QK_HEAD_DIM)


def zero_rows(rows: int, q: int, lengths: torch.Tensor) -> torch.Tensor:
    """Rows of requests with no tokens and of missing (padding) requests."""
    lengths = lengths.cpu()
    request = torch.arange(rows) // q
    live = request < lengths.shape[0]
    empty = torch.ones(rows, dtype=torch.bool)
    empty[live] = lengths[request[live]] == 0
    return empty


def run_layer(layer, projected, cache, slots, block_table, lengths, q):
    """The whole step. Returns (out [rows, H*128] float64 of bf16 values, cache after (uint8, CPU),
    query codes [rows, H, 576])."""
    query, cache_rows = query_stage(layer, projected)
    cache_after = write_cache(cache, slots, cache_rows)
    latent = attention_core(query, cache_after, block_table, lengths, q, softmax_scale(layer), layer.k_scale)
    rows = projected.shape[0]
    out = value_stage(latent, layer.w_uv, projected, zero_rows(rows, q, lengths), layer.num_heads)
    return out, cache_after, query


def core_and_value(layer, query, cache, block_table, lengths, q, projected):
    """The core and value stage on given query and cache codes (e.g. what the GPU's query stage wrote)."""
    latent = attention_core(query, cache, block_table, lengths, q, softmax_scale(layer), layer.k_scale)
    rows = projected.shape[0]
    return value_stage(latent, layer.w_uv, projected, zero_rows(rows, q, lengths), layer.num_heads)


def run_layer_dcp(layers, steps, q, interleave):
    """The step on D = len(steps) DCP ranks, phase by phase as the GPUs run it (§4 DCP). `layers[k]` is
    rank k's LayerTensors (its H heads, the group's scales); `steps[k]` a mapping with rank k's
    projected (shared q_a | kv_a | k_pe, its own gate), cache shard, slots (-1 for tokens it does not
    own), block_table, lengths (local) and totals (global). Returns (outs: rank k's out [rows, H*128]
    float64 of bf16 values; caches: rank k's cache after (uint8, CPU); the mailbox [rows, D*H, 576] of
    query codes (uint8) every rank's core reads; merged: rank k's (latent, lse) of its heads after the
    merge, before the bf16 rounding)."""
    size = len(steps)
    heads = layers[0].num_heads
    rows = steps[0]["projected"].shape[0]
    # Phase 1: rank k's query stage writes its own cache slots and publishes its H heads at
    # [k*H, (k+1)*H) of every rank's mailbox (the same bytes everywhere: one copy serves every core).
    queries, caches = [], []
    for layer, step in zip(layers, steps):
        query, new_rows = query_stage(layer, step["projected"])
        queries.append(query)
        caches.append(write_cache(step["cache"], step["slots"], new_rows))
    mailbox = torch.cat([query.view(torch.uint8) for query in queries], dim=1)
    # Phase 2: rank k's core over all D*H heads and its own shard, global causal bounds from totals.
    partials = [attention_partial(mailbox, caches[k], steps[k]["block_table"], steps[k]["lengths"], q,
                                  softmax_scale(layers[k]), layers[k].k_scale, totals=steps[k]["totals"],
                                  rank=k, size=size, interleave=interleave) for k in range(size)]
    # Phase 3: rank k merges the D partials of its own heads by LSE, then W_UV and its gate; rows of
    # requests with no token anywhere (totals 0) and of missing requests are 0.
    outs, merged = [], []
    for k in range(size):
        own = [(latent[:, k * heads:(k + 1) * heads], lse[:, k * heads:(k + 1) * heads]) for latent, lse in partials]
        merged.append(lse_merge(own))
        outs.append(value_stage(bf16(merged[k][0]), layers[k].w_uv, steps[k]["projected"],
                                zero_rows(rows, q, steps[k]["totals"]), heads))
    return outs, caches, mailbox, merged
