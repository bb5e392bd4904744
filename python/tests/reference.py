"""Pure-PyTorch float64 reference of the MLA decode layer: DESIGN.md §4, one function per stage.

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


def attention_core(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                   q: int, softmax_scale: float, k_scale: float) -> torch.Tensor:
    """Bottom-right causal attention over the paged cache (§4 core). `query` [rows, H, 576] codes,
    `cache` [pages, 64, 576] codes. Returns the bf16-rounded latent [rows, H, 512] (0 where a row sees
    nothing; rows of missing requests are 0)."""
    query_values = e4m3_values(query.cpu())
    rows, heads, _ = query_values.shape
    latent = torch.zeros(rows, heads, KV_LORA_RANK, dtype=torch.float64)
    cache, block_table, lengths = cache.cpu(), block_table.cpu(), lengths.cpu()
    for b in range(lengths.shape[0]):
        length = int(lengths[b])
        if length == 0:
            continue
        positions = torch.arange(length)
        pages = block_table[b, positions // PAGE_SIZE].long()
        keys = e4m3_values(cache[pages, positions % PAGE_SIZE])  # [L, 576]
        for i in range(q):
            # Token j is visible to row i iff j <= L - q + i: a prefix of the request's tokens.
            visible = min(max(length - q + i + 1, 0), length)
            if visible == 0:
                continue
            logits = softmax_scale * query_values[b * q + i] @ keys[:visible].T  # [H, visible]
            weights = torch.softmax(logits, dim=-1)
            latent[b * q + i] = bf16(k_scale * weights @ keys[:visible, :KV_LORA_RANK])
    return latent


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
