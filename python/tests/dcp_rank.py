"""One rank of the multi-process DCP test (test_dcp.py starts D of them: python3 dcp_rank.py SPEC_JSON).

Follows the C++ DcpMultiProcess test (tests/gpu/dcp/dcp_ipc_test.cpp): every rank builds the same
global layer of D*H heads and the same global steps from the same seeds; rank k serves heads
[k*H, (k+1)*H) through a DcpGroup (FileBootstrap in the shared directory + CUDA IPC) with two
PreparedMla objects, parity 0 and 1, alternating steps. Steps with changing lengths (one all empty,
one with an empty shard where the interleave allows) run eagerly, then as replays of one captured CUDA
graph per parity over the same buffers. Each rank checks its out and cache against the float64
reference of the whole layer under DCP (reference.run_layer_dcp), and that bad DCP arguments raise.

Prints "SUMMARY ..." and exits 0 when every check passed; any failure is a traceback and exit 1.
"""

import gc
import importlib.util
import json
import pathlib
import sys
import time

if importlib.util.find_spec("mla_decode") is None:  # from a checkout, as conftest.py does
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import harness  # noqa: E402
import mla_decode  # noqa: E402
import reference as ref  # noqa: E402


def totals_of(spec, i):
    """Global lengths of step i: random, except an all-empty step and one that fills only positions 0
    and 1 (with I = 64 every rank but 0 holds nothing: empty shards)."""
    requests = spec["requests"]
    if i == 2:
        return [0] * requests
    if i == 3:
        return ([1, 2] + [0] * requests)[:requests]
    generator = torch.Generator().manual_seed(spec["seed"] + 1000 + i)
    return torch.randint(0, spec["max_length"] + 1, (requests,), generator=generator).tolist()


def expect_raises(error, match, call):
    try:
        call()
    except error as e:
        if match not in str(e):
            raise AssertionError(f"expected {error.__name__} containing {match!r}, got: {e}") from e
        print(f"rejected as expected: {str(e).splitlines()[0]}")
        return
    raise AssertionError(f"expected {error.__name__} containing {match!r}, nothing raised")


