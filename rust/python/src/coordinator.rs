//! `Coordinator` and `GroupSpec`: conversion and error mapping around the core coordinator.

use hybrid_cache_core::manager::{
    worst_case_live_blocks as core_worst_case, worst_case_live_tokens as core_live_tokens,
    AdmissionLimits,
};
use hybrid_cache_core::{
    AllocateStep, AttentionKind, Coordinator, CoordinatorConfig, ExtraKeys, GroupSpec, HashAlgo,
    MultimodalItem,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::convert::{hash128, int64s, size, token_ids, token_ids_into, ListTokens, ReadError};
use crate::errors::{invalid_argument, to_py};
use crate::list_reader::ListReader;
use crate::table_view::TableView;

/// One KV-cache group, as in `_core.pyi`.
#[pyclass(name = "GroupSpec", module = "hybrid_cache._core", frozen)]
#[derive(Clone)]
pub struct PyGroupSpec {
    spec: GroupSpec,
}

#[pymethods]
impl PyGroupSpec {
    #[new]
    #[pyo3(signature = (kind, block_size, window=None, chunk=None))]
    fn new(kind: &str, block_size: i64, window: Option<i64>, chunk: Option<i64>) -> PyResult<Self> {
        let block_size = size("block_size", block_size)?;
        let kind = match (kind, window, chunk) {
            ("full", None, None) => AttentionKind::Full,
            ("sliding_window", Some(window), None) => AttentionKind::SlidingWindow {
                window: size("window", window)?,
            },
            ("chunked_local", None, Some(chunk)) => AttentionKind::ChunkedLocal {
                chunk: size("chunk", chunk)?,
            },
            _ => {
                return Err(invalid_argument(format!(
                    "kind {kind:?} with window={window:?}, chunk={chunk:?}: use 'full' (no \
                     window or chunk), 'sliding_window' with a window, or 'chunked_local' with \
                     a chunk"
                )))
            }
        };
        let spec = GroupSpec { kind, block_size };
        spec.validate(0).map_err(to_py)?;
        Ok(PyGroupSpec { spec })
    }

    #[getter]
    fn kind(&self) -> &'static str {
        match self.spec.kind {
            AttentionKind::Full => "full",
            AttentionKind::SlidingWindow { .. } => "sliding_window",
            AttentionKind::ChunkedLocal { .. } => "chunked_local",
        }
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.spec.block_size
    }

    #[getter]
    fn window(&self) -> Option<usize> {
        match self.spec.kind {
            AttentionKind::SlidingWindow { window } => Some(window),
            _ => None,
        }
    }

    #[getter]
    fn chunk(&self) -> Option<usize> {
        match self.spec.kind {
            AttentionKind::ChunkedLocal { chunk } => Some(chunk),
            _ => None,
        }
    }

    /// Most blocks a request of `max_total_tokens` tokens holds at once in this group when a
    /// step computes at most `max_num_batched_tokens` tokens (the core's admission bound).
    fn max_live_blocks(
        &self,
        max_total_tokens: i64,
        max_num_batched_tokens: i64,
    ) -> PyResult<usize> {
        let reach = match self.spec.kind {
            AttentionKind::Full => None,
            AttentionKind::SlidingWindow { window } => Some(window),
            AttentionKind::ChunkedLocal { chunk } => Some(chunk),
        };
        worst_case_live_blocks(
            self.spec.block_size as i64,
            reach.map(|reach| reach as i64),
            max_total_tokens,
            max_num_batched_tokens,
        )
    }

    fn __repr__(&self) -> String {
        let extra = match self.spec.kind {
            AttentionKind::Full => String::new(),
            AttentionKind::SlidingWindow { window } => format!(", window={window}"),
            AttentionKind::ChunkedLocal { chunk } => format!(", chunk={chunk}"),
        };
        format!(
            "GroupSpec({:?}, block_size={}{extra})",
            self.kind(),
            self.spec.block_size
        )
    }
}

