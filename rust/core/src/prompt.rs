//! A prompt read from the front, as far as a caller needs it.
//!
//! `Coordinator::probe_cache_hit_from` hashes growing prefixes of a prompt and usually stops
//! after the first few blocks (nothing cached further). A prompt held elsewhere (a Python list
//! in the binding) then needs converting only that far: the probe asks for the prefix it is
//! about to hash, and a source converts up to there.

use crate::error::CoreError;

/// A prompt's token ids, handed out as growing prefixes.
pub trait PromptPrefix {
    /// What reading the prompt can fail with; core errors convert into it.
    type Error: From<CoreError>;

    /// The prompt's length in tokens.
    fn len(&self) -> usize;

    /// Whether the prompt has no tokens.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `num_tokens` tokens (`num_tokens <= len()`).
    fn prefix(&mut self, num_tokens: usize) -> Result<&[u32], Self::Error>;
}

impl PromptPrefix for &[u32] {
    type Error = CoreError;

    fn len(&self) -> usize {
        <[u32]>::len(self)
    }

    fn prefix(&mut self, num_tokens: usize) -> Result<&[u32], CoreError> {
        Ok(&self[..num_tokens])
    }
}

/// A prompt read into a request's own storage a piece at a time
/// (`Coordinator::add_request_read`): each piece's blocks are hashed as it lands, so reading a
/// prompt held elsewhere (a Python list's int objects, bound by memory) overlaps hashing it.
pub trait PromptReader {
    /// What reading the prompt can fail with; core errors convert into it.
    type Error: From<CoreError>;

    /// The prompt's length in tokens.
    fn len(&self) -> usize;

    /// Whether the prompt has no tokens.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the prompt's tokens `tokens.len()..end` to `tokens` (`end <= len()`); on error
    /// `tokens` may hold some of them.
    fn read_to(&mut self, tokens: &mut Vec<u32>, end: usize) -> Result<(), Self::Error>;
}

impl PromptReader for &[u32] {
    type Error = CoreError;

    fn len(&self) -> usize {
        <[u32]>::len(self)
    }

    fn read_to(&mut self, tokens: &mut Vec<u32>, end: usize) -> Result<(), CoreError> {
        tokens.extend_from_slice(&self[tokens.len()..end]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{PromptPrefix, PromptReader};

    #[test]
    fn a_slice_hands_out_its_own_prefixes() {
        let tokens = [1u32, 2, 3];
        let mut source: &[u32] = &tokens;
        assert_eq!(PromptPrefix::len(&source), 3);
        assert!(!PromptPrefix::is_empty(&source));
        assert_eq!(source.prefix(2).unwrap(), &[1, 2]);
        assert_eq!(source.prefix(3).unwrap(), &tokens);
    }

    #[test]
    fn a_slice_is_read_a_piece_at_a_time() {
        let tokens = [1u32, 2, 3, 4];
        let mut source: &[u32] = &tokens;
        assert_eq!(PromptReader::len(&source), 4);
        let mut read = vec![];
        source.read_to(&mut read, 1).unwrap();
        source.read_to(&mut read, 4).unwrap();
        assert_eq!(read, tokens);
    }
}
