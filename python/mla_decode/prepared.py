"""The Python face of mla::PreparedMla: read a layer from an attention module, prepare, run steps;
under decode context parallelism, one rank's group (DcpGroup) and its share of each sequence."""

import dataclasses
import os
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _library

# Attribute names read from the attention module, first match wins. Each is looked up on the module
# itself, then on `module.impl` (vLLM keeps the absorbed W_UK_T / W_UV on its MLA implementation object).
Q_A_NORM_NAMES = ("q_a_layernorm", "q_a_norm")     # an RMSNorm module (its .weight) or a [1536] tensor
KV_A_NORM_NAMES = ("kv_a_layernorm", "kv_a_norm")  # an RMSNorm module (its .weight) or a [512] tensor
Q_B_PROJ_NAMES = ("q_b_proj",)                     # a Linear (its .weight [H*192, 1536]) or the tensor
W_UK_T_NAMES = ("W_UK_T", "w_uk_t")                # [H, 128, 512]
W_UV_NAMES = ("W_UV", "w_uv")                      # [H, 512, 128]
Q_SCALE_NAMES = ("q_scale", "_q_scale_float", "_q_scale")  # float or one-element tensor
K_SCALE_NAMES = ("k_scale", "_k_scale_float", "_k_scale")
# The RMSNorm epsilon: on each norm module, else on the attention module.
NORM_EPS_NAMES = ("variance_epsilon", "eps")
LAYER_EPS_NAMES = ("rms_eps", "rms_norm_eps")

# Attention cores this build has; "auto" picks per (batch, q).
CORES = ("auto",)
# What "auto" resolves to today for every shape: the FP8 split-KV core of src/core (version 1).
_AUTO_CORE = "fp8_split_kv"
_MAX_QUERIES = 8
_DEFAULT_MAX_CONTEXT = 1 << 17


@dataclasses.dataclass(frozen=True)
class LayerTensors:
    """The tensors and constants of one MLA layer as the library takes them (bf16, contiguous)."""

    q_a_norm: torch.Tensor   # [1536] bf16
    kv_a_norm: torch.Tensor  # [512] bf16
    q_b_proj: torch.Tensor   # [H*192, 1536] bf16: per head rows h*192 + [0,128) nope, + [128,192) rope
    w_uk_t: torch.Tensor     # [H, 128, 512] bf16
    w_uv: torch.Tensor       # [H, 512, 128] bf16
    q_scale: float           # FP8 query dequant multiplier: query bytes = e4m3(q / q_scale)
    k_scale: float           # FP8 cache dequant multiplier: cache bytes = e4m3(k / k_scale)
    rms_eps: float           # epsilon of both RMSNorms

    @property
    def num_heads(self) -> int:
        return self.w_uk_t.shape[0]


class PreparedShape(NamedTuple):
    rows: int        # rows of projected / out
    q: int           # rows per request
    pitch: int       # row stride of projected (elements)
    num_splits: int  # split-KV count of the core (fixed by prepare_cache)


def _owners(attention: Any) -> Sequence[Tuple[str, Any]]:
    owners = [("", attention)]
    impl = getattr(attention, "impl", None)
    if impl is not None:
        owners.append(("impl.", impl))
    return owners


def _find(attention: Any, names: Sequence[str]) -> Tuple[str, Any]:
    for prefix, owner in _owners(attention):
        for name in names:
            value = getattr(owner, name, None)
            if value is not None:
                return prefix + name, value
    tried = ", ".join(prefix + name for prefix, _ in _owners(attention) for name in names)
    raise AttributeError(f"{type(attention).__name__}: none of the attributes {{{tried}}} is set")


def _bf16_weight(attention: Any, names: Sequence[str]) -> torch.Tensor:
    path, value = _find(attention, names)
    if not isinstance(value, torch.Tensor):
        weight = getattr(value, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{path}: expected a tensor or a module with a .weight tensor, "
                            f"got {type(value).__name__}")
        path, value = path + ".weight", weight
    if value.dtype != torch.bfloat16:
        raise ValueError(f"{path}: expected dtype torch.bfloat16, got {value.dtype} "
                         "(quantized or float weights: convert them to bfloat16 first)")
    # NOTE: absorbed weights are often permuted views (vLLM's W_UK_T, W_UV): the library reads packed
    # row-major tensors, so those are copied once here and the copies live with the prepared object.
    return value.detach().contiguous()


