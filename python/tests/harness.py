"""Shared by the binding's tests and the DCP rank processes (dcp_rank.py): why GPU tests skip,
synthetic layers and rows (scaled like tools/synthetic.h), DCP rank steps cut from one global step,
and the comparisons with the reference (reference.py)."""

import math

import torch

import mla_decode
import reference as ref

# Bounds of the per-(row, head) relative L2 error of out (as tests/gpu/pipeline in C++): on the GPU's own
# query bytes only the core's fp16 P.V / fp32 softmax error and the bf16 roundings remain; against the
# whole reference from the bf16 inputs a few query bytes may differ by one e4m3 step, which moves the
# softmax weights (the C++ pipeline and DCP tests' bound).
SAME_BYTES_BOUND = 1e-2
WHOLE_CHAIN_BOUND = 8e-2


def hopper_missing_reason():
    """Why the GPU tests cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (or a CPU-only PyTorch): GPU tests of the mla_decode binding not run"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"{torch.cuda.get_device_name()} is not Hopper (sm_90a kernels): GPU tests not run"
    return None


# ---- Synthetic layers and rows --------------------------------------------------------------------------

def _randn(generator, *shape, std=1.0, mean=0.0):
    return torch.randn(*shape, generator=generator, dtype=torch.float64) * std + mean


def _pow2_at_least(x):
    return 2.0 ** math.ceil(math.log2(x))


def projected_rows(generator, rows, heads, pitch):
    """q_a, kv_a ~ N(0,1) x a per-row scale in [1/4, 4] (the norms remove it), k_pe ~ N(0,1), gate
    logits ~ N(0, 2); columns past the row are NaN so a read beyond it shows. bf16 on the CPU."""
    p = torch.full((rows, pitch), float("nan"), dtype=torch.float64)
    row_scale = 2.0 ** (4 * torch.rand(rows, 1, generator=generator, dtype=torch.float64) - 2)
    p[:, :ref.KPE_OFFSET] = _randn(generator, rows, ref.KPE_OFFSET) * row_scale
    p[:, ref.KPE_OFFSET:ref.GATE_OFFSET] = _randn(generator, rows, ref.ROPE_DIM)
    p[:, ref.GATE_OFFSET:ref.projected_width(heads)] = _randn(generator, rows, heads * 128, std=2.0)
    return p.to(torch.bfloat16)


class SyntheticAttention(torch.nn.Module):
    """An MLA attention module with the attributes PreparedMla reads (see mla_decode.read_layer)."""

    def __init__(self, heads, seed, eps=1e-5, device="cuda"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.q_a_layernorm = torch.nn.RMSNorm(1536, eps=eps, dtype=torch.bfloat16, device=device)
        self.kv_a_layernorm = torch.nn.RMSNorm(512, eps=eps, dtype=torch.bfloat16, device=device)
        self.q_b_proj = torch.nn.Linear(1536, heads * 192, bias=False, dtype=torch.bfloat16, device=device)
        with torch.no_grad():
            self.q_a_layernorm.weight.copy_(_randn(g, 1536, std=0.1, mean=1.0))
            self.kv_a_layernorm.weight.copy_(_randn(g, 512, std=0.1, mean=1.0))
            self.q_b_proj.weight.copy_(_randn(g, heads * 192, 1536, std=1536 ** -0.5))
        self.W_UK_T = _randn(g, heads, 128, 512, std=128 ** -0.5).to(device, torch.bfloat16)
        self.W_UV = _randn(g, heads, 512, 128, std=512 ** -0.5).to(device, torch.bfloat16)
        # Powers of two, so that x / scale (the reference) and x * (1 / scale) (the kernels) agree.
        # Calibrated on sample rows so the largest FP8 magnitudes land in (224, 448].
        self.q_scale = self.k_scale = 1.0
        sample = projected_rows(g, 64, heads, ref.projected_width(heads))
        layer = mla_decode.read_layer(self)
        self.q_scale = _pow2_at_least(ref.query_values(layer, sample).abs().max().item() / ref.E4M3_MAX)
        self.k_scale = _pow2_at_least(ref.key_values(layer, sample).abs().max().item() / ref.E4M3_MAX)


class HeadShard(torch.nn.Module):
    """Heads [first, first + count) of an attention module: what DCP rank k serves (first = k*count),
    with the norms, eps and the one scale pair of the whole layer (a query is read against every shard)."""

    def __init__(self, attention, first, count):
        super().__init__()
        self.q_a_layernorm = attention.q_a_layernorm
        self.kv_a_layernorm = attention.kv_a_layernorm
        self.q_b_proj = attention.q_b_proj.weight.detach()[first * 192:(first + count) * 192]
        self.W_UK_T = attention.W_UK_T[first:first + count]
        self.W_UV = attention.W_UV[first:first + count]
        self.q_scale, self.k_scale = attention.q_scale, attention.k_scale


# ---- DCP rank steps --------------------------------------------------------------------------------------

def dcp_steps(global_layer, q, totals, seed, size, interleave, max_pages, num_pages, padded_requests=0):
    """One global step of D*H heads with global lengths `totals`, cut into the D ranks' steps (as
    tests/dcp_test_util.h shard_step does in C++), plus the same step on one GPU. Rows for
    max(padded_requests, len(totals)) requests of q rows: the rows past the live requests are graph
    padding (no metadata, zero output).

    Every request has `max_pages` block-table columns and every rank `num_pages` pages (fixed, so that
    a sequence of steps fits one set of captured-graph buffers). Positions [0, T - q) of a request hold
    what the query stage would have written; rank k holds the positions it owns, (g // I) % D == k, at
    local index j (dcp_local_lengths tokens), in pages handed out in a random permutation, and writes
    only the new tokens it owns (other slots -1). Every other cache byte is an e4m3 NaN, so a masked or
    unwritten token shows. Rank k's projected row is the shared q_a | kv_a | k_pe and its own heads of
    the gate, in a row of pitch past the width (NaN beyond).

    Returns (ranks, one_gpu): ranks[k] and one_gpu are dicts of CPU tensors: projected (a [rows, width]
    view of a [rows, pitch] tensor), cache (uint8 [num_pages, 64, 576]), slots, block_table, lengths,
    totals (int32), plus pitch; one_gpu has the global layer's D*H heads and lengths = totals.
    """
    g = torch.Generator().manual_seed(seed)
    heads = global_layer.num_heads // size
    num_requests = len(totals)
    rows = max(padded_requests, num_requests) * q
    totals = torch.tensor(totals, dtype=torch.int32)
    if int(totals.max()) > max_pages * ref.PAGE_SIZE:
        raise ValueError(f"totals: expected at most max_pages * 64 = {max_pages * ref.PAGE_SIZE}, got {totals.tolist()}")

    # The global sequence: key codes of the previous tokens, and this step's projected rows.
    previous = [ref.cache_rows(global_layer, projected_rows(g, max(int(t) - q, 0), global_layer.num_heads,
                                                            ref.projected_width(global_layer.num_heads))
                               ).view(torch.uint8) for t in totals]
    global_width = ref.projected_width(global_layer.num_heads)
    projected = projected_rows(g, rows, global_layer.num_heads, global_width)

    def shard(rank, rank_size, rank_heads, first_head):
        lengths = mla_decode.dcp_local_lengths(totals, rank, rank_size, interleave)
        order = torch.randperm(num_pages, generator=g).to(torch.int32)
        block_table = torch.zeros(num_requests, max_pages, dtype=torch.int32)
        cache = torch.full((num_pages, ref.PAGE_SIZE, ref.KEY_DIM), 0x7F, dtype=torch.uint8)
        next_page = 0
        for b in range(num_requests):
            pages = (int(lengths[b]) + ref.PAGE_SIZE - 1) // ref.PAGE_SIZE
            if next_page + pages > num_pages:
                raise ValueError(f"num_pages: rank {rank} needs more than {num_pages} pages")
            block_table[b, :pages] = order[next_page:next_page + pages]
            next_page += pages
            positions = ref.dcp_global_positions(int(lengths[b]), rank, rank_size, interleave)
            held = positions < int(totals[b]) - q  # the new tokens are this step's to write
            j = torch.arange(int(lengths[b]))[held]
            cache[block_table[b, j // ref.PAGE_SIZE].long(), j % ref.PAGE_SIZE] = previous[b][positions[held]]
        slots = torch.full((rows,), -1, dtype=torch.int64)
        for b in range(num_requests):
            for i in range(q):
                position = int(totals[b]) - q + i
                if position < 0 or (position // interleave) % rank_size != rank:
                    continue
                j = (position // (interleave * rank_size)) * interleave + position % interleave
                slots[b * q + i] = int(block_table[b, j // ref.PAGE_SIZE]) * ref.PAGE_SIZE + j % ref.PAGE_SIZE
        width = ref.projected_width(rank_heads)
        pitch = (width + 64 + 7) // 8 * 8
        rank_projected = torch.full((rows, pitch), float("nan"), dtype=torch.bfloat16)
        rank_projected[:, :ref.GATE_OFFSET] = projected[:, :ref.GATE_OFFSET]
        gate = ref.GATE_OFFSET + first_head * ref.V_HEAD_DIM
        rank_projected[:, ref.GATE_OFFSET:width] = projected[:, gate:gate + rank_heads * ref.V_HEAD_DIM]
        return dict(projected=rank_projected[:, :width], pitch=pitch, cache=cache, slots=slots,
                    block_table=block_table, lengths=lengths, totals=totals.clone())

    ranks = [shard(k, size, heads, k * heads) for k in range(size)]
    one_gpu = shard(0, 1, global_layer.num_heads, 0)
    return ranks, one_gpu


# ---- Comparisons -----------------------------------------------------------------------------------------

def e4m3_steps(a, b):
    """Distance in e4m3 codes between two uint8 code tensors (same sign: magnitude difference)."""
    a, b = a.to(torch.int16), b.to(torch.int16)
    magnitude_a, magnitude_b = a & 0x7F, b & 0x7F
    same_sign = ((a ^ b) & 0x80) == 0
    return torch.where(same_sign, (magnitude_a - magnitude_b).abs(), magnitude_a + magnitude_b)


def cache_bytes_ok(got_cache, expected_cache, cache_before):
    """Every byte that differs from the reference's cache is one of this step's writes and within one
    e4m3 step of it (uint8 CPU tensors)."""
    changed = got_cache != expected_cache
    written = expected_cache != cache_before
    far = e4m3_steps(got_cache, expected_cache) > 1
    return not torch.any(changed & (far | ~written))


def worst_relative_error(got, expected, zero_rows, heads):
    """Worst per-(row, head) relative L2 error over the live rows; zero rows must be exactly +0."""
    got_bits = got.cpu().view(torch.int16)
    assert torch.all(got_bits[zero_rows] == 0), "rows of empty or padding requests must be exactly +0"
    g = got.cpu().to(torch.float64).view(-1, heads, 128)[~zero_rows]
    e = expected.view(-1, heads, 128)[~zero_rows]
    if g.numel() == 0:
        return 0.0
    assert torch.isfinite(g).all(), "out has non-finite values in live rows"
    error = (g - e).norm(dim=-1)
    scale = e.norm(dim=-1)
    relative = torch.where(scale > 0, error / scale.clamp_min(1e-300), error)
    return relative.max().item()
