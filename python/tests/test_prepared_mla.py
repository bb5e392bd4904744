"""mla_decode.PreparedMla on a Hopper GPU against the float64 reference (reference.py): whole steps for
H in {12, 96} and q in {1, 4}, padded batches, long contexts (split-KV), CUDA graph capture and replay
with changing metadata, torch.compile, and bad inputs rejected with the library's message.

Checks per step (as tests/gpu/pipeline does in C++):
  * the cache: this step's rows within one e4m3 step of the reference, every other byte untouched;
  * out against the reference core + value stage run on the GPU's own query bytes and cache (only the
    core's fp16 P.V / fp32 softmax error and the bf16 roundings remain): per-(row, head) relative L2
    error <= 1e-2;
  * out against the whole reference from the bf16 inputs (a few query bytes may differ by one e4m3
    step, which moves the softmax weights): <= 8e-2, the C++ pipeline test's bound;
  * rows of empty and padding requests exactly +0.
"""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the mla_decode GPU tests need it")

import harness  # noqa: E402
import mla_decode  # noqa: E402
import reference as ref  # noqa: E402

pytestmark = pytest.mark.skipif(harness.hopper_missing_reason() is not None,
                                reason=harness.hopper_missing_reason() or "")

DEVICE = "cuda"


class Step:
    """One decode step's tensors on the GPU: `lengths` live requests of `q` rows, padded to
    `padded_requests` requests' rows; pages handed out in a random permutation; previous tokens are
    reference cache rows, every other cache byte e4m3 NaN (a masked or unwritten token shows as NaN)."""

    def __init__(self, layer, q, lengths, seed, padded_requests=0, max_pages=0, num_pages=0, page_stride_pad=0):
        g = torch.Generator().manual_seed(seed)
        heads = layer.num_heads
        self.q = q
        num_requests = len(lengths)
        self.rows = max(padded_requests, num_requests) * q
        self.pitch = (ref.projected_width(heads) + 64 + 7) // 8 * 8
        pages_of = [(length + ref.PAGE_SIZE - 1) // ref.PAGE_SIZE for length in lengths]
        self.max_pages = max_pages or max(max(pages_of, default=1), 1)
        self.num_pages = num_pages or sum(pages_of) + 2
        order = torch.randperm(self.num_pages, generator=g)
        block_table = torch.zeros(num_requests, self.max_pages, dtype=torch.int32)
        next_page = 0
        for b, pages in enumerate(pages_of):
            block_table[b, :pages] = order[next_page:next_page + pages].to(torch.int32)
            next_page += pages

        # Previous tokens: positions [0, L - q) of each request hold what the query stage would write.
        cache = torch.full((self.num_pages, ref.PAGE_SIZE, ref.KEY_DIM), 0x7F, dtype=torch.uint8)
        previous = [(b, j) for b, length in enumerate(lengths) for j in range(max(length - q, 0))]
        if previous:
            request, position = torch.tensor(previous).T
            rows = ref.cache_rows(layer, harness.projected_rows(g, len(previous), heads, ref.projected_width(heads)))
            pages = block_table[request, position // ref.PAGE_SIZE].long()
            cache[pages, position % ref.PAGE_SIZE] = rows.view(torch.uint8)

        slots = torch.full((self.rows,), -1, dtype=torch.int64)
        for b, length in enumerate(lengths):
            for i in range(q):
                position = length - q + i
                if position >= 0:
                    page = int(block_table[b, position // ref.PAGE_SIZE])
                    slots[b * q + i] = page * ref.PAGE_SIZE + position % ref.PAGE_SIZE

        self.projected = harness.projected_rows(g, self.rows, heads, self.pitch).to(DEVICE)[:, :ref.projected_width(heads)]
        # page_stride_pad > 0: a page stride larger than 64 * 576 (the padding rows stay NaN).
        storage = torch.full((self.num_pages, ref.PAGE_SIZE + page_stride_pad, ref.KEY_DIM), 0x7F,
                             dtype=torch.uint8, device=DEVICE)
        self.cache = storage[:, :ref.PAGE_SIZE].view(torch.float8_e4m3fn)
        self.cache.view(torch.uint8).copy_(cache)
        self.slots = slots.to(DEVICE)
        self.block_table = block_table.to(DEVICE)
        self.lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        self.out = torch.full((self.rows, heads * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)

    def inputs(self):
        return dict(cache=self.cache, slots=self.slots, block_table=self.block_table, lengths=self.lengths, q=self.q)

    def copy_into(self, static):
        """Copies this step's contents into the (same-shaped) tensors of `static`, e.g. a captured graph's."""
        for name in ("projected", "cache", "slots", "block_table", "lengths", "out"):
            getattr(static, name).copy_(getattr(self, name))


def _scratch(rows, heads):
    return torch.empty(rows, heads, ref.KEY_DIM, dtype=torch.float8_e4m3fn, device=DEVICE)


def _prepared(attention, step, queries=None, **options):
    heads = attention.W_UK_T.shape[0]
    mla = mla_decode.PreparedMla(attention, {step.rows: step.pitch}, _scratch(step.rows, heads),
                                 queries=queries or (step.q,), **options)
    assert mla.device_bytes == 0
    mla.prepare_cache(step.cache)
    assert mla.device_bytes >= step.rows * heads * (ref.KV_LORA_RANK * 2 + 4), mla.device_bytes  # latent + LSE
    return mla


# ---- Comparisons --------------------------------------------------------------------------------------

def _expect_matches_reference(mla, step, before, cache_before):
    """Compares the GPU's out, cache and query bytes after a step with the reference."""
    layer = mla.layer
    heads = layer.num_heads
    got_cache = step.cache.view(torch.uint8).cpu()
    expected_out, expected_cache, _ = ref.run_layer(layer, before["projected"], cache_before, before["slots"],
                                                    before["block_table"], before["lengths"], step.q)
    assert harness.cache_bytes_ok(got_cache, expected_cache, cache_before.view(torch.uint8)), \
        "cache bytes wrong or written outside this step's slots"

    zero = ref.zero_rows(step.rows, step.q, before["lengths"])
    same_bytes = ref.core_and_value(layer, mla.query_scratch[:step.rows].cpu(), got_cache, before["block_table"],
                                    before["lengths"], step.q, before["projected"])
    worst_same = harness.worst_relative_error(step.out, same_bytes, zero, heads)
    worst_chain = harness.worst_relative_error(step.out, expected_out, zero, heads)
    print(f"H={heads} q={step.q} rows={step.rows}: worst per-(row, head) relative L2 error of out "
          f"{worst_same:.2e} on the GPU's query bytes, {worst_chain:.2e} against the whole reference")
    assert worst_same <= harness.SAME_BYTES_BOUND
    assert worst_chain <= harness.WHOLE_CHAIN_BOUND


def _snapshot(step):
    return {name: getattr(step, name).clone() for name in ("projected", "slots", "block_table", "lengths")}


def _run_and_check(mla, step):
    before, cache_before = _snapshot(step), step.cache.view(torch.uint8).cpu()
    mla.check_step(step.projected, step.out, **step.inputs())
    mla.run(step.projected, step.out, **step.inputs())
    torch.cuda.synchronize()
    _expect_matches_reference(mla, step, before, cache_before)


# ---- Tests --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [12, 96])
@pytest.mark.parametrize("q", [1, 4])
def test_matches_reference(heads, q):
    attention = harness.SyntheticAttention(heads, seed=100 + heads + q)
    # A request with nothing before this step, one crossing a page, an empty one, a few pages.
    step = Step(mla_decode.read_layer(attention), q, [q, 63 + q, 0, 300], seed=200 + heads + q)
    _run_and_check(_prepared(attention, step), step)


def test_long_context_uses_splits_and_matches_reference():
    attention = harness.SyntheticAttention(12, seed=300)
    step = Step(mla_decode.read_layer(attention), 1, [5000], seed=301, page_stride_pad=1)
    mla = _prepared(attention, step)
    assert mla.shapes[0].num_splits > 1, mla.shapes
    _run_and_check(mla, step)


def test_layers_share_one_workspace():
    # Two layers, one 4-row and one 128-row shape (the query's GEMM path: its cuBLAS workspace then lives
    # in the shared buffer), prepared on one workspace and run in turn.
    layers = []
    for seed, lengths in ((500, [100, 3000, 64, 1]), (510, [1 + (37 * i) % 200 for i in range(128)])):
        attention = harness.SyntheticAttention(12, seed=seed)
        step = Step(mla_decode.read_layer(attention), 1, lengths, seed=seed + 1)
        mla = mla_decode.PreparedMla(attention, {step.rows: step.pitch}, _scratch(step.rows, 12), queries=(1,))
        layers.append((mla, step))
    workspace = mla_decode.shared_workspace([mla for mla, _ in layers])
    assert workspace.numel() == max(mla.workspace_bytes() for mla, _ in layers)
    with pytest.raises(RuntimeError, match=r"workspace: expected at least"):
        layers[1][0].prepare_cache(layers[1][1].cache, workspace=workspace[:layers[1][0].workspace_bytes() - 256])
    for mla, step in layers:
        mla.prepare_cache(step.cache, workspace=workspace)
        assert mla.device_bytes <= step.rows * 16 * 4, mla.device_bytes  # at most the core's tile counters
    for mla, step in (layers[0], layers[1], layers[0]):
        step.out.fill_(float("nan"))
        _run_and_check(mla, step)


def test_a_given_workspace_outlives_the_callers_reference():
    # prepare_cache(kv, workspace=<a temporary>): the object keeps the workspace's storage, so the caching allocator
    # cannot hand its bytes to the next tensor of that size while the steps still write their stage buffers there.
    attention = harness.SyntheticAttention(12, seed=520)
    step = Step(mla_decode.read_layer(attention), 1, [100, 3000, 64, 1], seed=521)
    mla = mla_decode.PreparedMla(attention, {step.rows: step.pitch}, _scratch(step.rows, 12), queries=(1,))
    workspace = mla_decode.shared_workspace([mla])
    address, size = workspace.data_ptr(), workspace.numel()
    mla.prepare_cache(step.cache, workspace=workspace)
    del workspace
    other = torch.full((size,), 0x7F, dtype=torch.uint8, device=step.cache.device)
    assert other.data_ptr() != address, "the workspace went back to the allocator while the object still uses it"
    step.out.fill_(float("nan"))
    _run_and_check(mla, step)
    assert bool((other == 0x7F).all()), "a step wrote into memory the object does not own"


@pytest.mark.parametrize("use_pad_requests", [False, True])
def test_padded_batch(use_pad_requests):
    attention = harness.SyntheticAttention(12, seed=400)
    layer = mla_decode.read_layer(attention)
    step = Step(layer, 4, [4, 70, 1, 129, 0], seed=401, padded_requests=8)  # L < q: first rows see nothing
    if use_pad_requests:
        step.block_table, step.lengths, _ = mla_decode.pad_requests(8, step.block_table, step.lengths)
        assert step.block_table.shape[0] == 8
    _run_and_check(_prepared(attention, step), step)


def test_cuda_graph_replays_with_changing_metadata():
    heads, q, requests, max_pages, num_pages = 12, 4, 4, 16, 64
    attention = harness.SyntheticAttention(heads, seed=500)
    layer = mla_decode.read_layer(attention)

    def make(seed, live_requests=requests):
        lengths = torch.randint(0, 1000, (live_requests,), generator=torch.Generator().manual_seed(seed)).tolist()
        return Step(layer, q, lengths, seed, padded_requests=requests, max_pages=max_pages, num_pages=num_pages)

    static = make(501)
    mla = _prepared(attention, static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.run(static.projected, static.out, **static.inputs())

    for replay in range(4):
        # The last replay has two live requests, padded to the captured four with pad_requests.
        step = make(510 + replay, live_requests=2 if replay == 3 else requests)
        step.block_table, step.lengths, _ = mla_decode.pad_requests(requests, step.block_table, step.lengths)
        step.copy_into(static)
        before, cache_before = _snapshot(static), static.cache.view(torch.uint8).cpu()
        graph.replay()
        torch.cuda.synchronize()
        _expect_matches_reference(mla, static, before, cache_before)


def test_torch_compile_keeps_the_op_opaque():
    attention = harness.SyntheticAttention(12, seed=600)
    layer = mla_decode.read_layer(attention)
    eager_step = Step(layer, 1, [10, 200], seed=601)
    compiled_step = Step(layer, 1, [10, 200], seed=601)
    mla = _prepared(attention, eager_step)

    def decode(projected, out, cache, slots, block_table, lengths):
        mla.run(projected, out, cache=cache, slots=slots, block_table=block_table, lengths=lengths, q=1)
        return out.float().sum()

    args = lambda s: (s.projected, s.out, s.cache, s.slots, s.block_table, s.lengths)  # noqa: E731
    eager = decode(*args(eager_step))
    compiled = torch.compile(decode, fullgraph=True)(*args(compiled_step))
    torch.cuda.synchronize()
    assert torch.equal(eager_step.out, compiled_step.out)
    assert torch.equal(eager_step.cache.view(torch.uint8), compiled_step.cache.view(torch.uint8))
    # out and the cache are bit-identical above; the sum itself is reduced by an inductor kernel in a
    # different order than eager torch.sum, so only it may differ, by float rounding.
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)


def _expect_rejected(call, match, step):
    with pytest.raises(RuntimeError, match=match):
        call()
    torch.cuda.synchronize()
    assert torch.isnan(step.out.float()).all(), "out was written by a rejected step"


def test_bad_inputs_raise_the_library_message():
    attention = harness.SyntheticAttention(12, seed=700)
    step = Step(mla_decode.read_layer(attention), 1, [100, 5], seed=701)
    mla = mla_decode.PreparedMla(attention, {step.rows: step.pitch}, _scratch(step.rows, 12))
    good = step.inputs()

    def run(projected=None, out=None, **changes):
        inputs = dict(good, **changes)
        return lambda: mla.run(step.projected if projected is None else projected,
                               step.out if out is None else out, **inputs)

    _expect_rejected(run(), r"prepare\(cache\) has not been called", step)
    mla.prepare_cache(step.cache)
    _expect_rejected(run(out=step.out.float()), r"out: expected dtype bf16", step)
    _expect_rejected(run(out=step.out.half()), r"out: expected dtype bfloat16, float32, int32, int64, "
                                               r"float8_e4m3fn or uint8, got Half", step)
    _expect_rejected(run(slots=torch.zeros(step.rows + 1, dtype=torch.int64, device=DEVICE)),
                     r"slots: expected shape \[2\]", step)
    _expect_rejected(run(lengths=step.lengths.cpu()), r"lengths: expected memory on cuda:0, got host", step)
    _expect_rejected(run(q=2), r"\(batch, q\): expected one of the prepared shapes \{\(2, 1\)\}, got \(2, 2\)", step)
    wider = torch.full((4, step.pitch), 0.0, dtype=torch.bfloat16, device=DEVICE)[:, :ref.projected_width(12)]
    _expect_rejected(run(projected=wider), r"\(batch, q\): expected one of the prepared shapes", step)
    _expect_rejected(run(totals=step.lengths), r"totals: expected absent without a DCP group", step)
    # Values on the device are checked by check_step (it synchronizes); run() cannot afford to.
    step.block_table[0, 0] = step.num_pages
    with pytest.raises(RuntimeError, match=r"block_table\[0\]\[0\]: expected a page index in \[0, "):
        mla.check_step(step.projected, step.out, **good)


def test_bad_construction_raises():
    attention = harness.SyntheticAttention(12, seed=800)
    width = ref.projected_width(12)
    with pytest.raises(RuntimeError, match=rf"pitches\[8\]: expected >= {width}"):
        mla_decode.PreparedMla(attention, {8: width - 8}, _scratch(8, 12))
    with pytest.raises(RuntimeError, match=r"query_scratch: expected at least 8 rows"):
        mla_decode.PreparedMla(attention, {8: width}, _scratch(4, 12))
    with pytest.raises(RuntimeError, match=r"core: expected one of \{auto\}, got 'flashmla'"):
        mla_decode.PreparedMla(attention, {8: width}, _scratch(8, 12), core="flashmla")
    with pytest.raises(ValueError, match=r"dcp: expected None"):
        mla_decode.PreparedMla(attention, {8: width}, _scratch(8, 12), dcp=object())