/// The core's worst case of live blocks for a group of `block_size`-token blocks whose queries
/// see `reach` tokens back (`None`: full attention), as in `_core.pyi`. Unlike `GroupSpec`, a
/// chunk need not be a multiple of the block size (the planner sizes groups it may reject).
#[pyfunction]
#[pyo3(signature = (block_size, reach, max_total_tokens, max_num_batched_tokens))]
pub fn worst_case_live_blocks(
    block_size: i64,
    reach: Option<i64>,
    max_total_tokens: i64,
    max_num_batched_tokens: i64,
) -> PyResult<usize> {
    let block_size = size("block_size", block_size)?;
    let reach = reach.map(|reach| size("reach", reach)).transpose()?;
    if block_size == 0 || reach == Some(0) {
        return Err(invalid_argument(format!(
            "block_size ({block_size}) and reach ({reach:?}) must be at least 1"
        )));
    }
    let limits = AdmissionLimits {
        max_total_tokens: size("max_total_tokens", max_total_tokens)?,
        max_num_batched_tokens: size("max_num_batched_tokens", max_num_batched_tokens)?,
    };
    Ok(core_worst_case(block_size, reach, limits))
}

/// The core's worst case of live tokens for queries that see `reach` tokens back (`None`: full
/// attention), as in `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (reach, max_total_tokens, max_num_batched_tokens))]
pub fn worst_case_live_tokens(
    reach: Option<i64>,
    max_total_tokens: i64,
    max_num_batched_tokens: i64,
) -> PyResult<usize> {
    let reach = reach.map(|reach| size("reach", reach)).transpose()?;
    if reach == Some(0) {
        return Err(invalid_argument("reach must be at least 1".to_string()));
    }
    let limits = AdmissionLimits {
        max_total_tokens: size("max_total_tokens", max_total_tokens)?,
        max_num_batched_tokens: size("max_num_batched_tokens", max_num_batched_tokens)?,
    };
    Ok(core_live_tokens(reach, limits))
}

/// The hybrid coordinator, as in `_core.pyi`.
#[pyclass(name = "Coordinator", module = "hybrid_cache._core")]
pub struct PyCoordinator {
    inner: Coordinator,
    /// A batch's steps as `allocate_batch` converts them (kept: no allocation per call).
    steps: Vec<AllocateStep>,
}

