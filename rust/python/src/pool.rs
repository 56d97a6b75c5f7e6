//! `BlockPool`: the default pool on its own, for tests and benchmarks.

use hybrid_cache_core::{BlockAllocator, BlockHash, CacheKey, DefaultPool};
use pyo3::prelude::*;

use crate::convert::{hash128, size};
use crate::errors::{invalid_argument, to_py};

#[pyclass(name = "BlockPool", module = "hybrid_cache._core", frozen)]
pub struct PyBlockPool {
    inner: DefaultPool,
}

fn block_id(block: i64) -> PyResult<u32> {
    u32::try_from(block).map_err(|_| invalid_argument(format!("block id {block} is out of range")))
}

fn cache_key(group: i64, block_hash: &Bound<'_, PyAny>) -> PyResult<CacheKey> {
    let group = u32::try_from(group)
        .map_err(|_| invalid_argument(format!("group id {group} is out of range")))?;
    Ok(CacheKey {
        group,
        hash: BlockHash(hash128(block_hash)?),
    })
}

#[pymethods]
impl PyBlockPool {
    #[new]
    fn new(num_blocks: i64) -> PyResult<Self> {
        let inner = DefaultPool::new(size("num_blocks", num_blocks)?).map_err(to_py)?;
        Ok(PyBlockPool { inner })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    fn get_new_blocks(&self, count: i64) -> PyResult<Vec<u32>> {
        let mut out = Vec::new();
        self.inner
            .get_new_blocks(size("count", count)?, &mut out)
            .map_err(to_py)?;
        Ok(out)
    }

    fn free_blocks(&self, blocks: Vec<i64>) -> PyResult<()> {
        let blocks = blocks
            .into_iter()
            .map(block_id)
            .collect::<PyResult<Vec<u32>>>()?;
        self.inner.free_blocks(&blocks).map_err(to_py)
    }

    fn cache_block(&self, block: i64, group: i64, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = cache_key(group, block_hash)?;
        self.inner.cache_block(block_id(block)?, key).map_err(to_py)
    }

    fn cached_block(&self, group: i64, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        Ok(self.inner.cached_block(cache_key(group, block_hash)?))
    }

    fn touch_cached(
        &self,
        block: i64,
        group: i64,
        block_hash: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let key = cache_key(group, block_hash)?;
        Ok(self.inner.touch_cached(block_id(block)?, key))
    }

    fn reset_prefix_cache(&self) -> bool {
        self.inner.reset_prefix_cache()
    }

    fn ref_count(&self, block: i64) -> PyResult<u32> {
        Ok(self.inner.ref_count(block_id(block)?))
    }

    fn free_queue_order(&self) -> Vec<u32> {
        self.inner.free_queue_order()
    }
}