def _scale(attention: Any, names: Sequence[str]) -> float:
    path, value = _find(attention, names)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{path}: expected one per-tensor scale, got a tensor of shape {list(value.shape)}")
        return float(value.item())
    return float(value)


def _rms_eps(attention: Any) -> float:
    found = {}
    for names in (Q_A_NORM_NAMES, KV_A_NORM_NAMES):
        path, norm = _find(attention, names)
        for name in NORM_EPS_NAMES:
            if getattr(norm, name, None) is not None:
                found[f"{path}.{name}"] = float(getattr(norm, name))
                break
    if not found:
        return float(_find(attention, LAYER_EPS_NAMES)[1])
    if len(set(found.values())) != 1:
        raise ValueError(f"rms eps: expected one epsilon for both RMSNorms (the kernel has one), got {found}")
    return next(iter(found.values()))


def read_layer(attention: Any) -> LayerTensors:
    """Reads one MLA layer from an attention module.

    Attributes read (first match wins, on ``attention`` then on ``attention.impl``):
      q_a_layernorm | q_a_norm     RMSNorm module (``.weight``) or tensor, [1536] bf16
      kv_a_layernorm | kv_a_norm   RMSNorm module (``.weight``) or tensor, [512] bf16
      q_b_proj                     Linear module (``.weight``) or tensor, [H*192, 1536] bf16
      W_UK_T | w_uk_t              [H, 128, 512] bf16
      W_UV | w_uv                  [H, 512, 128] bf16
      q_scale | _q_scale_float | _q_scale   float or one-element tensor
      k_scale | _k_scale_float | _k_scale   float or one-element tensor
      rms eps: ``variance_epsilon`` | ``eps`` of both norm modules (they must agree), else
               ``rms_eps`` | ``rms_norm_eps`` of the module
    H is W_UK_T.shape[0]. Weights must be bf16 (a float or FP8 weight is an error, never silently
    converted); non-contiguous ones are copied. Shapes are checked by the library.
    """
    return LayerTensors(
        q_a_norm=_bf16_weight(attention, Q_A_NORM_NAMES),
        kv_a_norm=_bf16_weight(attention, KV_A_NORM_NAMES),
        q_b_proj=_bf16_weight(attention, Q_B_PROJ_NAMES),
        w_uk_t=_bf16_weight(attention, W_UK_T_NAMES),
        w_uv=_bf16_weight(attention, W_UV_NAMES),
        q_scale=_scale(attention, Q_SCALE_NAMES),
        k_scale=_scale(attention, K_SCALE_NAMES),
        rms_eps=_rms_eps(attention),
    )


def _cuda_device(device: Union[None, int, str, torch.device]) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {resolved}")
    return resolved if resolved.index is not None else torch.device("cuda", torch.cuda.current_device())


