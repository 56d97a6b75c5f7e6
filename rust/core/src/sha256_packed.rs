//! sha256 chains of packed 16-token blocks, the common case of sha256 block hashing.
//!
//! A packed block (see `hashing`) of 16 tokens is 55 bytes: `1 | parent (16 LE) | 16 (2 LE) |
//! 16 tokens of 18 bits`, which with sha256's padding (0x80, then the length in bits as a
//! big-endian u64) fills exactly one 64-byte block. Read as eight little-endian u64 words, the
//! block is
//!
//! ```text
//!   bytes 0..16   tag, parent bytes 0..15
//!   bytes 16..19  parent byte 15, token count 16 (LE u16)
//!   bits 152..440 token k at bit 152 + 18 k
//!   byte 55       0x80; bytes 56..64: 440 (the message length in bits), big-endian
//! ```
//!
//! Only the first 17 bytes depend on the parent. The tokens' part is built once per block in
//! registers; on x86-64 with the SHA extensions the whole chain runs in one function whose
//! state never leaves the vector registers: block `i`'s digest becomes block `i + 1`'s first
//! message words by two byte shuffles, where the generic path stored the parent a few bytes at a
//! time and read it back as 16-byte words (each such read waits for its stores to reach the
//! cache, on the chain's critical path). Elsewhere each block goes through `sha2`'s compression.

use sha2::digest::generic_array::GenericArray;

use crate::types::BlockHash;

/// Tokens in the block this module hashes.
pub(crate) const TOKENS: usize = 16;
/// Bits per token id.
const BITS: usize = 18;
/// The message length: 19 header bytes and 16 x 18 bits.
const MESSAGE_BYTES: usize = 19 + TOKENS * BITS / 8;
const _: () = assert!(
    MESSAGE_BYTES == 55,
    "one compression holds the block and its padding"
);

/// sha256's initial state (FIPS 180-4, 5.3.3).
pub(crate) const SHA256_INIT: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// Words 2..8 of a block's message (bytes 16..64), parent byte 15 left zero: the part that
/// depends on the tokens only. `None` when a token id does not fit in 18 bits.
#[inline(always)]
fn token_words(tokens: &[u32; TOKENS]) -> Option<[u64; 6]> {
    if tokens.iter().fold(0, |wide, &token| wide | token) >> BITS != 0 {
        return None;
    }
    let mut words = [0u64; 6];
    words[0] = (TOKENS as u64) << 8;
    // Token k starts at bit 24 + 18 k of these words (bit 152 of the message); unrolled so
    // every index and shift is a constant.
    macro_rules! place {
        ($($k:literal)*) => {$(
            let at = 24 + BITS * $k;
            let (word, shift) = (at / 64, at % 64);
            let token = u64::from(tokens[$k]);
            words[word] |= token << shift;
            if shift + BITS > 64 {
                words[word + 1] |= token >> (64 - shift);
            }
        )*};
    }
    place!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    words[4] |= 0x80 << (8 * (MESSAGE_BYTES - 48));
    words[5] = (8 * MESSAGE_BYTES as u64).swap_bytes();
    Some(words)
}

/// The digest's first 16 bytes (its words are big-endian) read as a little-endian u128.
#[inline]
pub(crate) fn first_128(state: &[u32; 8]) -> u128 {
    state[..4].iter().enumerate().fold(0, |value, (i, word)| {
        value | u128::from(word.swap_bytes()) << (32 * i)
    })
}

/// The hash of one packed block through `sha2`'s compression function.
fn hash_portable(tag: u8, parent: u128, words: &[u64; 6]) -> u128 {
    let mut block = [0u8; 64];
    block[0] = tag;
    block[1..17].copy_from_slice(&parent.to_le_bytes());
    for (bytes, word) in block[16..].chunks_exact_mut(8).zip(words) {
        let old = bytes[0];
        bytes.copy_from_slice(&word.to_le_bytes());
        bytes[0] |= old;
    }
    let mut state = SHA256_INIT;
    sha2::compress256(
        &mut state,
        core::slice::from_ref(GenericArray::from_slice(&block)),
    );
    first_128(&state)
}

