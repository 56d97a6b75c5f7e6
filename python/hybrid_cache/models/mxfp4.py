"""MXFP4 weights (gpt-oss experts) dequantised to a float dtype on load, in plain torch.

The format (OCP Microscaling MXFP4, as gpt-oss checkpoints store it; `quantization_config`
`{"quant_method": "mxfp4"}`):

- A weight `W` of shape [..., rows, cols] is cut along its last dim into blocks of 32 elements.
  It is stored as two tensors named after it: `<name>_blocks`, uint8 [..., rows, cols / 32, 16],
  and `<name>_scales`, uint8 [..., rows, cols / 32].
- Each element is a 4-bit FP4 E2M1 code (1 sign bit, 2 exponent bits, 1 mantissa bit): codes
  0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same magnitudes negated (`FP4_E2M1`).
- Two codes per byte, low nibble first: byte j of a block holds element 2j in bits 0-3 and
  element 2j + 1 in bits 4-7.
- Each block has one E8M0 scale byte `s`, a power of two: the block's elements are multiplied by
  2 ** (s - 127). The byte is a float32 exponent field as it stands (same bias), so the scale is
  built from its bits, exactly (s = 0 is the subnormal 2 ** -127; s = 255, NaN in the format,
  reads as infinity).

So `W[..., r, 32 * b + i] = FP4_E2M1[code i of blocks[..., r, b]] * 2 ** (scales[..., r, b] - 127)`.
Every such value is exact in float32 and bfloat16 (float16 for scales within its range).

Blocks run along the input (reduction) dim, so a stored matrix is output-major [out, in]. gpt-oss:
`gate_up_proj_blocks` [E, 2I, H / 32, 16] and `down_proj_blocks` [E, H, I / 32, 16] dequantise to
[E, 2I, H] and [E, H, I], the transposes of the input-major parameters `gate_up_proj` [E, H, 2I]
and `down_proj` [E, I, H], which `GptOssExperts.INPUT_MAJOR_PARAMETERS` lists for the loader.
"""

from __future__ import annotations

import torch

from hybrid_cache.errors import WeightMismatchError

BLOCK_SIZE = 32
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
FLOAT32_MANTISSA_BITS = 23  # an E8M0 byte shifted past them is float32's (same bias, 127)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_shape_error(blocks: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Why `blocks` and `scales` are not one MXFP4 tensor's pair, or None when they are."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2:
        return f"blocks must end in a dim of {BLOCK_SIZE // 2} bytes, got {tuple(blocks.shape)}"
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        return (
            f"blocks {tuple(blocks.shape)} need scales {tuple(blocks.shape[:-1])}, "
            f"got {tuple(scales.shape)}"
        )
    return None


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight [..., rows, n_blocks * 32] of `blocks` [..., rows, n_blocks, 16] and `scales`
    [..., rows, n_blocks] (both uint8), in `dtype`, on their device (CPU or CUDA). Values are
    computed in float32 (exact), then cast. Mismatched tensors raise `WeightMismatchError`."""
    error = mxfp4_shape_error(blocks, scales)
    if error is not None:
        raise WeightMismatchError(f"not an MXFP4 pair: {error}")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    low = table[(blocks & 0x0F).long()]
    high = table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., rows, n_blocks, 32]
    values = values * scale_factors(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """2 ** (scales - 127) in float32, built from the bits: the byte is the exponent field."""
    bits = scales.to(torch.int32) << FLOAT32_MANTISSA_BITS
    smallest = torch.full_like(bits, 1 << (FLOAT32_MANTISSA_BITS - 1))  # 2 ** -127, subnormal
    return torch.where(scales == 0, smallest, bits).view(torch.float32)
