"""What the linear kernels share on the host: how their decode turns a nibble into a 16-bit
float, the scratch of their split-K sums, and the device facts their launchers read.

Plain torch, no Triton: the Triton kernel (triton_kernel.py) and the Gluon kernels
(gemv_kernel.py, gemm_kernel.py, small_kernel.py, small_phased_kernel.py) each import this
module, never one another.

The decode, per byte (two E2M1 codes, element 2i in the low nibble):
- put a code's 3 magnitude bits where the top exponent/mantissa bits of a 16-bit float
  start: for bf16 `(c & 7) << 6`, for fp16 `(c & 7) << 9`, and its sign at bit 15. That
  16-bit pattern IS the E2M1 value times 2^-126 (bf16) or 2^-14 (fp16): E2M1's exponent
  bias is 1, and its subnormal (code 1 = 0.5) lands on the 16-bit format's subnormal;
- multiply by the block scale pre-multiplied by 2^117 (bf16) or 2^7 (fp16), giving
  e2m1 * s_b * 2^-9 (resp. 2^-7). e2m1 has 2 significant bits and s_b 4, so the product
  has at most 6 and is exact in either format, including the fp16 subnormals it can reach
  (>= 2^-17, with its last bit >= 2^-22 > 2^-24);
- the epilogue multiplies the fp32 sum by 2^9 (2^7), exactly, and by s2.
So every kernel multiplies exact weights, sums in fp32 and rounds each output once.
"""

import functools

import torch

# Per x.dtype: (log2 of the factor folded into the block scale, log2 of the factor the
# epilogue puts back). See the module docstring.
DECODE = {torch.bfloat16: (117, 9), torch.float16: (7, 7)}

# Where a nibble's bits land in each 16-bit type after the decode's shift, and the mask
# that keeps sign, exponent and mantissa bits: the parameters of every decode's PTX.
DECODE_BITS_BF16 = dict(sh=2, mask="0x81C081C0", ty="bf16")
DECODE_BITS_F16 = dict(sh=5, mask="0x8E008E00", ty="f16")

_workspaces: dict[tuple, torch.Tensor] = {}


def split_workspace(device: torch.device, numel: int, shared: bool) -> torch.Tensor:
    """fp32 room for split-K partials: a fresh tensor, or (shared: for bound launches,
    which keep theirs across calls) one buffer per (device, stream), grown as needed. As
    with the split counters (libs/kernels/split_counters.py), launches on one stream run
    one after another, so they can share
    it; a buffer kept a workspace per bound launch instead would hold up to a few MB a
    weight and token count."""
    if not shared:
        return torch.empty(numel, dtype=torch.float32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = _workspaces[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]


@functools.cache  # asked on every linear; a device's SM count does not change
def sm_count(device: torch.device) -> int:
    """The device's SMs, which the configs size their grids by."""
    if device.type != "cuda":
        return 132  # the interpreter (TRITON_INTERPRET=1) on CPU tensors
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor makes a TMA descriptor: 16-byte aligned base and row stride,
    unit stride along the row."""
    return (t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.stride(-1) == 1)
