//! Chained block hashing with extra keys.
//!
//! Only full blocks are hashed. Block `i` of a request (tokens `i*B .. (i+1)*B`) gets
//!
//! ```text
//!   h_0 = H(root,    tokens[0..B],   extra keys of block 0)
//!   h_i = H(h_{i-1}, tokens[iB..(i+1)B], extra keys of block i)
//! ```
//!
//! so a hash names the whole prefix up to and including its block. `root` is derived from a seed,
//! which makes hashes reproducible across runs with the same seed and unrelated across seeds.
//!
//! Extra keys mixed into a block:
//! - the adapter (LoRA) id, on every block: a prefix under another adapter has other KV;
//! - the cache salt, on block 0 only: the chain carries it to every later block;
//! - each multimodal item hash, on every block its token range overlaps.
//!
//! The bytes hashed are `0 | parent (16 LE) | token count (4 LE) | tokens (4 LE each) | tagged
//! extras`, each extra preceded by a one-byte tag so two different key sets never serialise
//! alike. Under sha256 a block with no extra key and every token id below 2^18 (every vocabulary
//! of the models we serve) is hashed *packed* instead: `1 | parent (16 LE) | token count (2 LE) |
//! tokens (18 bits each, little-endian bit order, the last byte zero-padded)`, 55 bytes for 16
//! tokens: one sha256 compression instead of two. The first byte says which layout follows, and
//! each layout decodes back to its inputs, so no two blocks serialise alike.
//!
//! Algorithms: xxh3-128 (default, fast, not cryptographic) or sha256 truncated to 128 bits.
//!
//! Why a hit does not compare stored token ids under xxh3-128: the pool stores no tokens (it would
//! double the memory touched per lookup and need a second store kept in sync with eviction), and
//! for inputs nobody crafts on purpose a 128-bit collision is negligible: even 10^12 distinct
//! cached blocks collide with probability about 10^24 / 2^129 < 10^-14. Xxh3 is not collision
//! resistant against an adversary, though: a deployment where one tenant could craft prompts to
//! alias another tenant's cache should use a per-tenant cache salt and `HashAlgo::Sha256`.

use sha2::digest::generic_array::GenericArray;

use crate::error::CoreError;
use crate::sha256_packed;
use crate::types::BlockHash;

/// Which 128-bit hash function names blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HashAlgo {
    /// xxh3-128: fast, non-cryptographic (see the module docs for why that is enough).
    #[default]
    Xxh3,
    /// sha256 truncated to its first 128 bits: for caches shared by untrusted tenants.
    Sha256,
}

/// A multimodal item (an image, an audio clip) occupying `num_tokens` placeholder tokens from
/// `start_token`; `item_hash` names its content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultimodalItem {
    pub start_token: usize,
    pub num_tokens: usize,
    pub item_hash: u128,
}

/// Keys besides the token ids that decide what a block's KV holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// Adapter (LoRA) id; mixed into every block.
    pub lora_id: Option<u64>,
    /// Cache salt (e.g. per tenant); mixed into block 0 only.
    pub cache_salt: Option<String>,
    /// Multimodal items; each is mixed into the blocks it overlaps.
    pub mm_items: Vec<MultimodalItem>,
}

impl ExtraKeys {
    /// Checks the multimodal ranges against a prompt of `prompt_len` tokens.
    pub fn validate(&self, prompt_len: usize) -> Result<(), CoreError> {
        for item in &self.mm_items {
            let inside = match item.start_token.checked_add(item.num_tokens) {
                Some(end) => end <= prompt_len,
                None => false,
            };
            if item.num_tokens == 0 || !inside {
                return Err(CoreError::InvalidArgument(format!(
                    "multimodal item (start {}, {} tokens) must cover at least one token inside \
                     the prompt of {prompt_len} tokens",
                    item.start_token, item.num_tokens
                )));
            }
        }
        Ok(())
    }
}

const TAG_LORA: u8 = 1;
const TAG_SALT: u8 = 2;
const TAG_MULTIMODAL: u8 = 3;

thread_local! {
    /// The bytes of the block being hashed, reused by every `extend_chain` on the thread.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Computes chained block hashes for one algorithm and seed.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    /// Parent hash of block 0.
    root: BlockHash,
}