class DcpGroup:
    """This process's rank of a decode-context-parallel (DCP) group: one rank per process, on any GPUs
    of one host (several ranks may share a GPU).

    The ranks find each other through files in ``directory`` (mla::FileBootstrap: it must exist, be
    empty, be seen by every rank and serve this one group; the caller removes it afterwards), then map
    each other's buffers with CUDA IPC (mla::IpcDcp). Per rank and parity the group holds the mailbox
    ``[max_rows, size*num_heads, 576]`` (every rank's query), this rank's partial latent and LSE over
    its shard for all ``size*num_heads`` heads, and the epoch signals that order the ranks' stages.

    Construction is collective: every rank constructs its group within ``bootstrap_timeout_ms`` of the
    others. So is destruction (a barrier before the buffers are unmapped): every rank drops its last
    reference at the same point (the ``PreparedMla`` objects built with the group hold one each).

    Args:
        directory: the rendezvous directory shared by the ranks.
        rank: this process's rank k in ``[0, size)``.
        size: D, ranks in the group, 2..8.
        interleave: I, consecutive global positions owned together: rank k owns position g iff
            ``(g // I) % D == k`` (DESIGN.md §4, DCP; ``dcp_local_lengths`` gives each rank's count).
        num_heads: H, the heads this rank serves (its ``W_UK_T.shape[0]``); the core of every rank
            runs all D*H heads over its own shard.
        max_rows: rows of the largest batch any ``PreparedMla`` of the group will run.
        device: this rank's CUDA device (an index, ``"cuda:N"`` or a ``torch.device``); None = the
            current one.
        wait_timeout_ms: how long a step's wait for a peer spins on the GPU before it traps (the step
            then fails with a CUDA error instead of hanging).
        bootstrap_timeout_ms: how long construction, ``barrier`` and destruction wait for a peer.

    Raises RuntimeError with the library's message (naming the argument, what was expected and what
    came) for bad arguments, a peer whose group differs (D, I, H, max_rows) or a timed-out peer.
    """

    def __init__(self, directory: Union[str, os.PathLike], rank: int, size: int, *, interleave: int,
                 num_heads: int, max_rows: int, device: Union[None, int, str, torch.device] = None,
                 wait_timeout_ms: int = 10000, bootstrap_timeout_ms: int = 30000):
        _library.load()
        self.device = _cuda_device(device)
        self._group = torch.classes.mla_decode.DcpGroup(
            os.fspath(directory), int(rank), int(size), int(interleave), int(num_heads), int(max_rows),
            self.device.index, int(wait_timeout_ms), int(bootstrap_timeout_ms))

    @property
    def rank(self) -> int:
        return self._group.rank()

    @property
    def size(self) -> int:
        return self._group.size()

    @property
    def interleave(self) -> int:
        return self._group.interleave()

    @property
    def num_heads(self) -> int:
        """H, the heads this rank serves."""
        return self._group.num_heads()

    @property
    def max_rows(self) -> int:
        return self._group.max_rows()

    @property
    def transport(self) -> str:
        """How the ranks reach each other's buffers: ``"cuda-ipc"``."""
        return self._group.transport()

    def barrier(self) -> None:
        """Returns once every rank has called it (collective; a file exchange, not for every step).

        Call it after every rank has run ``prepare_cache`` on every layer and before the first step:
        a rank's warm-up writes its own buffers, which a peer's first step must not overwrite."""
        self._group.barrier()

    def __repr__(self) -> str:
        return (f"DcpGroup(rank={self.rank}, size={self.size}, interleave={self.interleave}, "
                f"num_heads={self.num_heads}, max_rows={self.max_rows}, device={self.device}, "
                f"transport={self.transport!r})")