/// Extends `hashes` (whose last entry, or `root` when empty, is the parent) with the hashes of
/// the 16-token blocks of `tokens` (a whole number of them), each packed with first byte `tag`.
/// Stops before the first block with a token id of 18 bits or more and returns how many blocks
/// it hashed; the caller hashes that one another way.
pub(crate) fn extend(tag: u8, root: u128, tokens: &[u32], hashes: &mut Vec<BlockHash>) -> usize {
    debug_assert_eq!(tokens.len() % TOKENS, 0);
    #[cfg(target_arch = "x86_64")]
    if shani::available() {
        // SAFETY: the CPU has the features `shani::extend` is compiled for.
        return unsafe { shani::extend(tag, root, tokens, hashes) };
    }
    extend_portable(tag, root, tokens, hashes)
}

/// `extend` through `sha2`'s compression function, one block at a time.
fn extend_portable(tag: u8, root: u128, tokens: &[u32], hashes: &mut Vec<BlockHash>) -> usize {
    let mut parent = hashes.last().map_or(root, |hash| hash.0);
    let mut done = 0;
    for block in tokens.chunks_exact(TOKENS) {
        let Some(words) = token_words(block.try_into().expect("16 tokens")) else {
            break;
        };
        parent = hash_portable(tag, parent, &words);
        hashes.push(BlockHash(parent));
        done += 1;
    }
    done
}

#[cfg(target_arch = "x86_64")]
mod shani {
    use core::arch::x86_64::*;

    use super::{token_words, SHA256_INIT, TOKENS};
    use crate::types::BlockHash;

    /// Whether this CPU has the SHA extensions and the SSE levels the chain uses.
    pub(super) fn available() -> bool {
        std::is_x86_feature_detected!("sha")
            && std::is_x86_feature_detected!("sse4.1")
            && std::is_x86_feature_detected!("ssse3")
    }

    /// sha256's round constants (FIPS 180-4, 4.2.2).
    const K: [u32; 64] = [
        0x428a_2f98,
        0x7137_4491,
        0xb5c0_fbcf,
        0xe9b5_dba5,
        0x3956_c25b,
        0x59f1_11f1,
        0x923f_82a4,
        0xab1c_5ed5,
        0xd807_aa98,
        0x1283_5b01,
        0x2431_85be,
        0x550c_7dc3,
        0x72be_5d74,
        0x80de_b1fe,
        0x9bdc_06a7,
        0xc19b_f174,
        0xe49b_69c1,
        0xefbe_4786,
        0x0fc1_9dc6,
        0x240c_a1cc,
        0x2de9_2c6f,
        0x4a74_84aa,
        0x5cb0_a9dc,
        0x76f9_88da,
        0x983e_5152,
        0xa831_c66d,
        0xb003_27c8,
        0xbf59_7fc7,
        0xc6e0_0bf3,
        0xd5a7_9147,
        0x06ca_6351,
        0x1429_2967,
        0x27b7_0a85,
        0x2e1b_2138,
        0x4d2c_6dfc,
        0x5338_0d13,
        0x650a_7354,
        0x766a_0abb,
        0x81c2_c92e,
        0x9272_2c85,
        0xa2bf_e8a1,
        0xa81a_664b,
        0xc24b_8b70,
        0xc76c_51a3,
        0xd192_e819,
        0xd699_0624,
        0xf40e_3585,
        0x106a_a070,
        0x19a4_c116,
        0x1e37_6c08,
        0x2748_774c,
        0x34b0_bcb5,
        0x391c_0cb3,
        0x4ed8_aa4a,
        0x5b9c_ca4f,
        0x682e_6ff3,
        0x748f_82ee,
        0x78a5_636f,
        0x84c8_7814,
        0x8cc7_0208,
        0x90be_fffa,
        0xa450_6ceb,
        0xbef9_a3f7,
        0xc671_78f2,
    ];

