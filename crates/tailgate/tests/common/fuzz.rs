//! What the mutation tests share: a seedable generator, their settings from the
//! environment, and a count of panics anywhere in the process.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// splitmix64: a small, seedable generator, enough to pick mutations reproducibly.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// `name` from the environment, parsed, or `default`.
pub fn env_or<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Counts every panic in the process from now on (a task's panic otherwise only closes its
/// connection), keeping the default report.
pub fn count_panics() -> Arc<AtomicUsize> {
    let panics = Arc::new(AtomicUsize::new(0));
    let counted = panics.clone();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        counted.fetch_add(1, Ordering::SeqCst);
        default(info);
    }));
    panics
}

/// What a mutation may put in: single hostile bytes, and whole tokens (framing headers,
/// line ends, a request or response line).
pub struct Alphabet<'a> {
    pub bytes: &'a [u8],
    pub tokens: &'a [&'a [u8]],
    /// The longest span deleted; spans up to twice as long are duplicated.
    pub max_span: usize,
}

impl Alphabet<'_> {
    /// The byte-level mutations the tests share, by number, at `at`: 0 flips a bit, 1 sets a
    /// hostile byte, 2 inserts a token, 3 deletes a span, 4 duplicates one, 5 truncates.
    /// `false`: not one of these (or no byte at `at`); the caller applies its own.
    pub fn mutate(&self, rng: &mut Rng, b: &mut Vec<u8>, op: usize, at: usize) -> bool {
        match op {
            0 if at < b.len() => b[at] ^= 1 << rng.below(8),
            1 if at < b.len() => b[at] = *rng.pick(self.bytes),
            2 => {
                let t = rng.pick(self.tokens);
                b.splice(at..at, t.iter().copied());
            }
            3 if at < b.len() => {
                let end = (at + 1 + rng.below(self.max_span)).min(b.len());
                b.drain(at..end);
            }
            4 if at < b.len() => {
                let end = (at + 1 + rng.below(2 * self.max_span)).min(b.len());
                let span = b[at..end].to_vec();
                b.splice(at..at, span);
            }
            5 => b.truncate(at.max(1)),
            _ => return false,
        }
        true
    }

    /// Inserts a token right after the first line (a header where headers start).
    pub fn token_after_first_line(&self, rng: &mut Rng, b: &mut Vec<u8>) {
        let t = rng.pick(self.tokens);
        let line = after_first_line(b);
        b.splice(line..line, t.iter().copied());
    }
}

/// Where the second line starts (the end, when there is one line).
pub fn after_first_line(b: &[u8]) -> usize {
    b.windows(2)
        .position(|w| w == b"\r\n")
        .map_or(b.len(), |p| p + 2)
}
