"""mla_decode: the decode step of a Multi-head Latent Attention layer (Kimi K3) as a prepared object.

A PyTorch binding of the C++ ``mla::PreparedMla`` (include/mla/mla.h); DESIGN.md is the specification.

    import mla_decode
    mla = mla_decode.PreparedMla(attention, pitches={8: 4096}, query_scratch=scratch, queries=(1, 4))
    mla.prepare_cache(kv_cache)
    mla.run(projected, out, cache=kv_cache, slots=slots, block_table=block_table, lengths=lengths, q=4)

Under decode context parallelism each rank's process builds a ``DcpGroup`` and passes ``dcp=group``
(no query scratch); ``dcp_local_lengths`` gives a rank's lengths from the global ones (``totals``).
"""

from .prepared import (CORES, DcpGroup, LayerTensors, PreparedMla, PreparedShape, core_for, dcp_local_lengths,
                       pad_requests, read_layer, shared_workspace)

__all__ = ["CORES", "DcpGroup", "LayerTensors", "PreparedMla", "PreparedShape", "core_for", "dcp_local_lengths",
           "pad_requests", "read_layer", "shared_workspace"]
