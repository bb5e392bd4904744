"""Decode context parallelism through the binding: mla_decode.DcpGroup, PreparedMla(dcp=, parity=),
dcp_local_lengths, and the float64 reference of the layer under DCP (reference.run_layer_dcp).

Without a GPU (PyTorch only): dcp_local_lengths against the ownership rule counted position by
position; the DCP reference (D shards, partials merged by LSE) against the one-GPU reference of the
same global step; a dcp of the wrong type. On a Hopper GPU: D = 2 processes (python3 dcp_rank.py),
both on GPU 0, each one rank over a FileBootstrap + CUDA IPC, eager steps and CUDA graph replays
alternating parity, each rank's out and cache against the reference (the whole-chain bound of the
one-GPU tests), bad DCP arguments in every rank. The parent kills ranks still running at the deadline
and prints every rank's log when one fails.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the mla_decode DCP tests need it")

import harness  # noqa: E402
import mla_decode  # noqa: E402
import reference as ref  # noqa: E402
from mla_decode import _library  # noqa: E402

RANK_SCRIPT = pathlib.Path(__file__).with_name("dcp_rank.py")
DEADLINE_S = 150         # per case, for all ranks: start-up (torch import, CUDA), references, steps
AFTER_FAILURE_S = 20     # how long the other ranks may still run once one has failed
LOG_TAIL_CHARS = 6000


# ---- Without a GPU --------------------------------------------------------------------------------------

def _owned_count(total, rank, size, interleave):
    return sum(1 for g in range(total) if (g // interleave) % size == rank)


@pytest.mark.parametrize("size, interleave", [(2, 1), (2, 64), (3, 5), (4, 1), (8, 64)])
def test_dcp_local_lengths_count_the_owned_positions(size, interleave):
    totals = torch.arange(0, 3 * size * interleave + 7, dtype=torch.int32)
    for rank in range(size):
        local = mla_decode.dcp_local_lengths(totals, rank, size, interleave)
        assert local.dtype == torch.int32 and local.shape == totals.shape
        assert local.tolist() == [_owned_count(t, rank, size, interleave) for t in totals.tolist()], (rank, size, interleave)
    # The ranks' shares add up to the whole sequence.
    shares = sum(mla_decode.dcp_local_lengths(totals, k, size, interleave) for k in range(size))
    assert torch.equal(shares, totals)


def test_dcp_local_lengths_errors():
    totals = torch.tensor([5], dtype=torch.int64)
    assert mla_decode.dcp_local_lengths(totals, 1, 2, 2).dtype == torch.int64
    with pytest.raises(ValueError, match=r"lengths: expected an integer tensor, got torch.float32"):
        mla_decode.dcp_local_lengths(totals.float(), 0, 2, 64)
    with pytest.raises(ValueError, match=r"lengths: expected an integer tensor, got list"):
        mla_decode.dcp_local_lengths([5], 0, 2, 64)
    with pytest.raises(ValueError, match=r"rank: expected in \[0, 2\), got 2"):
        mla_decode.dcp_local_lengths(totals, 2, 2, 64)
    with pytest.raises(ValueError, match=r"size: expected >= 1, got 0"):
        mla_decode.dcp_local_lengths(totals, 0, 0, 64)
    with pytest.raises(ValueError, match=r"interleave: expected >= 1, got 0"):
        mla_decode.dcp_local_lengths(totals, 0, 2, 0)


@pytest.mark.parametrize("size, interleave, q", [(2, 64, 1), (2, 1, 2), (4, 3, 4)])
def test_dcp_reference_matches_the_one_gpu_reference(size, interleave, q):
    """The same global step on D shards (partials merged by LSE) and on one GPU: the same cache rows,
    query bytes (up to one e4m3 step: float64 matmuls of other shapes may round differently), merged
    latent (to float64 rounding, on the same query bytes) and out."""
    heads = 2
    attention = harness.SyntheticAttention(size * heads, seed=40 + size + q, device="cpu")
    global_layer = mla_decode.read_layer(attention)
    layers = [mla_decode.read_layer(harness.HeadShard(attention, k * heads, heads)) for k in range(size)]
    # Empty, shorter than q, within one interleave cycle, several cycles; one padding request.
    totals = [0, q - 1, interleave * size - 1, 5 * interleave * size + 3, 150]
    max_pages = (max(totals) + ref.PAGE_SIZE - 1) // ref.PAGE_SIZE
    ranks, one_gpu = harness.dcp_steps(global_layer, q, totals, 50 + q, size, interleave, max_pages,
                                       num_pages=len(totals) * max_pages + 1, padded_requests=len(totals) + 1)
    outs, caches, mailbox, merged = ref.run_layer_dcp(layers, ranks, q, interleave)
    out, cache, query = ref.run_layer(global_layer, one_gpu["projected"], one_gpu["cache"], one_gpu["slots"],
                                      one_gpu["block_table"], one_gpu["lengths"], q)

    assert (harness.e4m3_steps(mailbox, query.view(torch.uint8)) <= 1).all()
    latent, lse = ref.attention_partial(mailbox, cache, one_gpu["block_table"], one_gpu["lengths"], q,
                                        ref.softmax_scale(global_layer), global_layer.k_scale)
    rows = one_gpu["projected"].shape[0]
    zero = ref.zero_rows(rows, q, one_gpu["lengths"])
    for k in range(size):
        own = slice(k * heads, (k + 1) * heads)
        # Every local token of rank k is the global token at its global position.
        for b, length in enumerate(ranks[k]["lengths"].tolist()):
            positions = ref.dcp_global_positions(length, k, size, interleave)
            local = torch.arange(length)
            global_pages = one_gpu["block_table"][b, positions // ref.PAGE_SIZE].long()
            rank_pages = ranks[k]["block_table"][b, local // ref.PAGE_SIZE].long()
            assert torch.equal(caches[k][rank_pages, local % ref.PAGE_SIZE],
                               cache[global_pages, positions % ref.PAGE_SIZE]), (k, b)
        merged_latent, merged_lse = merged[k]
        assert torch.equal(torch.isinf(merged_lse), torch.isinf(lse[:, own]))
        finite = torch.isfinite(merged_lse)
        torch.testing.assert_close(merged_lse[finite], lse[:, own][finite], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(merged_latent, latent[:, own], rtol=1e-10, atol=1e-12)
        # Out agrees up to a rare bf16 rounding flip of the latent where the query bytes agree.
        error = harness.worst_relative_error(outs[k].to(torch.bfloat16), out.view(rows, size * heads, -1)[:, own]
                                             .reshape(rows, -1), zero, heads)
        assert error <= harness.SAME_BYTES_BOUND, (k, error)


def test_prepared_mla_rejects_a_dcp_of_the_wrong_type():
    attention = harness.SyntheticAttention(2, seed=60, device="cpu")
    with pytest.raises(ValueError, match=r"dcp: expected None or a mla_decode.DcpGroup, got str"):
        mla_decode.PreparedMla(attention, {8: 4096}, dcp="ranks 0-1")


# ---- On a Hopper GPU: D processes ---------------------------------------------------------------------

CASES = {
    # name: the group's shape (interleave, heads, q), requests, padding, longest length, steps
    "I64_H12_q1": dict(interleave=64, heads=12, q=1, requests=3, padded_requests=0, max_length=600),
    "I1_H16_q2_padded": dict(interleave=1, heads=16, q=2, requests=3, padded_requests=4, max_length=500),
}


def _tail(path):
    text = pathlib.Path(path).read_text(errors="replace")
    return text if len(text) <= LOG_TAIL_CHARS else "..." + text[-LOG_TAIL_CHARS:]


@pytest.mark.skipif(harness.hopper_missing_reason() is not None, reason=harness.hopper_missing_reason() or "")
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_in_two_processes_match_the_reference(name, tmp_path):
    _library.load()  # fails here, not in every child, when the binding is missing
    size = 2
    exchange = tmp_path / "exchange"
    exchange.mkdir()
    environment = dict(os.environ)
    if _library.LIBRARY_ENV in environment:  # the children may resolve a relative path elsewhere
        environment[_library.LIBRARY_ENV] = str(pathlib.Path(environment[_library.LIBRARY_ENV]).resolve())
    children, logs = [], []
    for rank in range(size):
        spec = dict(CASES[name], rank=rank, size=size, directory=str(exchange), seed=700 + 10 * len(name),
                    eager_steps=6, graph_steps=4, wait_timeout_ms=20000, bootstrap_timeout_ms=60000)
        logs.append(tmp_path / f"rank{rank}.log")
        with open(logs[-1], "w") as log:
            children.append(subprocess.Popen([sys.executable, str(RANK_SCRIPT), json.dumps(spec)], stdout=log,
                                             stderr=subprocess.STDOUT, env=environment))

    # Wait for every rank until the deadline (sooner once one has failed), then kill what is left.
    deadline = time.monotonic() + DEADLINE_S
    killed = set()
    while any(child.poll() is None for child in children):
        if any(child.returncode not in (None, 0) for child in children):
            deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
        if time.monotonic() > deadline:
            for rank, child in enumerate(children):
                if child.poll() is None:
                    child.kill()
                    child.wait()
                    killed.add(rank)
            break
        time.sleep(0.1)

    failures, summaries = [], []
    for rank, child in enumerate(children):
        log = _tail(logs[rank])
        summary = [line for line in log.splitlines() if line.startswith("SUMMARY ")]
        if rank in killed:
            failures.append(f"rank {rank} still running at the deadline: killed; its log ends:\n{log}")
        elif child.returncode != 0:
            failures.append(f"rank {rank} failed (exit code {child.returncode}); its log ends:\n{log}")
        elif not summary:
            failures.append(f"rank {rank} exited 0 without its summary; its log ends:\n{log}")
        else:
            summaries.append(summary[0])
    print("\n".join(summaries))
    assert not failures, "\n\n".join(failures)
