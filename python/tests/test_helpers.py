"""The package's pure-Python parts: reading a layer from a module, core_for, pad_requests, shared_workspace.
Need PyTorch, not a GPU nor the compiled binding."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the mla_decode Python tests need it")

import mla_decode  # noqa: E402


class _Norm(torch.nn.Module):
    """An RMSNorm spelled like vLLM / HF DeepSeek (`variance_epsilon`)."""

    def __init__(self, width, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=torch.bfloat16))
        self.variance_epsilon = eps


def _module(heads=2, eps=1e-5):
    attention = torch.nn.Module()
    attention.q_a_layernorm = torch.nn.RMSNorm(1536, eps=eps, dtype=torch.bfloat16)
    attention.kv_a_layernorm = torch.nn.RMSNorm(512, eps=eps, dtype=torch.bfloat16)
    attention.q_b_proj = torch.nn.Linear(1536, heads * 192, bias=False, dtype=torch.bfloat16)
    attention.W_UK_T = torch.zeros(heads, 128, 512, dtype=torch.bfloat16)
    attention.W_UV = torch.zeros(heads, 512, 128, dtype=torch.bfloat16)
    attention.q_scale = 0.5
    attention.k_scale = torch.tensor([0.25])
    return attention


def test_read_layer_from_torch_modules():
    layer = mla_decode.read_layer(_module(heads=3, eps=1e-6))
    assert layer.num_heads == 3
    assert layer.q_b_proj.shape == (3 * 192, 1536)
    assert (layer.q_scale, layer.k_scale, layer.rms_eps) == (0.5, 0.25, pytest.approx(1e-6))


def test_read_layer_vllm_spellings_and_contiguous_copies():
    attention = torch.nn.Module()
    attention.q_a_layernorm = _Norm(1536, 1e-5)
    attention.kv_a_layernorm = _Norm(512, 1e-5)
    attention.q_b_proj = torch.nn.Linear(1536, 2 * 192, bias=False, dtype=torch.bfloat16)
    attention._q_scale = torch.tensor(1.0)
    attention._k_scale = torch.tensor(2.0)
    attention.impl = torch.nn.Module()
    # vLLM builds the absorbed weights as permuted views.
    attention.impl.W_UK_T = torch.zeros(128, 512, 2, dtype=torch.bfloat16).permute(2, 0, 1)
    attention.impl.W_UV = torch.zeros(512, 2, 128, dtype=torch.bfloat16).transpose(0, 1)
    layer = mla_decode.read_layer(attention)
    assert layer.w_uk_t.is_contiguous() and layer.w_uv.is_contiguous()
    assert layer.w_uk_t.shape == (2, 128, 512) and layer.w_uv.shape == (2, 512, 128)
    assert (layer.q_scale, layer.k_scale, layer.rms_eps) == (1.0, 2.0, pytest.approx(1e-5))


def test_read_layer_errors_name_the_attribute():
    attention = _module()
    del attention.W_UV
    with pytest.raises(AttributeError, match=r"W_UV, w_uv"):
        mla_decode.read_layer(attention)
    attention = _module()
    attention.q_b_proj = torch.nn.Linear(1536, 2 * 192, bias=False)  # float32
    with pytest.raises(ValueError, match=r"q_b_proj.weight: expected dtype torch.bfloat16, got torch.float32"):
        mla_decode.read_layer(attention)
    attention = _module()
    attention.kv_a_layernorm.eps = 1e-6
    with pytest.raises(ValueError, match=r"one epsilon for both RMSNorms"):
        mla_decode.read_layer(attention)
    attention = _module()
    attention.q_scale = torch.ones(4)
    with pytest.raises(ValueError, match=r"q_scale: expected one per-tensor scale"):
        mla_decode.read_layer(attention)


def test_core_for():
    assert mla_decode.core_for(8, "auto", 4) == "fp8_split_kv"
    assert mla_decode.core_for(1) == "fp8_split_kv"
    with pytest.raises(ValueError, match=r"core: expected one of \{'auto'\}, got 'flashmla'"):
        mla_decode.core_for(8, "flashmla", 1)
    with pytest.raises(ValueError, match=r"batch: expected a positive multiple of q = 4, got 6"):
        mla_decode.core_for(6, "auto", 4)
    with pytest.raises(ValueError, match=r"q: expected in \[1, 8\], got 9"):
        mla_decode.core_for(9, "auto", 9)


def test_pad_requests():
    block_table = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    lengths = torch.tensor([100, 70], dtype=torch.int32)
    totals = torch.tensor([200, 140], dtype=torch.int32)
    padded_table, padded_lengths, padded_totals = mla_decode.pad_requests(4, block_table, lengths, totals)
    assert padded_table.tolist() == [[3, 4], [5, 6], [0, 0], [0, 0]]
    assert padded_lengths.tolist() == [100, 70, 0, 0]
    assert padded_totals.tolist() == [200, 140, 0, 0]
    assert padded_table.dtype == torch.int32 and padded_lengths.dtype == torch.int32
    same = mla_decode.pad_requests(2, block_table, lengths)
    assert same[0] is block_table and same[1] is lengths and same[2] is None
    with pytest.raises(ValueError, match=r"block_table: expected at most batch = 1 requests, got 2"):
        mla_decode.pad_requests(1, block_table, lengths)
    with pytest.raises(ValueError, match=r"lengths: expected shape \[2\]"):
        mla_decode.pad_requests(4, block_table, lengths[:1])


class _FakePrepared:
    """What shared_workspace reads of a PreparedMla: its device and workspace_bytes()."""

    def __init__(self, device, size):
        self.device = torch.device(device)
        self._size = size

    def workspace_bytes(self):
        return self._size


def test_shared_workspace_takes_the_largest_size():
    workspace = mla_decode.shared_workspace([_FakePrepared("cpu", 1000), _FakePrepared("cpu", 4096)])
    assert workspace.dtype == torch.uint8 and workspace.numel() == 4096


def test_shared_workspace_rejects_no_objects_and_mixed_devices():
    with pytest.raises(ValueError, match=r"objects: expected at least one PreparedMla, got none"):
        mla_decode.shared_workspace([])
    with pytest.raises(ValueError, match=r"objects: expected one device"):
        mla_decode.shared_workspace([_FakePrepared("cpu", 1), _FakePrepared("meta", 1)])