def dcp_local_lengths(lengths: torch.Tensor, rank: int, size: int, interleave: int) -> torch.Tensor:
    """Tokens of each sequence that DCP rank ``rank`` of ``size`` holds, from the global lengths.

    Rank k owns global position g iff ``(g // interleave) % size == k`` (DESIGN.md §4, DCP), so of a
    sequence of T tokens it holds ``(T // (I*D)) * I + clamp(T % (I*D) - k*I, 0, I)``: the ``lengths``
    of that rank's step, whose ``totals`` are the global ``lengths`` given here. Its local token j is
    global position ``((j // I) * D + k) * I + j % I``.

    ``lengths`` is an integer tensor of non-negative values on any device; the result has its shape,
    dtype and device. Only tensor arithmetic (no synchronization), so it may run inside a captured
    CUDA graph. Raises ValueError for a non-integer tensor, ``size < 1``, ``rank`` outside
    ``[0, size)`` or ``interleave < 1``.
    """
    if not isinstance(lengths, torch.Tensor) or lengths.is_floating_point() or lengths.is_complex() \
            or lengths.dtype == torch.bool:
        got = lengths.dtype if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        raise ValueError(f"lengths: expected an integer tensor, got {got}")
    if size < 1:
        raise ValueError(f"size: expected >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank: expected in [0, {size}), got {rank}")
    if interleave < 1:
        raise ValueError(f"interleave: expected >= 1, got {interleave}")
    cycle = interleave * size
    in_last_cycle = lengths % cycle - rank * interleave
    return (lengths // cycle) * interleave + in_last_cycle.clamp(0, interleave)


class PreparedMla:
    """The decode step of one MLA layer on one GPU, planned once for every batch size it will see.

    Args:
        attention: the layer's attention module; see ``read_layer`` for the attributes read. Under
            DCP: this rank's H heads (``q_b_proj``, ``W_UK_T``, ``W_UV`` of heads [k*H, (k+1)*H)),
            the scales shared by the group.
        pitches: ``{batch_rows: pitch}``, the row stride (elements) of ``projected`` for each batch
            size; pitch >= 2112 + H*128 and a multiple of 8.
        query_scratch: ``[max batch_rows, H, 576]`` float8_e4m3fn (or uint8) CUDA tensor the query
            stage writes and the core reads; it selects the device. Kept alive by this object.
            None under DCP (the group's mailboxes replace it; the group selects the device).
        max_context: the deployment's longest sequence (bounds the split count); None = 2**17.
        core: attention core, one of ``CORES`` (``"auto"`` picks per (batch, q)).
        dcp: this rank's ``DcpGroup`` (decode context parallelism), or None. Its ``num_heads`` must be
            the layer's H and its ``max_rows`` at least the largest batch. Kept alive by this object.
        parity: DCP mailbox double-buffer bit, 0 or 1: consecutive layers alternate (layer l takes
            l % 2), so one layer never overwrites what a slower peer still reads of the previous one.
        queries: the q values (rows per request, 1..8) steps will use. Shapes
            ``{(b, q): b in pitches, q in queries, b % q == 0}`` are prepared.

    Errors (bad shapes, dtypes, strides, devices, an unknown (batch, q), ...) are RuntimeError with the
    library's message, which names the argument, what was expected and what came; nothing is written.
    A ``dcp`` that is not a ``DcpGroup``, a group of other heads, or a query scratch given (or missing)
    against the DCP setting is a ValueError. The object must outlive every CUDA graph that captured its
    ``run``: the graph replays launches that read the object's buffers.
    """

    def __init__(self, attention: Any, pitches: Mapping[int, int], query_scratch: Optional[torch.Tensor] = None,
                 *, max_context: Optional[int] = None, core: str = "auto", dcp: Optional[DcpGroup] = None,
                 parity: int = 0, queries: Sequence[int] = (1,)):
        if dcp is not None and not isinstance(dcp, DcpGroup):
            raise ValueError(f"dcp: expected None or a mla_decode.DcpGroup, got {type(dcp).__name__}")
        _library.load()
        self.layer = read_layer(attention)
        layer = self.layer
        if dcp is not None:
            if dcp.num_heads != layer.num_heads:
                raise ValueError(f"dcp: expected a group of num_heads = {layer.num_heads} (the heads of this "
                                 f"rank's layer, W_UK_T.shape[0]), got a group of num_heads = {dcp.num_heads}")
            if query_scratch is not None:
                raise ValueError("query_scratch: expected None under DCP (the group's mailboxes hold the query), "
                                 f"got a tensor of shape {list(query_scratch.shape)}")
        elif query_scratch is None:
            raise ValueError(f"query_scratch: expected a [max batch rows, {layer.num_heads}, 576] float8_e4m3fn "
                             "CUDA tensor (None only with dcp=), got None")
        batch_sizes = [int(rows) for rows in pitches]
        self._prepared = torch.classes.mla_decode.PreparedMla(
            layer.q_a_norm, layer.kv_a_norm, layer.q_b_proj, layer.w_uk_t, layer.w_uv,
            layer.q_scale, layer.k_scale, layer.rms_eps, layer.num_heads,
            batch_sizes, [int(pitches[rows]) for rows in pitches], query_scratch,
            _DEFAULT_MAX_CONTEXT if max_context is None else int(max_context), core,
            None if dcp is None else dcp._group, int(parity), [int(q) for q in queries])
        # The step op finds the object by this integer: a constant to torch.compile (see csrc/mla_torch.cpp).
        self._handle = self._prepared.handle()
        self.query_scratch = query_scratch
        self.dcp = dcp
        self.parity = int(parity)
        self.num_heads = layer.num_heads
        self.device = dcp.device if dcp is not None else query_scratch.device
        self.queries = tuple(int(q) for q in queries)

    @property
    def shapes(self) -> Tuple[PreparedShape, ...]:
        """The prepared (rows, q, pitch, num_splits), sorted by (rows, q)."""
        return tuple(PreparedShape(*shape) for shape in self._prepared.shapes())

    @property
    def device_bytes(self) -> int:
        """Device memory the object allocated: 0 before ``prepare_cache``; then ``workspace_bytes()`` unless the
        caller gave a workspace, plus the attention core's tile counters where a shape merges its splits in the
        split kernel (4 bytes a request and M-tile). The caller's tensors are not counted."""
        return int(self._prepared.device_bytes())

    def workspace_bytes(self) -> int:
        """Bytes of the stage buffers (sized for the largest prepared shape): what ``prepare_cache`` needs
        in a caller's ``workspace``. Plans every shape on the object's device; allocates nothing."""
        return int(self._prepared.workspace_bytes())

    def prepare_cache(self, kv: torch.Tensor, workspace: Optional[torch.Tensor] = None) -> None:
        """Plans every shape for this KV cache, sets up the stage buffers and warms each shape once.

        ``kv`` is ``[num_pages, 64, 576]`` float8_e4m3fn or uint8 on the object's device, 16-byte aligned
        (a page stride larger than 64*576 is accepted when it is a multiple of 16 bytes). Without
        ``workspace`` the object allocates its stage buffers; with it (uint8 ``[>= workspace_bytes()]`` on
        the object's device, 256-byte aligned; the object keeps a reference to it) they live there, so the layers of
        one model, which never run at the same time, can share one workspace of the largest of their
        ``workspace_bytes()``; prepare them while none of them runs. Call before the first ``run`` and
        outside CUDA graph capture: it may allocate and it synchronizes the device. Writes nothing into
        ``kv``.
        """
        self._prepared.prepare(kv, workspace)

    def run(self, projected: torch.Tensor, out: torch.Tensor, *, cache: torch.Tensor, slots: torch.Tensor,
            block_table: torch.Tensor, lengths: torch.Tensor, totals: Optional[torch.Tensor] = None,
            q: int = 1) -> torch.Tensor:
        """Runs one decode step on the current CUDA stream and returns ``out``.

        Only launches kernels (no allocation, no synchronization): capturable in a CUDA graph, and one
        opaque op (``torch.ops.mla_decode.run``) to torch.compile. Under DCP the step publishes this
        rank's query to every peer and waits on the GPU for the peers' query and partials, so every
        rank runs the same sequence of steps per parity (eagerly or as graph replays).

        Args:
            projected: ``[rows, >= 2112 + H*128]`` bf16, row stride = the pitch prepared for ``rows``:
                columns ``[0,1536)`` q_a, ``[1536,2048)`` kv_a, ``[2048,2112)`` k_pe, then H*128 gate logits.
            out: ``[rows, H*128]`` bf16, contiguous; written.
            cache: the ``[num_pages, 64, 576]`` FP8 KV cache (under DCP: this rank's shard); this
                step's rows are written at ``slots``.
            slots: ``[rows]`` int64, cache slot (page*64 + offset) of each row's new token, -1 = none
                (under DCP, -1 for every token another rank owns).
            block_table: ``[reqs, max_pages]`` int32, reqs <= rows / q (missing requests are empty).
            lengths: ``[reqs]`` int32, tokens in the cache including this step's new ones (under DCP
                the local ones: ``dcp_local_lengths(totals, rank, size, interleave)``).
            totals: ``[reqs]`` int32 global lengths under DCP; None without DCP.
            q: rows per request (1 + draft length), one of the prepared ``queries``.
        """
        torch.ops.mla_decode.run(self._handle, projected, out, cache, slots, block_table, lengths, totals, q)
        return out

    def check_step(self, projected: torch.Tensor, out: torch.Tensor, *, cache: torch.Tensor,
                   slots: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                   totals: Optional[torch.Tensor] = None, q: int = 1) -> None:
        """``run``'s checks plus the values of the metadata (page indices and slots in range, lengths
        within the block table and max_context). Copies the metadata to the host and SYNCHRONIZES: for
        debugging and tests. Raises like ``run``; launches nothing."""
        self._prepared.check_step(projected, out, cache, slots, block_table, lengths, totals, q)


def shared_workspace(objects: Sequence["PreparedMla"]) -> torch.Tensor:
    """One uint8 workspace for prepared objects that never run at the same time (the layers of one model,
    run in order on one stream): the largest of their ``workspace_bytes()``, on their device. Pass it to
    each object's ``prepare_cache(kv, workspace=...)``. Raises ValueError for no objects or objects on
    different devices."""
    objects = list(objects)
    if not objects:
        raise ValueError("objects: expected at least one PreparedMla, got none")
    devices = {torch.device(mla.device) for mla in objects}
    if len(devices) != 1:
        raise ValueError(f"objects: expected one device, got {sorted(str(d) for d in devices)}")
    size = max(mla.workspace_bytes() for mla in objects)
    return torch.empty(size, dtype=torch.uint8, device=devices.pop())  # the caching allocator aligns to 512 B


def core_for(batch: int, core: str = "auto", q: int = 1) -> str:
    """The attention core that runs a step of ``batch`` rows with ``q`` rows per request when the object
    was built with ``core``.

    This build has one core, ``"fp8_split_kv"`` (src/core: FP8 QK, fp16 PV, split-KV with an LSE
    combine), which ``"auto"`` picks for every shape. Raises ValueError for an unknown core, a q outside
    1..8 or a batch that is not a positive multiple of q.
    """
    if core not in CORES:
        raise ValueError(f"core: expected one of {set(CORES)}, got {core!r}")
    if not 1 <= q <= _MAX_QUERIES:
        raise ValueError(f"q: expected in [1, {_MAX_QUERIES}], got {q}")
    if batch < 1 or batch % q != 0:
        raise ValueError(f"batch: expected a positive multiple of q = {q}, got {batch}")
    return _AUTO_CORE


def pad_requests(batch: int, block_table: torch.Tensor, lengths: torch.Tensor,
                 totals: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Pads the per-request metadata to ``batch`` requests with empty ones (length 0, every page 0).

    For CUDA graphs: a graph captured for ``batch`` requests keeps the shapes of its metadata, so a
    step with fewer live requests copies the padded tensors into the captured ones. Padded requests
    produce exactly zero rows and read no page. (``run`` also accepts fewer requests than rows / q
    directly, with the same result.)

    Returns ``(block_table, lengths, totals)``: ``[batch, max_pages]`` and ``[batch]`` tensors of the same
    dtypes and device (totals stays None if None); the inputs themselves if they already hold ``batch``
    requests. Raises ValueError if they hold more, or if their request counts disagree.
    """
    requests = block_table.shape[0]
    if lengths.shape != (requests,):
        raise ValueError(f"lengths: expected shape [{requests}] (block_table's requests), got {list(lengths.shape)}")
    if totals is not None and totals.shape != (requests,):
        raise ValueError(f"totals: expected shape [{requests}] (block_table's requests), got {list(totals.shape)}")
    if requests > batch:
        raise ValueError(f"block_table: expected at most batch = {batch} requests, got {requests}")
    if requests == batch:
        return block_table, lengths, totals
    padding = batch - requests
    block_table = torch.cat([block_table, block_table.new_zeros((padding, block_table.shape[1]))])
    lengths = torch.cat([lengths, lengths.new_zeros(padding)])
    if totals is not None:
        totals = torch.cat([totals, totals.new_zeros(padding)])
    return block_table, lengths, totals
