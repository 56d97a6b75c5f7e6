//! PyO3 binding for hybrid-cache-core: converts values and maps errors, nothing else.

use pyo3::prelude::*;

mod errors;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    Ok(())
}