    /// Reverses the bytes of each 32-bit lane (message words and digest words are big-endian).
    #[inline(always)]
    unsafe fn bswap_mask() -> __m128i {
        _mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3)
    }

    /// Two 64-bit words as one vector, `low` in the low half.
    #[inline(always)]
    unsafe fn pair(low: u64, high: u64) -> __m128i {
        _mm_set_epi64x(high as i64, low as i64)
    }

    /// sha256 of one 64-byte block from the initial state, message words `w` (four per vector,
    /// the first word in lane 0); returns the digest's first 16 bytes as a vector.
    #[inline(always)]
    unsafe fn compress(w: [__m128i; 4]) -> __m128i {
        // The state as the instructions want it: lanes (F, E, B, A) and (H, G, D, C).
        let [a, b, c, d, e, f, g, h] = SHA256_INIT.map(|word| word as i32);
        let abef_init = _mm_set_epi32(a, b, e, f);
        let cdgh_init = _mm_set_epi32(c, d, g, h);
        let (mut abef, mut cdgh) = (abef_init, cdgh_init);
        let mut w = w;
        macro_rules! rounds {
            ($($group:literal)*) => {$(
                if $group >= 4 {
                    // w[i..i+4] from w[i-16..i-12], w[i-12], w[i-7..i-3] and w[i-4..i].
                    let next = _mm_add_epi32(
                        _mm_sha256msg1_epu32(w[$group % 4], w[($group + 1) % 4]),
                        _mm_alignr_epi8(w[($group + 3) % 4], w[($group + 2) % 4], 4),
                    );
                    w[$group % 4] = _mm_sha256msg2_epu32(next, w[($group + 3) % 4]);
                }
                let k = _mm_loadu_si128(K.as_ptr().add(4 * $group).cast());
                let sum = _mm_add_epi32(w[$group % 4], k);
                cdgh = _mm_sha256rnds2_epu32(cdgh, abef, sum);
                abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(sum, 0x0e));
            )*};
        }
        rounds!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        abef = _mm_add_epi32(abef, abef_init);
        cdgh = _mm_add_epi32(cdgh, cdgh_init);
        // (A, B, C, D), each word's bytes reversed: the digest's first 16 bytes in order.
        let abcd = _mm_unpacklo_epi64(_mm_shuffle_epi32(abef, 0x1b), _mm_shuffle_epi32(cdgh, 0x1b));
        _mm_shuffle_epi8(abcd, bswap_mask())
    }

    /// `super::extend` on the SHA extensions.
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub(super) unsafe fn extend(
        tag: u8,
        root: u128,
        tokens: &[u32],
        hashes: &mut Vec<BlockHash>,
    ) -> usize {
        let bswap = bswap_mask();
        let parent_of = |hash: u128| _mm_loadu_si128((&hash as *const u128).cast());
        let mut parent = parent_of(hashes.last().map_or(root, |hash| hash.0));
        let tag = _mm_cvtsi32_si128(i32::from(tag));
        let mut done = 0;
        for block in tokens.chunks_exact(TOKENS) {
            let Some(words) = token_words(block.try_into().expect("16 tokens")) else {
                break;
            };
            // Bytes 0..16: tag, then parent bytes 0..15; bytes 16..32: parent byte 15, then
            // the tokens' words.
            let lane0 = _mm_or_si128(_mm_slli_si128(parent, 1), tag);
            let lane1 = _mm_or_si128(_mm_srli_si128(parent, 15), pair(words[0], words[1]));
            parent = compress([
                _mm_shuffle_epi8(lane0, bswap),
                _mm_shuffle_epi8(lane1, bswap),
                _mm_shuffle_epi8(pair(words[2], words[3]), bswap),
                _mm_shuffle_epi8(pair(words[4], words[5]), bswap),
            ]);
            let mut hash = 0u128;
            _mm_storeu_si128((&mut hash as *mut u128).cast(), parent);
            hashes.push(BlockHash(hash));
            done += 1;
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use sha2::Digest;

    use super::*;

    /// The block's bytes written out one field at a time, then sha256 by the streaming hasher:
    /// the reference both paths must match.
    fn reference(tag: u8, parent: u128, tokens: &[u32]) -> u128 {
        let mut bytes = vec![tag];
        bytes.extend_from_slice(&parent.to_le_bytes());
        bytes.extend_from_slice(&(tokens.len() as u16).to_le_bytes());
        let mut bits = vec![false; tokens.len() * BITS];
        for (k, token) in tokens.iter().enumerate() {
            for bit in 0..BITS {
                bits[k * BITS + bit] = token >> bit & 1 == 1;
            }
        }
        for byte in bits.chunks(8) {
            bytes.push(
                byte.iter()
                    .rev()
                    .fold(0, |value, &bit| value << 1 | u8::from(bit)),
            );
        }
        assert_eq!(bytes.len(), MESSAGE_BYTES);
        let digest = sha2::Sha256::digest(&bytes);
        u128::from_le_bytes(digest[..16].try_into().unwrap())
    }

    fn random_tokens(rng: &mut crate::test_rng::XorShift, blocks: usize) -> Vec<u32> {
        (0..blocks * TOKENS)
            .map(|_| match rng.next() % 4 {
                0 => (1 << BITS) - 1 - (rng.next() % 3) as u32,
                1 => (rng.next() % 3) as u32,
                _ => (rng.next() % (1 << BITS)) as u32,
            })
            .collect()
    }

    fn values(hashes: &[BlockHash]) -> Vec<u128> {
        hashes.iter().map(|hash| hash.0).collect()
    }

    fn reference_chain(tag: u8, parent: u128, tokens: &[u32]) -> Vec<u128> {
        let mut parent = parent;
        tokens
            .chunks(TOKENS)
            .map(|block| {
                parent = reference(tag, parent, block);
                parent
            })
            .collect()
    }

    #[test]
    fn a_chain_equals_the_streaming_digest_of_each_block() {
        let mut rng = crate::test_rng::XorShift(0x5eed);
        for round in 0..20 {
            let root = u128::from(rng.next()) << 64 | u128::from(rng.next());
            let tag = (round % 3) as u8;
            let tokens = random_tokens(&mut rng, 1 + round);
            let expected = reference_chain(tag, root, &tokens);
            let mut hashes = Vec::new();
            assert_eq!(extend(tag, root, &tokens, &mut hashes), 1 + round);
            assert_eq!(values(&hashes), expected, "round {round}");
            let mut portable = Vec::new();
            assert_eq!(
                extend_portable(tag, root, &tokens, &mut portable),
                1 + round
            );
            assert_eq!(portable, hashes);
            // Continued from a non-empty chain: the last hash is the parent, not the root.
            let more = random_tokens(&mut rng, 2);
            assert_eq!(extend(tag, 0, &more, &mut hashes), 2);
            let last = expected[expected.len() - 1];
            assert_eq!(
                values(&hashes[1 + round..]),
                reference_chain(tag, last, &more)
            );
        }
    }

    #[test]
    fn the_portable_path_equals_the_streaming_digest() {
        let mut rng = crate::test_rng::XorShift(77);
        for _ in 0..200 {
            let parent = u128::from(rng.next()) << 64 | u128::from(rng.next());
            let tokens = random_tokens(&mut rng, 1);
            let words = token_words(tokens[..].try_into().unwrap()).unwrap();
            assert_eq!(
                hash_portable(1, parent, &words),
                reference(1, parent, &tokens)
            );
        }
    }

    #[test]
    fn a_wide_token_stops_the_chain_before_its_block() {
        let mut rng = crate::test_rng::XorShift(3);
        let mut tokens = random_tokens(&mut rng, 4);
        tokens[2 * TOKENS + 7] = 1 << BITS;
        let mut hashes = Vec::new();
        assert_eq!(extend(1, 5, &tokens, &mut hashes), 2);
        assert_eq!(hashes.len(), 2);
        assert_eq!(
            values(&hashes),
            reference_chain(1, 5, &tokens[..2 * TOKENS])
        );
        assert_eq!(extend(1, 5, &tokens[2 * TOKENS..], &mut hashes), 0);
        assert_eq!(hashes.len(), 2, "nothing is pushed for the refused block");
    }
}
