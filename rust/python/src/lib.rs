//! PyO3 binding for hybrid-cache-core: converts values and maps errors, nothing else.

use pyo3::prelude::*;

mod attention;
mod convert;
mod coordinator;
mod errors;
mod pool;
mod table_view;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<coordinator::PyGroupSpec>()?;
    m.add_class::<coordinator::PyCoordinator>()?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<table_view::TableView>()?;
    m.add_function(wrap_pyfunction!(attention::paged_attention_cpu, m)?)?;
    Ok(())
}
