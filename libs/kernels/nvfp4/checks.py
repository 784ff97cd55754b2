"""Input validation shared by every NVFP4 implementation.

The public functions call these before dispatching, so the torch reference and the
Triton path reject the same inputs with the same messages, and the kernels themselves can
assume well-formed tensors.

Layout policy: `x` (the high-precision input) may have any strides; implementations
copy it if they need to. `packed` and `scales` are storage formats that kernels read as raw
bytes, so they must be contiguous: a non-contiguous one is almost always a transposed or
sliced weight passed by mistake, and silently copying a weight on every call would hide
that cost. They raise ValueError instead.
"""

import torch

from .format import BLOCK

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    if t.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension (the K dimension)")


def check_quantize_input(x: torch.Tensor) -> None:
    check_float("x", x)
    k = x.shape[-1]
    if k == 0 or k % BLOCK:
        raise ValueError(f"K (last dim of x) must be a positive multiple of {BLOCK}, got {k}")
    # One reduction: NaN/Inf have no E2M1 encoding and would poison the global amax.
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or Inf; NVFP4 cannot encode them")


def as_global_scale(global_scale, device: torch.device, check_value: bool = True) -> torch.Tensor:
    """Return the decode-form global scale s2 as a 0-d fp32 tensor on `device`.

    `check_value=False` skips the positive-and-finite test, which reads the value back to
    the host: a sync per call on a GPU, where hot paths pass scales validated at load.
    """
    if (not check_value and type(global_scale) is torch.Tensor and global_scale.dim() == 0
            and global_scale.dtype == torch.float32 and global_scale.device == device):
        return global_scale  # the linear's hot path: a CUDA weight's s2, already in form
    if isinstance(global_scale, bool) or not isinstance(global_scale, (torch.Tensor, float, int)):
        kind = type(global_scale).__name__
        raise TypeError(f"global_scale must be a float or tensor, got {kind}")
    if isinstance(global_scale, torch.Tensor) and not global_scale.is_floating_point():
        raise TypeError(f"global_scale must be a floating-point tensor, got {global_scale.dtype}")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.numel() != 1:
        raise ValueError(f"global_scale must be a scalar, got shape {tuple(g.shape)}")
    g = g.reshape(())
    if check_value and not (torch.isfinite(g) and g > 0):
        raise ValueError(f"global_scale must be positive and finite, got {g.item()}")
    return g


def check_quantized(packed: torch.Tensor, scales: torch.Tensor) -> int:
    """Check a (packed, scales) pair and return K, the unpacked last dimension."""
    expected = (("packed", packed, torch.uint8), ("scales", scales, torch.float8_e4m3fn))
    for name, t, dtype in expected:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
        if t.ndim == 0:
            raise ValueError(f"{name} must have at least one dimension")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is read as raw bytes)")
    k = packed.shape[-1] * 2
    if packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * BLOCK != k:
        raise ValueError(
            f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} disagree: "
            f"expected scales [..., K/{BLOCK}] for packed [..., K/2]"
        )
    if packed.device != scales.device:
        raise ValueError(f"packed is on {packed.device} but scales on {scales.device}")
    return k


def check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")


def check_linear(x, packed, scales, bias) -> None:
    check_float("x", x)
    k = check_quantized(packed, scales)
    if packed.ndim != 2:
        raise ValueError(f"packed weight must be 2-D [N, K/2], got shape {tuple(packed.shape)}")
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]} but the weight has K={k}")
    if x.device != packed.device:
        raise ValueError(f"x is on {x.device} but the weight on {packed.device}")
    if bias is not None:
        check_float("bias", bias)
        if bias.dtype != x.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must match x dtype {x.dtype}")
        if bias.shape != (packed.shape[0],):
            raise ValueError(f"bias must have shape [{packed.shape[0]}], got {tuple(bias.shape)}")