def main(spec):
    rank, size, heads, q, interleave = spec["rank"], spec["size"], spec["heads"], spec["q"], spec["interleave"]
    num_steps = spec["eager_steps"] + spec["graph_steps"]
    torch.cuda.set_device(0)  # every rank on GPU 0: IpcDcp maps blocks between processes of one GPU too
    global_attention = harness.SyntheticAttention(size * heads, seed=spec["seed"])
    global_layer = mla_decode.read_layer(global_attention)
    shards = [harness.HeadShard(global_attention, k * heads, heads) for k in range(size)]
    layers = [mla_decode.read_layer(shard) for shard in shards]
    max_pages = (spec["max_length"] + ref.PAGE_SIZE - 1) // ref.PAGE_SIZE
    num_pages = spec["requests"] * max_pages + 1

    # Inputs and expectations of every step first: between two steps a peer's wait on the GPU already
    # runs, so no reference work may sit there.
    plans = []
    for i in range(num_steps):
        steps, _ = harness.dcp_steps(global_layer, q, totals_of(spec, i), spec["seed"] + i, size, interleave,
                                     max_pages, num_pages, padded_requests=spec["padded_requests"])
        outs, caches, _, _ = ref.run_layer_dcp(layers, steps, q, interleave)
        plans.append((steps[rank], outs[rank], caches[rank]))
    mine = plans[0][0]
    rows, pitch = mine["projected"].shape[0], mine["pitch"]

    group = mla_decode.DcpGroup(spec["directory"], rank, size, interleave=interleave, num_heads=heads,
                                max_rows=rows, device=0, wait_timeout_ms=spec["wait_timeout_ms"],
                                bootstrap_timeout_ms=spec["bootstrap_timeout_ms"])
    assert (group.rank, group.size, group.interleave, group.num_heads, group.max_rows) == \
        (rank, size, interleave, heads, rows), group
    assert group.transport == "cuda-ipc", group.transport

    # One set of step buffers on the GPU; every step copies its contents in (as a captured graph needs).
    width = mine["projected"].shape[1]
    device = torch.device("cuda", 0)
    projected = torch.empty(rows, pitch, dtype=torch.bfloat16, device=device)[:, :width]
    cache = torch.empty(num_pages, ref.PAGE_SIZE, ref.KEY_DIM, dtype=torch.uint8, device=device)
    buffers = {name: torch.empty_like(mine[name], device=device) for name in ("slots", "block_table", "lengths", "totals")}
    out = torch.empty(rows, heads * ref.V_HEAD_DIM, dtype=torch.bfloat16, device=device)
    inputs = dict(cache=cache.view(torch.float8_e4m3fn), q=q, **buffers)

    def load(step):
        projected.copy_(step["projected"])
        cache.copy_(step["cache"])
        for name, buffer in buffers.items():
            buffer.copy_(step[name])
        out.fill_(float("nan"))  # an unwritten element shows

    def prepared(parity):
        mla = mla_decode.PreparedMla(shards[rank], {rows: pitch}, dcp=group, parity=parity, queries=(q,))
        mla.prepare_cache(inputs["cache"])
        return mla

    load(mine)
    objects = [prepared(parity) for parity in (0, 1)]

    # Bad DCP arguments: rejected at construction (nothing collective, nothing launched).
    expect_raises(ValueError, f"dcp: expected a group of num_heads = {heads // 2}",
                  lambda: mla_decode.PreparedMla(harness.HeadShard(global_attention, 0, heads // 2), {rows: pitch},
                                                 dcp=group))
    expect_raises(ValueError, "query_scratch: expected None under DCP",
                  lambda: mla_decode.PreparedMla(shards[rank], {rows: pitch},
                                                 torch.empty(rows, heads, ref.KEY_DIM, dtype=torch.uint8,
                                                             device=device), dcp=group))
    expect_raises(RuntimeError, f"batch sizes <= the DCP group's max_rows = {rows}",
                  lambda: mla_decode.PreparedMla(shards[rank], {rows + q: pitch}, dcp=group, queries=(q,)))
    expect_raises(RuntimeError, "totals: expected",
                  lambda: objects[0].run(projected, out, **dict(inputs, totals=None)))
    wrong_lengths = buffers["totals"].clone()  # global lengths where the local ones belong
    if not torch.equal(wrong_lengths, buffers["lengths"]):
        expect_raises(RuntimeError, f"tokens that rank {rank} of {size} (interleave {interleave}) holds",
                      lambda: objects[0].check_step(projected, out, **dict(inputs, lengths=wrong_lengths)))

    # Every rank prepared (prepare's warm-up writes its own blocks) before any rank's first step.
    group.barrier()

    worst = 0.0
    graphs = []
    start = time.monotonic()
    for i, (step, expected_out, expected_cache) in enumerate(plans):
        parity = i % 2
        graph_step = i >= spec["eager_steps"]
        if graph_step and not graphs:
            # One graph per parity over the step buffers; each replay advances that parity's epoch.
            for p in (0, 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    objects[p].run(projected, out, **inputs)
                graphs.append(graph)
        load(step)
        objects[parity].check_step(projected, out, **inputs)  # also the C++ check of the local lengths
        if graph_step:
            graphs[parity].replay()
        else:
            objects[parity].run(projected, out, **inputs)
        torch.cuda.synchronize()
        what = f"rank {rank} step {i} parity {parity} ({'graph replay' if graph_step else 'eager'}, " \
               f"totals {step['totals'].tolist()}, lengths {step['lengths'].tolist()})"
        assert harness.cache_bytes_ok(cache.cpu(), expected_cache, step["cache"]), \
            f"{what}: cache bytes wrong or written outside this rank's slots"
        zero = ref.zero_rows(rows, q, step["totals"])
        error = harness.worst_relative_error(out, expected_out, zero, heads)
        assert error <= harness.WHOLE_CHAIN_BOUND, \
            f"{what}: worst per-(row, head) relative L2 error of out {error:.2e} > {harness.WHOLE_CHAIN_BOUND}"
        print(f"{what}: worst error {error:.2e}")
        worst = max(worst, error)
    elapsed_ms = (time.monotonic() - start) * 1e3 / num_steps

    # The group's destructor is collective (a barrier before unmapping): every rank drops it here.
    del graphs, objects
    del group
    gc.collect()
    print(f"SUMMARY rank {rank} of {size} (interleave {interleave}, H {heads}, q {q}, rows {rows}): "
          f"{spec['eager_steps']} eager steps + {spec['graph_steps']} graph replays alternating parity, worst "
          f"per-(row, head) relative L2 error of out {worst:.2e} (bound {harness.WHOLE_CHAIN_BOUND:.0e}), "
          f"{elapsed_ms:.1f} ms per step with the checks")
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
