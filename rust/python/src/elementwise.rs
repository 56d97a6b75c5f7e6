//! The fused element-wise ops of hybrid-cache-attention (`rms_norm_cpu`, `gelu_tanh_mul_cpu`,
//! `silu_mul_cpu`, `rotary_neox_cpu`) on buffers (numpy arrays, e.g. `torch.Tensor.numpy()`
//! views). Converts buffers to slices and errors to exceptions; nothing else.

use hybrid_cache_attention::{gelu_tanh_mul, rms_norm, rotate_neox, silu_mul, AttentionError};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::convert::{contiguous_items, output};
use crate::errors::{attention_to_py, invalid_argument};

/// RMSNorm over the last axis: `out = x / sqrt(mean(x^2) + eps) * (offset + weight)` for `x`
/// of any shape [..., dim] (float32, C-contiguous), `weight` [dim]; `out` like `x`, writable,
/// not overlapping an input.
#[pyfunction]
#[pyo3(signature = (x, weight, out, offset, eps))]
pub fn rms_norm_cpu(
    x: PyBuffer<f32>,
    weight: PyBuffer<f32>,
    mut out: PyBuffer<f32>,
    offset: f32,
    eps: f32,
) -> PyResult<()> {
    let dims = x.dimensions();
    if dims == 0 {
        return Err(invalid_argument(
            "x must have at least one dimension".to_owned(),
        ));
    }
    let x_items = contiguous_items(&x, "x", dims)?;
    let weight_items = contiguous_items(&weight, "weight", 1)?;
    let out_slice = output(
        &mut out,
        "out",
        &x_items.shape,
        &[x_items.bytes(), weight_items.bytes()],
    )?;
    let dim = x_items.shape[dims - 1];
    let rows = x_items.shape[..dims - 1].iter().product();
    rms_norm(
        x_items.slice,
        rows,
        dim,
        weight_items.slice,
        offset,
        eps,
        out_slice,
    )
    .map_err(attention_to_py)
}

type GatedOp = fn(&[f32], &[f32], &mut [f32]) -> Result<(), AttentionError>;

fn gated(
    op: GatedOp,
    gate: &PyBuffer<f32>,
    up: &PyBuffer<f32>,
    out: &mut PyBuffer<f32>,
) -> PyResult<()> {
    let gate_items = contiguous_items(gate, "gate", gate.dimensions())?;
    let up_items = contiguous_items(up, "up", up.dimensions())?;
    if gate_items.shape != up_items.shape {
        return Err(invalid_argument(format!(
            "gate and up must have the same shape, got {:?} and {:?}",
            gate_items.shape, up_items.shape
        )));
    }
    let out_slice = output(
        out,
        "out",
        &gate_items.shape,
        &[gate_items.bytes(), up_items.bytes()],
    )?;
    op(gate_items.slice, up_items.slice, out_slice).map_err(attention_to_py)
}

/// `out = gelu(gate, approximate="tanh") * up` element-wise: `gate` and `up` float32,
/// C-contiguous, one shape; `out` the same, writable, not overlapping an input.
#[pyfunction]
pub fn gelu_tanh_mul_cpu(
    gate: PyBuffer<f32>,
    up: PyBuffer<f32>,
    mut out: PyBuffer<f32>,
) -> PyResult<()> {
    gated(gelu_tanh_mul, &gate, &up, &mut out)
}

/// `out = silu(gate) * up` element-wise, with the arguments of `gelu_tanh_mul_cpu`.
#[pyfunction]
pub fn silu_mul_cpu(
    gate: PyBuffer<f32>,
    up: PyBuffer<f32>,
    mut out: PyBuffer<f32>,
) -> PyResult<()> {
    gated(silu_mul, &gate, &up, &mut out)
}

/// Neox-style rotary embedding: `x` [tokens, heads, head_dim] (float32, C-contiguous) rotated
/// on its first `rotary_dim` dims by `cos` / `sin` (tokens x rotary_dim / 2 values each, any
/// C-contiguous shape, e.g. [tokens, 1, rotary_dim / 2]) into `out` (x's shape, writable, not
/// overlapping an input).
#[pyfunction]
#[pyo3(signature = (x, cos, sin, out, rotary_dim))]
pub fn rotary_neox_cpu(
    x: PyBuffer<f32>,
    cos: PyBuffer<f32>,
    sin: PyBuffer<f32>,
    mut out: PyBuffer<f32>,
    rotary_dim: usize,
) -> PyResult<()> {
    let x_items = contiguous_items(&x, "x", 3)?;
    let cos_items = contiguous_items(&cos, "cos", cos.dimensions())?;
    let sin_items = contiguous_items(&sin, "sin", sin.dimensions())?;
    let out_slice = output(
        &mut out,
        "out",
        &x_items.shape,
        &[x_items.bytes(), cos_items.bytes(), sin_items.bytes()],
    )?;
    rotate_neox(
        x_items.slice,
        x_items.shape[1],
        x_items.shape[2],
        rotary_dim,
        cos_items.slice,
        sin_items.slice,
        out_slice,
    )
    .map_err(attention_to_py)
}