#[pymethods]
impl PyCoordinator {
    #[new]
    #[pyo3(signature = (
        num_blocks, groups, max_num_reqs, max_model_len, max_num_batched_tokens,
        enable_prefix_caching=true, hash_algo="xxh3", hash_seed=0, tail_replay_tokens=None,
        token_tails=false, protected_blocks=None
    ))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature in _core.pyi
    fn new(
        num_blocks: i64,
        groups: Vec<PyRef<'_, PyGroupSpec>>,
        max_num_reqs: i64,
        max_model_len: i64,
        max_num_batched_tokens: i64,
        enable_prefix_caching: bool,
        hash_algo: &str,
        hash_seed: u64,
        tail_replay_tokens: Option<i64>,
        token_tails: bool,
        protected_blocks: Option<i64>,
    ) -> PyResult<Self> {
        let hash = match hash_algo {
            "xxh3" => HashAlgo::Xxh3,
            "sha256" => HashAlgo::Sha256,
            other => {
                return Err(invalid_argument(format!(
                    "hash_algo must be 'xxh3' or 'sha256', got {other:?}"
                )))
            }
        };
        let config = CoordinatorConfig {
            num_blocks: size("num_blocks", num_blocks)?,
            groups: groups.iter().map(|group| group.spec).collect(),
            max_num_reqs: size("max_num_reqs", max_num_reqs)?,
            max_model_len: size("max_model_len", max_model_len)?,
            max_num_batched_tokens: size("max_num_batched_tokens", max_num_batched_tokens)?,
            enable_prefix_caching,
            hash,
            hash_seed,
        };
        let mut inner = Coordinator::new(config).map_err(to_py)?;
        let replay = tail_replay_tokens
            .map(|tokens| size("tail_replay_tokens", tokens))
            .transpose()?;
        inner.set_tail_replay(replay).map_err(to_py)?;
        inner.set_token_tails(token_tails);
        let protected = protected_blocks
            .map(|blocks| size("protected_blocks", blocks))
            .transpose()?;
        inner.set_protected_blocks(protected);
        Ok(PyCoordinator {
            inner,
            steps: Vec::new(),
        })
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    #[getter]
    fn max_num_reqs(&self) -> usize {
        self.inner.config().max_num_reqs
    }

    #[getter]
    fn max_blocks_per_req(&self) -> usize {
        self.inner.max_blocks_per_req()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        use hybrid_cache_core::BlockAllocator;
        self.inner.pool().num_free_blocks()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }

    fn max_blocks_needed(&self, num_tokens: i64) -> PyResult<usize> {
        Ok(self
            .inner
            .max_blocks_needed(size("num_tokens", num_tokens)?))
    }

    /// The hit `find_cache_hit` would find for this prompt, without adding a request or
    /// changing anything (see `Coordinator::probe_cache_hit` in the core).
    #[pyo3(signature = (prompt_token_ids, lora_id=None, cache_salt=None, mm_hashes=None))]
    fn probe_cache_hit(
        &self,
        prompt_token_ids: &Bound<'_, PyAny>,
        lora_id: Option<i64>,
        cache_salt: Option<String>,
        mm_hashes: Option<Vec<(i64, i64, Bound<'_, PyAny>)>>,
    ) -> PyResult<usize> {
        let extra = extra_keys(lora_id, cache_salt, mm_hashes)?;
        if let Ok(list) = prompt_token_ids.cast::<PyList>() {
            // Converted only as far as the probe hashes (usually a few blocks).
            return self
                .inner
                .probe_cache_hit_from(&mut ListTokens::new(list), &extra)
                .map_err(|ReadError(error)| error);
        }
        let tokens = token_ids(prompt_token_ids)?;
        self.inner.probe_cache_hit(&tokens, &extra).map_err(to_py)
    }

    #[pyo3(signature = (
        request_id, prompt_token_ids, max_total_tokens=None, lora_id=None, cache_salt=None,
        mm_hashes=None
    ))]
    fn add_request(
        &mut self,
        request_id: i64,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_total_tokens: Option<i64>,
        lora_id: Option<i64>,
        cache_salt: Option<String>,
        mm_hashes: Option<Vec<(i64, i64, Bound<'_, PyAny>)>>,
    ) -> PyResult<usize> {
        let request_id = crate::convert::request_id(request_id)?;
        let max_total_tokens = max_total_tokens
            .map(|tokens| size("max_total_tokens", tokens))
            .transpose()?;
        let extra = extra_keys(lora_id, cache_salt, mm_hashes)?;
        if let Ok(list) = prompt_token_ids.cast::<PyList>() {
            // Read into the request's own storage a piece at a time, each piece hashed as it
            // lands (the core's `add_request_read`).
            let mut reader = ListReader::new(list);
            return self
                .inner
                .add_request_read(request_id, &mut reader, max_total_tokens, extra)
                .map_err(|ReadError(error)| error);
        }
        // Converted straight into the request's own storage (room for every token it may
        // reach), a finished request's when one is kept.
        let inner = &mut self.inner;
        let storage =
            |len| inner.token_storage(<Coordinator>::token_capacity(len, max_total_tokens));
        let tokens = token_ids_into(prompt_token_ids, storage)?;
        self.inner
            .add_request_owned(request_id, tokens, max_total_tokens, extra)
            .map_err(to_py)
    }

    fn append_token_ids(&mut self, request_id: i64, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let request_id = crate::convert::request_id(request_id)?;
        let tokens = crate::convert::token_ids(token_ids)?;
        self.inner
            .append_token_ids(request_id, &tokens)
            .map_err(to_py)
    }

    fn append_token_ids_batch(
        &mut self,
        request_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = crate::convert::request_ids(request_ids)?;
        let tokens = crate::convert::token_ids(token_ids)?;
        self.inner
            .append_token_ids_batch(&ids, &tokens)
            .map_err(to_py)
    }

    #[pyo3(signature = (request_id, max_tokens=None))]
    fn find_cache_hit(&mut self, request_id: i64, max_tokens: Option<i64>) -> PyResult<usize> {
        let request_id = crate::convert::request_id(request_id)?;
        let max_tokens = max_tokens
            .map(|tokens| size("max_tokens", tokens))
            .transpose()?;
        self.inner
            .find_cache_hit_within(request_id, max_tokens)
            .map_err(to_py)
    }

    fn replay_frontier(&self, request_id: i64) -> PyResult<usize> {
        let request_id = crate::convert::request_id(request_id)?;
        self.inner.replay_frontier(request_id).map_err(to_py)
    }

    fn pending_hit_tokens(&self, request_id: i64) -> PyResult<usize> {
        let request_id = crate::convert::request_id(request_id)?;
        self.inner.pending_hit_tokens(request_id).map_err(to_py)
    }

    #[pyo3(signature = (request_id, num_computed_tokens, num_new_tokens, reserve = 0))]
    fn allocate(
        &mut self,
        request_id: i64,
        num_computed_tokens: i64,
        num_new_tokens: i64,
        reserve: i64,
    ) -> PyResult<bool> {
        let step = AllocateStep {
            request_id: crate::convert::request_id(request_id)?,
            num_computed_tokens: size("num_computed_tokens", num_computed_tokens)?,
            num_new_tokens: size("num_new_tokens", num_new_tokens)?,
        };
        let reserve = size("reserve", reserve)?;
        self.inner.allocate_keeping(step, reserve).map_err(to_py)
    }

    fn allocate_batch(
        &mut self,
        request_ids: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        // Lists of non-negative ints (a decode step's): one pass, no copies in between.
        let lists = [request_ids, num_computed_tokens, num_new_tokens];
        let step = |[id, computed, new]: [i64; 3]| {
            Some(AllocateStep {
                request_id: u64::try_from(id).ok()?,
                num_computed_tokens: usize::try_from(computed).ok()?,
                num_new_tokens: usize::try_from(new).ok()?,
            })
        };
        if crate::convert::int_rows(lists, step, &mut self.steps).is_some() {
            return self.inner.allocate_batch(&self.steps).map_err(to_py);
        }
        let ids = int64s("request_ids", request_ids)?;
        let computed = int64s("num_computed_tokens", num_computed_tokens)?;
        let new = int64s("num_new_tokens", num_new_tokens)?;
        if ids.len() != computed.len() || ids.len() != new.len() {
            return Err(invalid_argument(format!(
                "request_ids, num_computed_tokens and num_new_tokens must have one length, got \
                 {}, {} and {}",
                ids.len(),
                computed.len(),
                new.len()
            )));
        }
        let steps = ids
            .iter()
            .zip(&computed)
            .zip(&new)
            .map(|((&id, &computed), &new)| {
                Ok(AllocateStep {
                    request_id: crate::convert::request_id(id)?,
                    num_computed_tokens: size("num_computed_tokens", computed)?,
                    num_new_tokens: size("num_new_tokens", new)?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        self.inner.allocate_batch(&steps).map_err(to_py)
    }

    /// Frees the request's blocks and row, keeping its tokens and hashes for
    /// `resume_request` (see `Coordinator::preempt_request` in the core).
    fn preempt_request(&mut self, request_id: i64) -> PyResult<()> {
        let request_id = crate::convert::request_id(request_id)?;
        self.inner.preempt_request(request_id).map_err(to_py)
    }

    #[pyo3(signature = (request_id, max_total_tokens=None, num_tokens=None))]
    fn resume_request(
        &mut self,
        request_id: i64,
        max_total_tokens: Option<i64>,
        num_tokens: Option<i64>,
    ) -> PyResult<usize> {
        let request_id = crate::convert::request_id(request_id)?;
        let max_total_tokens = max_total_tokens
            .map(|tokens| size("max_total_tokens", tokens))
            .transpose()?;
        let num_tokens = num_tokens
            .map(|tokens| size("num_tokens", tokens))
            .transpose()?;
        self.inner
            .resume_request(request_id, max_total_tokens, num_tokens)
            .map_err(to_py)
    }

    fn forget_request(&mut self, request_id: i64) -> PyResult<bool> {
        let request_id = crate::convert::request_id(request_id)?;
        Ok(self.inner.forget_request(request_id))
    }

    fn free_request(&mut self, request_id: i64) -> PyResult<()> {
        let request_id = crate::convert::request_id(request_id)?;
        self.inner.free_request(request_id).map_err(to_py)
    }

    fn num_tokens(&self, request_id: i64) -> PyResult<usize> {
        let request_id = crate::convert::request_id(request_id)?;
        self.inner.num_tokens(request_id).map_err(to_py)
    }

    fn row_of(&self, request_id: i64) -> PyResult<usize> {
        let request_id = crate::convert::request_id(request_id)?;
        self.inner.row_of(request_id).map_err(to_py)
    }

    fn request_blocks(&self, request_id: i64, group: i64) -> PyResult<Vec<u32>> {
        let request_id = crate::convert::request_id(request_id)?;
        let group = size("group", group)?;
        let blocks = self
            .inner
            .request_blocks(request_id, group)
            .map_err(to_py)?;
        Ok(blocks.to_vec())
    }

    /// (num_groups, max_num_reqs, max_blocks_per_req) int32 numpy view of the table, no copy.
    fn block_table<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let (data, shape) = {
            let this = slf.borrow();
            let table = this.inner.table();
            (table.entries_ptr(), table.shape().to_vec())
        };
        numpy_view(slf, data, &shape)
    }

    /// (num_groups, max_num_reqs) int32 numpy view of the row lengths, no copy.
    fn num_blocks_per_row<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let (data, shape) = {
            let this = slf.borrow();
            let table = this.inner.table();
            (table.lengths_ptr(), table.shape()[..2].to_vec())
        };
        numpy_view(slf, data, &shape)
    }

    /// `stats()["prefix_queries"]` alone (no dict): what a caller checks each step before
    /// reading the prefix-cache counters, which move only with it.
    #[getter]
    fn num_prefix_queries(&self) -> u64 {
        self.inner.num_prefix_queries()
    }

    fn num_used_blocks_per_group(&self) -> Vec<usize> {
        self.inner.num_used_blocks_per_group().to_vec()
    }

    /// The page copies the allocations since the last call asked for, as `(src, dst)` pairs
    /// (see `Coordinator::take_block_copies` in the core).
    fn take_block_copies(&mut self) -> Vec<(u32, u32)> {
        self.inner
            .take_block_copies()
            .into_iter()
            .map(|copy| (copy.src, copy.dst))
            .collect()
    }

    /// Every cached block as `(block, group, hash)`, by block id (a read-only view for tests
    /// and debugging; reads every block).
    fn cached_blocks(&self) -> Vec<(u32, u32, u128)> {
        self.inner
            .cached_blocks()
            .into_iter()
            .map(|(block, key)| (block, key.group, key.hash.0))
            .collect()
    }

    /// The free blocks in eviction order (first evicted first).
    fn free_queue_order(&self) -> Vec<u32> {
        self.inner.free_queue_order()
    }

    fn num_protected_blocks(&self) -> usize {
        self.inner.num_protected_blocks()
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner.stats();
        let dict = PyDict::new(py);
        dict.set_item("num_blocks", stats.pool.num_blocks)?;
        dict.set_item("num_free_blocks", stats.pool.num_free_blocks)?;
        dict.set_item("num_cached_blocks", stats.pool.num_cached_blocks)?;
        dict.set_item("num_spare_blocks", stats.pool.num_spare_blocks)?;
        dict.set_item("num_evictions", stats.pool.num_evictions)?;
        dict.set_item("prefix_queries", stats.prefix_queries)?;
        dict.set_item("prefix_hits", stats.prefix_hits)?;
        let hits = &stats.hits;
        dict.set_item("prefix_miss_window_tail", hits.miss_window_tail)?;
        dict.set_item("prefix_miss_never_cached", hits.miss_never_cached)?;
        dict.set_item("prefix_miss_evicted", hits.miss_evicted)?;
        dict.set_item("prefix_miss_alignment", hits.miss_alignment)?;
        dict.set_item("prefix_alone_hits_per_group", hits.alone.clone())?;
        dict.set_item("prefix_shortened_per_group", hits.shortened.clone())?;
        dict.set_item("prefix_replays", hits.replays)?;
        dict.set_item("prefix_replay_tokens", hits.replay_tokens)?;
        dict.set_item("prefix_replay_gain", hits.replay_gain)?;
        dict.set_item("prefix_tail_hits", hits.tail_hits)?;
        dict.set_item("prefix_tail_gain", hits.tail_gain)?;
        dict.set_item("hashed_blocks", stats.hashed_blocks)?;
        dict.set_item("parked_requests", stats.parked_requests)?;
        Ok(dict)
    }
}

/// The extra keys of a request (adapter, salt, multimodal items) from their Python forms.
fn extra_keys(
    lora_id: Option<i64>,
    cache_salt: Option<String>,
    mm_hashes: Option<Vec<(i64, i64, Bound<'_, PyAny>)>>,
) -> PyResult<ExtraKeys> {
    let lora_id = lora_id
        .map(|id| {
            u64::try_from(id)
                .map_err(|_| invalid_argument(format!("lora_id must be non-negative, got {id}")))
        })
        .transpose()?;
    let mut mm_items = Vec::new();
    for (start_token, num_tokens, item_hash) in mm_hashes.unwrap_or_default() {
        mm_items.push(MultimodalItem {
            start_token: size("mm start_token", start_token)?,
            num_tokens: size("mm num_tokens", num_tokens)?,
            item_hash: hash128(&item_hash)?,
        });
    }
    Ok(ExtraKeys {
        lora_id,
        cache_salt,
        mm_items,
    })
}

/// `numpy.asarray` over a `TableView` of the coordinator's memory.
fn numpy_view<'py>(
    owner: &Bound<'py, PyCoordinator>,
    data: *const i32,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    let py = owner.py();
    let view = Bound::new(py, TableView::new(owner.clone().unbind(), data, shape))?;
    py.import("numpy")?.call_method1("asarray", (view,))
}
