"""The Python face of mla::PreparedMla: read a layer from an attention module, prepare, run steps."""

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple

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


class PreparedMla:
    """The decode step of one MLA layer on one GPU, planned once for every batch size it will see.

    Args:
        attention: the layer's attention module; see ``read_layer`` for the attributes read.
        pitches: ``{batch_rows: pitch}``, the row stride (elements) of ``projected`` for each batch
            size; pitch >= 2112 + H*128 and a multiple of 8.
        query_scratch: ``[max batch_rows, H, 576]`` float8_e4m3fn (or uint8) CUDA tensor the query
            stage writes and the core reads; it selects the device. Kept alive by this object.
        max_context: the deployment's longest sequence (bounds the split count); None = 2**17.
        core: attention core, one of ``CORES`` (``"auto"`` picks per (batch, q)).
        dcp: decode context parallelism group; only None in this build (DCP groups: issue 5).
        parity: DCP mailbox double-buffer bit, 0 or 1.
        queries: the q values (rows per request, 1..8) steps will use. Shapes
            ``{(b, q): b in pitches, q in queries, b % q == 0}`` are prepared.

    Errors (bad shapes, dtypes, strides, devices, an unknown (batch, q), ...) are RuntimeError with the
    library's message, which names the argument, what was expected and what came; nothing is written.
    The object must outlive every CUDA graph that captured its ``run``: the graph replays launches that
    read the object's buffers.
    """

    def __init__(self, attention: Any, pitches: Mapping[int, int], query_scratch: torch.Tensor, *,
                 max_context: Optional[int] = None, core: str = "auto", dcp: Any = None, parity: int = 0,
                 queries: Sequence[int] = (1,)):
        _library.load()
        if dcp is not None:
            raise ValueError(f"dcp: expected None (DCP groups are not available in this build yet), got {dcp!r}")
        self.layer = read_layer(attention)
        batch_sizes = [int(rows) for rows in pitches]
        layer = self.layer
        self._prepared = torch.classes.mla_decode.PreparedMla(
            layer.q_a_norm, layer.kv_a_norm, layer.q_b_proj, layer.w_uk_t, layer.w_uv,
            layer.q_scale, layer.k_scale, layer.rms_eps, layer.num_heads,
            batch_sizes, [int(pitches[rows]) for rows in pitches], query_scratch,
            _DEFAULT_MAX_CONTEXT if max_context is None else int(max_context), core, int(parity),
            [int(q) for q in queries])
        # The step op finds the object by this integer: a constant to torch.compile (see csrc/mla_torch.cpp).
        self._handle = self._prepared.handle()
        self.query_scratch = query_scratch
        self.num_heads = layer.num_heads
        self.device = query_scratch.device
        self.queries = tuple(int(q) for q in queries)

    @property
    def shapes(self) -> Tuple[PreparedShape, ...]:
        """The prepared (rows, q, pitch, num_splits), sorted by (rows, q)."""
        return tuple(PreparedShape(*shape) for shape in self._prepared.shapes())

    def prepare_cache(self, kv: torch.Tensor) -> None:
        """Plans every shape for this KV cache, allocates the stage buffers and warms each shape once.

        ``kv`` is ``[num_pages, 64, 576]`` float8_e4m3fn or uint8 on the object's device (a page stride
        larger than 64*576 is accepted). Call once before the first ``run`` and outside CUDA graph
        capture: it allocates and synchronizes the device. Writes nothing into ``kv``.
        """
        self._prepared.prepare(kv)

    def run(self, projected: torch.Tensor, out: torch.Tensor, *, cache: torch.Tensor, slots: torch.Tensor,
            block_table: torch.Tensor, lengths: torch.Tensor, totals: Optional[torch.Tensor] = None,
            q: int = 1) -> torch.Tensor:
        """Runs one decode step on the current CUDA stream and returns ``out``.

        Only launches kernels (no allocation, no synchronization): capturable in a CUDA graph, and one
        opaque op (``torch.ops.mla_decode.run``) to torch.compile.

        Args:
            projected: ``[rows, >= 2112 + H*128]`` bf16, row stride = the pitch prepared for ``rows``:
                columns ``[0,1536)`` q_a, ``[1536,2048)`` kv_a, ``[2048,2112)`` k_pe, then H*128 gate logits.
            out: ``[rows, H*128]`` bf16, contiguous; written.
            cache: the ``[num_pages, 64, 576]`` FP8 KV cache; this step's rows are written at ``slots``.
            slots: ``[rows]`` int64, cache slot (page*64 + offset) of each row's new token, -1 = none.
            block_table: ``[reqs, max_pages]`` int32, reqs <= rows / q (missing requests are empty).
            lengths: ``[reqs]`` int32, tokens in the cache including this step's new ones.
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
