//! HTTP/1 request framing as the smuggling guard ([`super`]) follows it: where a
//! head ends (found by `httparse`, the parser hyper uses), how long its body is
//! (`Content-Length`, or chunked framing walked byte by byte), and which heads it refuses
//! (the rules of [`crate::server::head`], which the inline server applies too).
//! It looks at bytes wherever they are, the guard's own buffer or hyper's, and owns none.

use crate::server::head::{self, BodyHeaders, HeadFault, MAX_HEADERS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Chunk {
    Size { n: u64, digits: bool },
    Ext { n: u64 },
    SizeLf { n: u64 },
    Data(u64),
    DataCr,
    DataLf,
    TrailerStart,
    TrailerLine,
    TrailerLineLf,
    TrailerEndLf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Waiting for (the rest of) a request head.
    Head,
    /// Inside a Content-Length body: bytes left.
    Body(u64),
    Chunked(Chunk),
    /// Not HTTP/1 framing we follow any more (h2 preface, upgrade, `CONNECT`): hands off.
    Passthrough,
    /// A head (or chunked framing) was refused: the guard feeds hyper the stand-in for it
    /// (`fed` bytes of it so far), and nothing after it.
    Refused {
        fed: usize,
    },
}

/// What the guard refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A request head: answered with this error, in order, and the connection closed.
    Head(HeadFault),
    /// Chunked framing in a request body that the guard cannot follow exactly (the
    /// request is in flight: hyper's body decoder fails it).
    Chunked,
}

/// Where in HTTP/1 framing the guard is, and what it decided: the part of the guard that
/// looks at bytes, wherever they are (its own buffer, or hyper's).
pub(super) struct Framing {
    pub(super) state: State,
    pub(super) max_head: usize,
    pub(super) refused: Option<Refusal>,
    /// A head was completed, refused or given up on: its read timer is no longer needed.
    pub(super) head_done: bool,
    /// How much of the head in progress was looked at.
    pub(super) head_scan: head::HeadScan,
    /// The head refused asked with `HEAD`: its stand-in does too, so that its answer has no
    /// body. Taken from the head's own bytes when it is refused, wherever they lie (in
    /// hyper's buffer when the guard reads straight into it).
    pub(super) refused_asks_head: bool,
    /// The hand-off was for a request that asked to switch protocols (`Upgrade`, `CONNECT`),
    /// not for HTTP/2: its connection still ends with a lingering close (after a refusal,
    /// or a tunnel's end), as a plain HTTP/1 one does.
    pub(super) upgrade_asked: bool,
}

impl Framing {
    pub(super) fn refuse(&mut self, why: Refusal) {
        tracing::debug!(reason = ?why, "request refused; the connection ends after it");
        self.head_scan = head::HeadScan::default();
        self.refused = Some(why);
        self.state = State::Refused { fed: 0 };
        self.head_done = true;
    }

    /// Refuses the head that starts `pending`.
    pub(super) fn refuse_head(&mut self, fault: HeadFault, pending: &[u8]) {
        self.refused_asks_head = head::asks_head(pending);
        self.refuse(Refusal::Head(fault));
    }

    /// Looks at `pending`, the bytes after the last released one. `Some(n)`: the first `n`
    /// may go to hyper (`n` may be 0 when only the state changed; the caller loops). `None`:
    /// nothing more can be decided without more input.
    pub(super) fn advance(&mut self, pending: &[u8]) -> Option<usize> {
        match self.state {
            State::Passthrough => (!pending.is_empty()).then_some(pending.len()),
            State::Refused { .. } => None,
            State::Body(left) => {
                let n = left.min(pending.len() as u64);
                self.state = if left == n {
                    State::Head
                } else {
                    State::Body(left - n)
                };
                (n > 0).then_some(n as usize)
            }
            State::Chunked(c) => self.advance_chunked(c, pending),
            State::Head => self.advance_head(pending),
        }
    }

