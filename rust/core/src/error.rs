//! Errors a caller can cause. Each variant's message says what to change. Internal invariants
//! are `debug_assert!`s, never errors.

use std::fmt;

/// One variant per kind of user-reachable failure; the binding maps each to its own Python
/// exception class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoreError {
    /// A size, count or parameter outside its valid range.
    InvalidArgument(String),
    /// The pool has fewer free blocks than asked; nothing was taken.
    NoFreeBlocks { requested: usize, free: usize },
    /// A block id that is the null block, out of range, or not held.
    InvalidBlock(String),
    /// Freeing a block more times than it is referenced.
    DoubleFree { block: u32 },
    /// A request id the coordinator does not know (never added, or already freed).
    UnknownRequest { request_id: u64 },
    /// A request id added twice.
    DuplicateRequest { request_id: u64 },
    /// A group id out of range.
    InvalidGroup { group: u32, num_groups: usize },
    /// A request whose worst-case need exceeds what the pool or the table can ever hold.
    RequestTooLarge(String),
    /// Every row of the block table is taken (more running requests than `max_num_reqs`).
    TooManyRequests { max_num_reqs: usize },
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidArgument(message) => write!(f, "{message}"),
            CoreError::NoFreeBlocks { requested, free } => write!(
                f,
                "asked for {requested} blocks but only {free} are free; free some requests \
                 or give the pool more blocks"
            ),
            CoreError::InvalidBlock(message) => write!(f, "{message}"),
            CoreError::DoubleFree { block } => write!(
                f,
                "block {block} is freed more times than it is referenced (double free)"
            ),
            CoreError::UnknownRequest { request_id } => write!(
                f,
                "unknown request id {request_id}: add it first, or it was already freed"
            ),
            CoreError::DuplicateRequest { request_id } => write!(
                f,
                "request id {request_id} is already added; free it before adding it again"
            ),
            CoreError::InvalidGroup { group, num_groups } => write!(
                f,
                "group id {group} is out of range: there are {num_groups} groups (0..{num_groups})"
            ),
            CoreError::RequestTooLarge(message) => write!(f, "{message}"),
            CoreError::TooManyRequests { max_num_reqs } => write!(
                f,
                "all {max_num_reqs} block-table rows are in use; finish or free a request, \
                 or raise max_num_reqs"
            ),
        }
    }
}

impl std::error::Error for CoreError {}