impl BlockHasher {
    /// A hasher whose chains start from a root derived from `seed`.
    pub fn new(algo: HashAlgo, seed: u64) -> Self {
        let mut bytes = b"hybrid-cache root".to_vec();
        bytes.extend_from_slice(&seed.to_le_bytes());
        let root = digest(algo, &bytes);
        BlockHasher { algo, root }
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The parent of block 0.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// Appends to `hashes` the hashes of every full block of `tokens` (blocks of `block_size`)
    /// not hashed yet: `hashes` holds the chain of blocks `0..hashes.len()` on entry.
    pub fn extend_chain(
        &self,
        tokens: &[u32],
        block_size: usize,
        extra: &ExtraKeys,
        hashes: &mut Vec<BlockHash>,
    ) {
        if hashes.len() < tokens.len() / block_size {
            // A decode step hashes one block: no allocation for its bytes.
            SCRATCH.with_borrow_mut(|buffer| {
                self.extend_chain_in(tokens, block_size, extra, hashes, buffer)
            });
        }
    }

    /// `extend_chain` writing each block's bytes into `buffer`.
    fn extend_chain_in(
        &self,
        tokens: &[u32],
        block_size: usize,
        extra: &ExtraKeys,
        hashes: &mut Vec<BlockHash>,
        buffer: &mut Vec<u8>,
    ) {
        debug_assert!(block_size > 0, "block size is validated by the coordinator");
        let num_full = tokens.len() / block_size;
        if hashes.len() >= num_full {
            return;
        }
        buffer.reserve(24 + 4 * block_size);
        hashes.reserve(num_full - hashes.len());
        // Blocks of 16 under sha256 with no adapter and no multimodal item: the one-compression
        // chain (the salt only changes block 0).
        let packed_16 = self.algo == HashAlgo::Sha256
            && block_size == sha256_packed::TOKENS
            && extra.lora_id.is_none()
            && extra.mm_items.is_empty();
        let mut index = hashes.len();
        while index < num_full {
            if packed_16 && (index != 0 || extra.cache_salt.is_none()) {
                let rest = &tokens[index * block_size..num_full * block_size];
                index += sha256_packed::extend(LAYOUT_PACKED, self.root.0, rest, hashes);
                if index == num_full {
                    break;
                }
            }
            let parent = hashes.last().copied().unwrap_or(self.root);
            let start = index * block_size;
            let block = BlockSpan {
                index,
                start,
                tokens: &tokens[start..start + block_size],
            };
            let hash = self.hash_block(parent, &block, extra, buffer);
            hashes.push(hash);
            index += 1;
        }
    }

    /// Hash of the `tokens` a block of index `index` (first token at `start`) holds, given its
    /// parent (the previous block's hash, or the root for block 0), when it is not full: the
    /// key of a freed request's *token tail* (see `coordinator::tails`). The length is hashed
    /// in, so it never equals the hash of a full block after the same parent.
    pub fn hash_partial(
        &self,
        parent: BlockHash,
        index: usize,
        start: usize,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> BlockHash {
        let mut buffer = Vec::with_capacity(24 + 4 * tokens.len());
        let block = BlockSpan {
            index,
            start,
            tokens,
        };
        self.hash_block(parent, &block, extra, &mut buffer)
    }

    /// Hash of one block given its parent; `buffer` is scratch space reused across blocks.
    fn hash_block(
        &self,
        parent: BlockHash,
        block: &BlockSpan<'_>,
        extra: &ExtraKeys,
        buffer: &mut Vec<u8>,
    ) -> BlockHash {
        encode_block(parent, block, extra, self.algo == HashAlgo::Sha256, buffer);
        digest(self.algo, buffer)
    }
}

/// First byte of a block's hashed bytes: the layout that follows (see the module docs).
const LAYOUT_WIDE: u8 = 0;
const LAYOUT_PACKED: u8 = 1;
/// Bits per token id in the packed layout.
const PACKED_BITS: u32 = 18;

/// Writes into `buffer` the bytes a block is hashed from: packed when `packed` allows it and
/// the block qualifies (no extra key applies to it, every token id below 2^18), else wide.
fn encode_block(
    parent: BlockHash,
    block: &BlockSpan<'_>,
    extra: &ExtraKeys,
    packed: bool,
    buffer: &mut Vec<u8>,
) {
    buffer.clear();
    let block_end = block.start + block.tokens.len();
    let overlaps = |item: &MultimodalItem| {
        item.start_token < block_end && block.start < item.start_token + item.num_tokens
    };
    let plain = extra.lora_id.is_none()
        && (block.index != 0 || extra.cache_salt.is_none())
        && !extra.mm_items.iter().any(overlaps);
    let count = u16::try_from(block.tokens.len()).ok();
    if let (true, true, Some(count)) = (packed, plain, count) {
        if block.tokens.iter().all(|&token| token >> PACKED_BITS == 0) {
            // Written in place (4 bytes at a time, 3 bytes of slack cut off at the end).
            let len = 19 + (block.tokens.len() * PACKED_BITS as usize).div_ceil(8);
            buffer.resize(len + 3, 0);
            buffer[0] = LAYOUT_PACKED;
            buffer[1..17].copy_from_slice(&parent.0.to_le_bytes());
            buffer[17..19].copy_from_slice(&count.to_le_bytes());
            let (mut bits, mut held, mut at) = (0u64, 0u32, 19);
            for &token in block.tokens {
                bits |= u64::from(token) << held;
                held += PACKED_BITS;
                if held >= 32 {
                    buffer[at..at + 4].copy_from_slice(&(bits as u32).to_le_bytes());
                    (bits, held, at) = (bits >> 32, held - 32, at + 4);
                }
            }
            if held > 0 {
                buffer[at..at + 4].copy_from_slice(&(bits as u32).to_le_bytes());
            }
            buffer.truncate(len);
            return;
        }
    }
    buffer.resize(21 + 4 * block.tokens.len(), 0);
    buffer[0] = LAYOUT_WIDE;
    buffer[1..17].copy_from_slice(&parent.0.to_le_bytes());
    buffer[17..21].copy_from_slice(&(block.tokens.len() as u32).to_le_bytes());
    for (bytes, token) in buffer[21..].chunks_exact_mut(4).zip(block.tokens) {
        bytes.copy_from_slice(&token.to_le_bytes());
    }
    if let Some(lora_id) = extra.lora_id {
        buffer.push(TAG_LORA);
        buffer.extend_from_slice(&lora_id.to_le_bytes());
    }
    if let (0, Some(salt)) = (block.index, &extra.cache_salt) {
        buffer.push(TAG_SALT);
        buffer.extend_from_slice(&(salt.len() as u64).to_le_bytes());
        buffer.extend_from_slice(salt.as_bytes());
    }
    for item in extra.mm_items.iter().filter(|item| overlaps(item)) {
        buffer.push(TAG_MULTIMODAL);
        buffer.extend_from_slice(&item.item_hash.to_le_bytes());
    }
}

/// One full block of a request: its index, first token position and tokens.
struct BlockSpan<'a> {
    index: usize,
    start: usize,
    tokens: &'a [u32],
}

fn digest(algo: HashAlgo, bytes: &[u8]) -> BlockHash {
    match algo {
        HashAlgo::Xxh3 => BlockHash(xxhash_rust::xxh3::xxh3_128(bytes)),
        HashAlgo::Sha256 => BlockHash(sha256_first_128(bytes)),
    }
}

/// The first 16 bytes of `sha256(bytes)`, read little-endian. The message is padded here and fed
/// straight to the compression function: a packed block (55 bytes) is one compression with no
/// streaming buffer around it.
fn sha256_first_128(bytes: &[u8]) -> u128 {
    let mut state = sha256_packed::SHA256_INIT;
    let whole = bytes.len() / 64 * 64;
    compress(&mut state, &bytes[..whole]);
    // Padding: 0x80, zeros, then the message length in bits (big-endian u64) at the end of the
    // last 64-byte block; one block if the rest and the 9 padding bytes fit, else two.
    let rest = &bytes[whole..];
    let mut tail = [0u8; 128];
    tail[..rest.len()].copy_from_slice(rest);
    tail[rest.len()] = 0x80;
    let tail_len = if rest.len() + 9 <= 64 { 64 } else { 128 };
    let bits = (bytes.len() as u64).wrapping_mul(8);
    tail[tail_len - 8..tail_len].copy_from_slice(&bits.to_be_bytes());
    compress(&mut state, &tail[..tail_len]);
    sha256_packed::first_128(&state)
}

/// Runs sha256's compression function over `blocks` (a whole number of 64-byte blocks).
fn compress(state: &mut [u32; 8], blocks: &[u8]) {
    for block in blocks.chunks_exact(64) {
        sha2::compress256(
            state,
            core::slice::from_ref(GenericArray::from_slice(block)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(hasher: &BlockHasher, tokens: &[u32], extra: &ExtraKeys) -> Vec<BlockHash> {
        let mut hashes = Vec::new();
        hasher.extend_chain(tokens, 2, extra, &mut hashes);
        hashes
    }

    const TOKENS: [u32; 7] = [1, 2, 3, 4, 5, 6, 7];

    #[test]
    fn direct_sha256_equals_the_streaming_digest_at_every_length() {
        use sha2::Digest;
        // Every padding case: one block, the 55/56-byte edge where the length spills into a
        // second block, whole blocks, and several blocks before the tail.
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 151 + 7) as u8).collect();
        for len in 0..=bytes.len() {
            let full = sha2::Sha256::digest(&bytes[..len]);
            let expected = u128::from_le_bytes(full[..16].try_into().unwrap());
            assert_eq!(sha256_first_128(&bytes[..len]), expected, "length {len}");
        }
        // A published vector: sha256("abc") = ba7816bf 8f01cfea 414140de 5dae2223 ...
        let abc = sha256_first_128(b"abc").to_le_bytes();
        assert_eq!(abc[..8], [0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea]);
    }

    #[test]
    fn hashes_full_blocks_only_and_deterministically() {
        let hasher = BlockHasher::new(HashAlgo::Xxh3, 0);
        let first = chain(&hasher, &TOKENS, &ExtraKeys::default());
        assert_eq!(first.len(), 3, "7 tokens make 3 full blocks of 2");
        let again = chain(
            &BlockHasher::new(HashAlgo::Xxh3, 0),
            &TOKENS,
            &ExtraKeys::default(),
        );
        assert_eq!(first, again);
        let other_seed = chain(
            &BlockHasher::new(HashAlgo::Xxh3, 1),
            &TOKENS,
            &ExtraKeys::default(),
        );
        assert!(first.iter().zip(&other_seed).all(|(a, b)| a != b));
    }

    #[test]
    fn extending_in_steps_equals_hashing_at_once() {
        let hasher = BlockHasher::new(HashAlgo::Xxh3, 3);
        let mut hashes = Vec::new();
        hasher.extend_chain(&TOKENS[..3], 2, &ExtraKeys::default(), &mut hashes);
        assert_eq!(hashes.len(), 1);
        hasher.extend_chain(&TOKENS, 2, &ExtraKeys::default(), &mut hashes);
        assert_eq!(hashes, chain(&hasher, &TOKENS, &ExtraKeys::default()));
    }

    #[test]
    fn a_change_in_one_block_changes_it_and_every_later_block() {
        let hasher = BlockHasher::new(HashAlgo::Xxh3, 0);
        let base = chain(&hasher, &TOKENS, &ExtraKeys::default());
        let mut changed_tokens = TOKENS;
        changed_tokens[2] = 99;
        let changed = chain(&hasher, &changed_tokens, &ExtraKeys::default());
        assert_eq!(base[0], changed[0]);
        assert_ne!(base[1], changed[1]);
        assert_ne!(base[2], changed[2], "the chain carries the change forward");
    }

    #[test]
    fn salt_enters_block_zero_only() {
        let hasher = BlockHasher::new(HashAlgo::Xxh3, 0);
        let salted = ExtraKeys {
            cache_salt: Some("tenant-a".into()),
            ..ExtraKeys::default()
        };
        let base = chain(&hasher, &TOKENS, &ExtraKeys::default());
        let with_salt = chain(&hasher, &TOKENS, &salted);
        assert_ne!(base[0], with_salt[0]);
        // Block 1 differs only through its parent: rehashing block 1 with block 0's unsalted
        // parent but the salted keys gives the unsalted hash back.
        let mut from_block_one = vec![base[0]];
        hasher.extend_chain(&TOKENS, 2, &salted, &mut from_block_one);
        assert_eq!(from_block_one[1], base[1]);
    }

    #[test]
    fn lora_enters_every_block() {
        let hasher = BlockHasher::new(HashAlgo::Xxh3, 0);
        let lora = ExtraKeys {
            lora_id: Some(7),
            ..ExtraKeys::default()
        };
        let base = chain(&hasher, &TOKENS, &ExtraKeys::default());
        let mut from_block_one = vec![base[0]];
        hasher.extend_chain(&TOKENS, 2, &lora, &mut from_block_one);
        assert_ne!(from_block_one[1], base[1]);
        assert_ne!(from_block_one[2], base[2]);
    }

    #[test]
    fn multimodal_hash_enters_only_the_blocks_it_overlaps() {
        let hasher = BlockHasher::new(HashAlgo::Xxh3, 0);
        // Tokens 3..5 overlap blocks 1 (tokens 2-3) and 2 (tokens 4-5), not block 0.
        let image = ExtraKeys {
            mm_items: vec![MultimodalItem {
                start_token: 3,
                num_tokens: 2,
                item_hash: 0xabc,
            }],
            ..ExtraKeys::default()
        };
        let base = chain(&hasher, &TOKENS, &ExtraKeys::default());
        let with_image = chain(&hasher, &TOKENS, &image);
        assert_eq!(base[0], with_image[0]);
        // Rehash each block from the plain parent so only its own keys can differ.
        for index in 1..3 {
            let mut from_parent = base[..index].to_vec();
            hasher.extend_chain(&TOKENS[..2 * (index + 1)], 2, &image, &mut from_parent);
            assert_ne!(
                from_parent[index], base[index],
                "block {index} overlaps the item"
            );
        }
        let mut block_three = base.clone();
        let long: Vec<u32> = (1..=8).collect();
        hasher.extend_chain(&long, 2, &image, &mut block_three);
        let mut plain_three = base.clone();
        hasher.extend_chain(&long, 2, &ExtraKeys::default(), &mut plain_three);
        assert_eq!(
            block_three[3], plain_three[3],
            "block 3 does not overlap the item"
        );
    }

    #[test]
    fn xxh3_and_sha256_differ() {
        let xxh3 = chain(
            &BlockHasher::new(HashAlgo::Xxh3, 0),
            &TOKENS,
            &ExtraKeys::default(),
        );
        let sha = chain(
            &BlockHasher::new(HashAlgo::Sha256, 0),
            &TOKENS,
            &ExtraKeys::default(),
        );
        assert_eq!(sha.len(), 3);
        assert!(xxh3.iter().zip(&sha).all(|(a, b)| a != b));
    }

    #[test]
    fn sixteen_token_chains_under_sha256_equal_hashing_each_block_on_its_own() {
        // Blocks of 16 take the one-compression chain; it must give what `hash_block` (the
        // layout encoder, then the digest) gives block by block, across wide blocks, the salt
        // on block 0 and chains extended in steps.
        let mut rng = crate::test_rng::XorShift(2024);
        let hasher = BlockHasher::new(HashAlgo::Sha256, 11);
        let salted = ExtraKeys {
            cache_salt: Some("tenant".into()),
            ..ExtraKeys::default()
        };
        for extra in [ExtraKeys::default(), salted] {
            let mut tokens: Vec<u32> = (0..16 * 40).map(|_| (rng.next() % 32000) as u32).collect();
            for wide in [0, 5 * 16 + 3, 6 * 16, 39 * 16 + 15] {
                tokens[wide] = 1 << 20;
            }
            let mut expected = Vec::new();
            let mut buffer = Vec::new();
            for (index, block) in tokens.chunks(16).enumerate() {
                let parent = expected.last().copied().unwrap_or(hasher.root());
                let span = BlockSpan {
                    index,
                    start: index * 16,
                    tokens: block,
                };
                expected.push(hasher.hash_block(parent, &span, &extra, &mut buffer));
            }
            let mut whole = Vec::new();
            hasher.extend_chain(&tokens, 16, &extra, &mut whole);
            assert_eq!(whole, expected);
            let mut steps = Vec::new();
            for end in [1, 17, 100, 101, 300, 640] {
                hasher.extend_chain(&tokens[..end], 16, &extra, &mut steps);
                assert_eq!(steps[..], expected[..end / 16]);
            }
        }
    }

    fn encoded(tokens: &[u32], index: usize, extra: &ExtraKeys, packed: bool) -> Vec<u8> {
        let mut buffer = Vec::new();
        let block = BlockSpan {
            index,
            start: index * tokens.len(),
            tokens,
        };
        encode_block(
            BlockHash(0xabcd << 64 | 7),
            &block,
            extra,
            packed,
            &mut buffer,
        );
        buffer
    }

    /// The packed layout's tokens back from its bytes (the test's own decoder).
    fn unpack(bytes: &[u8]) -> (u128, Vec<u32>) {
        assert_eq!(bytes[0], LAYOUT_PACKED);
        let parent = u128::from_le_bytes(bytes[1..17].try_into().unwrap());
        let count = u16::from_le_bytes([bytes[17], bytes[18]]) as usize;
        let body = &bytes[19..];
        assert_eq!(
            body.len(),
            (count * 18).div_ceil(8),
            "no byte more than needed"
        );
        let bit = |at: usize| (body[at / 8] >> (at % 8)) & 1;
        let tokens = (0..count)
            .map(|i| (0..18).map(|b| u32::from(bit(i * 18 + b)) << b).sum())
            .collect();
        let padding = (count * 18..body.len() * 8).all(|at| bit(at) == 0);
        assert!(padding, "the last byte is zero-padded");
        (parent, tokens)
    }

    #[test]
    fn sha256_packs_plain_blocks_into_one_compression_and_they_decode_back() {
        let tokens: Vec<u32> = (0..16).map(|i| (1 << 18) - 1 - i * 4099).collect();
        let bytes = encoded(&tokens, 3, &ExtraKeys::default(), true);
        assert_eq!(
            bytes.len(),
            55,
            "one sha256 block holds 55 bytes of message"
        );
        assert_eq!(unpack(&bytes), (0xabcd << 64 | 7, tokens.clone()));
        // Not packed: xxh3, a token id of 2^18, an adapter, the salt on block 0, an image.
        assert_eq!(
            encoded(&tokens, 3, &ExtraKeys::default(), false)[0],
            LAYOUT_WIDE
        );
        let mut large = tokens.clone();
        large[5] = 1 << 18;
        assert_eq!(
            encoded(&large, 3, &ExtraKeys::default(), true)[0],
            LAYOUT_WIDE
        );
        let lora = ExtraKeys {
            lora_id: Some(1),
            ..ExtraKeys::default()
        };
        assert_eq!(encoded(&tokens, 3, &lora, true)[0], LAYOUT_WIDE);
        let salt = ExtraKeys {
            cache_salt: Some("t".into()),
            ..ExtraKeys::default()
        };
        assert_eq!(encoded(&tokens, 0, &salt, true)[0], LAYOUT_WIDE);
        assert_eq!(encoded(&tokens, 1, &salt, true)[0], LAYOUT_PACKED);
        let image = |start_token| ExtraKeys {
            mm_items: vec![MultimodalItem {
                start_token,
                num_tokens: 4,
                item_hash: 9,
            }],
            ..ExtraKeys::default()
        };
        assert_eq!(encoded(&tokens, 3, &image(50), true)[0], LAYOUT_WIDE);
        assert_eq!(encoded(&tokens, 3, &image(100), true)[0], LAYOUT_PACKED);
    }

    #[test]
    fn no_two_blocks_serialise_alike_across_layouts() {
        let mut rng = crate::test_rng::XorShift(99u64);
        let mut next = || rng.next();
        let mut seen = std::collections::HashMap::new();
        for _ in 0..20_000 {
            let count = 1 + (next() % 6) as usize;
            // Mostly small ids (packed), sometimes one too large (wide), from few values so that
            // equal inputs recur.
            let tokens: Vec<u32> = (0..count)
                .map(|_| match next() % 8 {
                    0 => 1 << 18,
                    other => (other * 37_000) as u32,
                })
                .collect();
            let bytes = encoded(&tokens, 2, &ExtraKeys::default(), true);
            if let Some(earlier) = seen.insert(bytes, tokens.clone()) {
                assert_eq!(earlier, tokens, "two blocks serialise alike");
            }
        }
        assert!(seen.keys().any(|bytes| bytes[0] == LAYOUT_WIDE));
        assert!(seen.keys().any(|bytes| bytes[0] == LAYOUT_PACKED));
    }

    #[test]
    fn multimodal_ranges_are_validated() {
        let item = |start_token, num_tokens| ExtraKeys {
            mm_items: vec![MultimodalItem {
                start_token,
                num_tokens,
                item_hash: 1,
            }],
            ..ExtraKeys::default()
        };
        assert!(item(0, 4).validate(4).is_ok());
        assert!(item(0, 0).validate(4).is_err());
        assert!(item(3, 2).validate(4).is_err());
        assert!(item(usize::MAX, 2).validate(4).is_err());
    }
}