    fn advance_head(&mut self, pending: &[u8]) -> Option<usize> {
        if pending.is_empty() || !self.head_scan.worth_parsing(pending, self.max_head) {
            return None;
        }
        // Left uninitialised: filling empty headers for every head cost more than parsing
        // it. httparse writes only the headers it parses (hyper does the same).
        let mut headers = [std::mem::MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
        let mut req = httparse::Request::new(&mut []);
        let len = match req.parse_with_uninit_headers(pending, &mut headers) {
            Ok(httparse::Status::Partial) if pending.len() <= self.max_head => return None,
            Ok(httparse::Status::Complete(len)) if len <= self.max_head => len,
            Ok(_) => {
                self.refuse_head(head::over_limit(pending, self.max_head), pending);
                return Some(0);
            }
            // Not a head hyper takes either: refused here, so that no difference between
            // the two parsers can ever let later bytes past unchecked.
            Err(e) => {
                self.refuse_head(head::parse_fault(e), pending);
                return Some(0);
            }
        };
        self.head_done = true;
        self.head_scan = head::HeadScan::default();
        let mut body = BodyHeaders::default();
        let mut upgrade = req.method == Some("CONNECT");
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                body.content_length(h.value);
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                body.transfer_encoding(h.value);
            } else if h.name.eq_ignore_ascii_case("upgrade") {
                // The pipeline closes the connection after any answer but 101 to such a
                // request, so no unchecked head can follow a refused upgrade.
                upgrade = true;
            }
        }
        // The target first, as hyper's server checks it first.
        let target = match req.path {
            Some(p) if http::Uri::try_from(p).is_err() => Err(head::target_fault(p.len())),
            _ => Ok(()),
        };
        // Then a name too long to carry (hyper's server would answer a bare 431).
        let checked = target
            .and_then(|()| head::long_name(len, req.headers))
            .and_then(|()| body.check(req.version == Some(0)));
        if let Err(f) = checked {
            self.refuse_head(f, pending);
            return Some(0);
        }
        self.upgrade_asked |= upgrade;
        self.state = if upgrade {
            State::Passthrough
        } else if body.te {
            // `check` let through only a Transfer-Encoding that ends in chunked.
            State::Chunked(Chunk::Size {
                n: 0,
                digits: false,
            })
        } else {
            match body.length {
                None | Some(0) => State::Head,
                Some(n) => State::Body(n),
            }
        };
        Some(len)
    }

    fn advance_chunked(&mut self, mut c: Chunk, pending: &[u8]) -> Option<usize> {
        let mut i = 0;
        while i < pending.len() {
            let b = pending[i];
            c = match c {
                Chunk::Data(left) => {
                    let n = left.min((pending.len() - i) as u64);
                    i += n as usize;
                    if left == n {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(left - n)
                    }
                }
                _ => {
                    i += 1;
                    match step_chunk(c, b) {
                        Some(Some(next)) => next,
                        Some(None) => {
                            self.state = State::Head;
                            return Some(i);
                        }
                        None => {
                            // Bytes before the bad framing are released; the rest is
                            // refused.
                            self.refuse(Refusal::Chunked);
                            return Some(i - 1);
                        }
                    }
                }
            };
        }
        self.state = State::Chunked(c);
        (i > 0).then_some(i)
    }
}

/// One byte of chunked framing (outside chunk data), CRLF line endings only: a bare LF is
/// where parsers disagree (hyper's decoder reads it differently in trailers), so it is
/// refused. `None`: malformed; `Some(None)`: the
/// message ended; `Some(Some(state))`: go on.
fn step_chunk(c: Chunk, b: u8) -> Option<Option<Chunk>> {
    let after_size = |n: u64| {
        if n == 0 {
            Chunk::TrailerStart
        } else {
            Chunk::Data(n)
        }
    };
    Some(Some(match c {
        Chunk::Size { n, digits } => match b {
            b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                let d = (b as char).to_digit(16)? as u64;
                Chunk::Size {
                    n: n.checked_mul(16)?.checked_add(d)?,
                    digits: true,
                }
            }
            b';' | b' ' | b'\t' if digits => Chunk::Ext { n },
            b'\r' if digits => Chunk::SizeLf { n },
            _ => return None,
        },
        Chunk::Ext { n } => match b {
            b'\r' => Chunk::SizeLf { n },
            b'\n' => return None,
            _ => Chunk::Ext { n },
        },
        Chunk::SizeLf { n } => match b {
            b'\n' => after_size(n),
            _ => return None,
        },
        Chunk::Data(_) => return None,
        Chunk::DataCr => match b {
            b'\r' => Chunk::DataLf,
            _ => return None,
        },
        Chunk::DataLf => match b {
            b'\n' => Chunk::Size {
                n: 0,
                digits: false,
            },
            _ => return None,
        },
        Chunk::TrailerStart => match b {
            b'\r' => Chunk::TrailerEndLf,
            b'\n' => return None,
            _ => Chunk::TrailerLine,
        },
        Chunk::TrailerLine => match b {
            b'\r' => Chunk::TrailerLineLf,
            b'\n' => return None,
            _ => Chunk::TrailerLine,
        },
        Chunk::TrailerLineLf => match b {
            b'\n' => Chunk::TrailerStart,
            _ => return None,
        },
        Chunk::TrailerEndLf => match b {
            b'\n' => return Some(None),
            _ => return None,
        },
    }))
}
