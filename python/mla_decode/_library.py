"""Loads the compiled binding (libmla_decode_torch.so) into torch.ops.mla_decode, once.

Where the library is looked for, first match wins:
  1. the environment variable MLA_DECODE_TORCH_LIBRARY (a path to the .so: a CMake build tree's
     ``<build>/python/libmla_decode_torch.so``);
  2. next to this file (``pip install ./python`` installs it there).
"""

import os
import pathlib

import torch

LIBRARY_ENV = "MLA_DECODE_TORCH_LIBRARY"
LIBRARY_NAME = "libmla_decode_torch.so"


def _library_path() -> pathlib.Path:
    configured = os.environ.get(LIBRARY_ENV)
    if configured:
        path = pathlib.Path(configured)
        if not path.is_file():
            raise ImportError(f"{LIBRARY_ENV}={configured}: no such file (expected the {LIBRARY_NAME} "
                              "that CMake builds under <build>/python/)")
        return path
    installed = pathlib.Path(__file__).with_name(LIBRARY_NAME)
    if installed.is_file():
        return installed
    raise ImportError(f"mla_decode: {LIBRARY_NAME} not found next to {pathlib.Path(__file__).parent} and "
                      f"{LIBRARY_ENV} is not set. Build it with CMake (a CUDA build of PyTorch on the "
                      f"python3 path turns MLA_BUILD_TORCH=AUTO on) and set {LIBRARY_ENV}, or "
                      "`pip install --no-build-isolation ./python`.")


def _register_fake_step() -> None:
    # torch.compile traces custom ops on fake tensors: the step returns nothing and only writes `out`
    # and `cache` (declared in its schema), so its fake is empty and the op stays one opaque node.
    @torch.library.register_fake("mla_decode::run")
    def _run_fake(handle, projected, out, cache, slots, block_table, lengths, totals, q):
        return None


_loaded = False


def load() -> None:
    """Loads the binding if this process has not yet (idempotent)."""
    global _loaded
    if _loaded:
        return
    torch.ops.load_library(str(_library_path()))
    _register_fake_step()
    _loaded = True
