//! PyO3 binding for hybrid-cache-core: converts values and maps errors, nothing else.

use pyo3::prelude::*;

mod attention;
mod cache_write;
mod convert;
mod coordinator;
mod elementwise;
mod errors;
mod ints;
mod list_reader;
mod pool;
mod sampling;
mod step_tables;
mod table_view;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NULL_BLOCK", hybrid_cache_core::NULL_BLOCK)?;
    ints::detect(m.py())?;
    m.add("_int_read", ints::layout_name())?;
    errors::register(m)?;
    m.add_class::<coordinator::PyGroupSpec>()?;
    m.add_class::<coordinator::PyCoordinator>()?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<table_view::TableView>()?;
    m.add_function(wrap_pyfunction!(coordinator::worst_case_live_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(coordinator::worst_case_live_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(attention::paged_attention_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(cache_write::write_cache_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(step_tables::decode_inputs_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(elementwise::rms_norm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(elementwise::gelu_tanh_mul_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(elementwise::silu_mul_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(elementwise::rotary_neox_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(sampling::log_softmax_rows_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(sampling::top_k_rows_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(sampling::logprob_top_k_rows_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(
        sampling::greedy_logprob_top_k_rows_cpu,
        m
    )?)?;
    Ok(())
}
