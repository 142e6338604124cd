//! What makes an HTTP/1 request head unacceptable, decided once for both HTTP/1 servers: the
//! inline one ([`super::h1_inline`]) and the smuggling guard in front of hyper's
//! ([`super::h1_guard`]). The rules are hyper's server's (RFC 9112 §6.1, §6.3), plus the
//! one hyper leaves out: `Content-Length` together with
//! `Transfer-Encoding` is refused, as nginx and HAProxy refuse it. Both servers answer a
//! refused head with the gateway's JSON error and close the connection.

use crate::pipeline::error::ProxyError;

/// As many header lines as hyper's server accepts (more: hyper answers 431).
pub const MAX_HEADERS: usize = 100;
/// The longest request target hyper's server (and `http::Uri`) takes; longer: 414.
pub const MAX_URI_LEN: usize = u16::MAX as usize - 1;

/// Why a head is refused: the status and the message of the JSON error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadFault {
    /// 400.
    Bad(&'static str),
    /// 431.
    TooLarge(&'static str),
    /// 414: a target over [`MAX_URI_LEN`], or a request line over the head limit.
    UriTooLong(&'static str),
    /// 501: a transfer coding the gateway does not decode, before a final `chunked`.
    NotImplemented(&'static str),
}

impl From<HeadFault> for ProxyError {
    fn from(f: HeadFault) -> ProxyError {
        match f {
            HeadFault::Bad(m) => ProxyError::BadRequest(m),
            HeadFault::TooLarge(m) => ProxyError::HeadTooLarge(m),
            HeadFault::UriTooLong(m) => ProxyError::UriTooLong(m),
            HeadFault::NotImplemented(m) => ProxyError::NotImplemented(m),
        }
    }
}

/// When the start of a request head, read in pieces, is worth parsing again. `httparse`
/// starts from the first byte each time, so parsing after every read made a head that
/// comes in many small pieces cost its length squared: a 16 KiB head sent a byte at a time
/// was 16,384 parses over 134 MB. (Measured: a 61 KB head sent in 1-byte writes cost the
/// worker 3.65 s of CPU before, 3.15 s after; the rest is the reads themselves, as many
/// as the client makes.) A head is parsed when the first byte of its request line comes
/// (a request that is not HTTP at all is refused at once; the empty lines `httparse`
/// skips before a request line are not worth a parse), then again only once a line of it
/// has ended since the last look (where a parse can newly succeed or fail), or when it is
/// over the head limit (refused). The parses of one head are then at most its lines and
/// one, which [`MAX_HEADERS`] bounds. A head whose last bytes were not parsed is looked
/// at once more ([`force`](Self::force)) before it is given up on at the end of the
/// stream or the header timeout, so a head already wrong gets its refusal rather than a
/// silent close. nginx parses heads incrementally for the same reason.
#[derive(Debug, Default)]
pub struct HeadScan {
    /// Bytes at the start of the head already looked at.
    scanned: usize,
    /// A byte other than CR and LF came: the request line has begun.
    started: bool,
    /// The next look parses, whatever came.
    forced: bool,
}

impl HeadScan {
    /// Should `head` (the bytes from the head's first one on, as many as have come) be
    /// parsed now? Counts them as looked at.
    pub fn worth_parsing(&mut self, head: &[u8], max_head: usize) -> bool {
        let new = &head[self.scanned.min(head.len())..];
        self.scanned = head.len();
        if std::mem::take(&mut self.forced) || head.len() > max_head {
            return true;
        }
        if !self.started {
            // Anything but an empty line: a byte other than CR and LF (a usual request's
            // first byte, so this stops there), or a CR not followed by LF (refused at
            // once, as before).
            let from = head.len() - new.len();
            self.started = new.iter().any(|&b| b != b'\r' && b != b'\n')
                || head[from.saturating_sub(1)..]
                    .windows(2)
                    .any(|w| w[0] == b'\r' && w[1] != b'\n');
            return self.started;
        }
        new.contains(&b'\n')
    }

    /// Has the request line begun (a byte other than CR and LF among those looked at)?
    /// Empty lines before it are ignored (RFC 9112 §2.2): they start no head timer and
    /// leave the connection idle.
    pub fn started(&self) -> bool {
        self.started
    }

    /// Makes the next look parse: the head is about to be given up on.
    pub fn force(&mut self) {
        self.forced = true;
    }
}

/// A target longer than [`MAX_URI_LEN`].
pub const TARGET_TOO_LONG: HeadFault =
    HeadFault::UriTooLong("request target longer than 65534 bytes");

/// A head over `max_header_bytes`, whole or not: hyper's server never holds more than the
/// limit of a head, and answers 431.
pub const OVER_LIMIT: HeadFault = HeadFault::TooLarge("larger than max_header_bytes");

/// What is wrong with a head (`head`, as much of it as came) over `max_head` bytes: its
/// request line alone is, when that line has not ended within the limit (414, RFC 9112 §3:
/// a target longer than the server will parse), else its header lines are (431). Empty
/// lines before the request line are not counted in it; a head of nothing but empty lines
/// is over the limit all the same (431).
pub fn over_limit(head: &[u8], max_head: usize) -> HeadFault {
    let line = after_empty_lines(head);
    let seen = &line[..line.len().min(max_head)];
    if seen.is_empty() || seen.contains(&b'\n') {
        OVER_LIMIT
    } else {
        HeadFault::UriTooLong("request line longer than max_header_bytes")
    }
}

/// Does the head (`head`, as much of it as came, empty lines before its request line
/// skipped) ask with `HEAD`? Its refusal then has no body, as any answer to a HEAD has none
/// (RFC 9110 §9.3.2): the method is the request line's first word, whatever is wrong
/// further on (nginx answers such a head's 400 without a body, too).
pub fn asks_head(head: &[u8]) -> bool {
    after_empty_lines(head).starts_with(b"HEAD ")
}

/// `head` from its request line on: the empty lines a client may send before it (RFC 9112
/// §2.2) skipped.
fn after_empty_lines(head: &[u8]) -> &[u8] {
    let start = head
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(head.len());
    &head[start..]
}

/// What is wrong with a head `httparse` refused. No more bytes can mend it.
pub fn parse_fault(e: httparse::Error) -> HeadFault {
    HeadFault::Bad(match e {
        httparse::Error::TooManyHeaders => {
            return HeadFault::TooLarge("more than 100 header lines");
        }
        httparse::Error::HeaderName => "invalid header name",
        httparse::Error::HeaderValue => "invalid header value",
        httparse::Error::NewLine => "invalid line ending",
        httparse::Error::Token => "invalid method or request target",
        httparse::Error::Version => "invalid HTTP version",
        httparse::Error::Status => "invalid request head",
    })
}

/// What is wrong with a request target `http::Uri` refuses (hyper's server parses it the
/// same way: 400, or 414 over [`MAX_URI_LEN`]).
pub fn target_fault(target_len: usize) -> HeadFault {
    if target_len > MAX_URI_LEN {
        TARGET_TOO_LONG
    } else {
        HeadFault::Bad("invalid request target")
    }
}

/// The longest header name `http` takes; httparse reads longer ones, which hyper's server
/// answers with a bare `431` (no JSON body).
const MAX_NAME_LEN: usize = u16::MAX as usize;

/// A header name longer than [`MAX_NAME_LEN`] (possible only with `max_header_bytes` over
/// 64 KiB).
const NAME_TOO_LONG: HeadFault = HeadFault::TooLarge("header name longer than 65535 bytes");

/// Does a parsed head of `head_len` bytes hold a header name too long to carry? Looked for
/// only in a head long enough to hold one: no cost per header of every request. Both
/// HTTP/1 servers check it after the target's length and before the body headers, as
/// hyper's server orders its checks.
pub fn long_name(head_len: usize, headers: &[httparse::Header<'_>]) -> Result<(), HeadFault> {
    if head_len > MAX_NAME_LEN && headers.iter().any(|h| h.name.len() > MAX_NAME_LEN) {
        Err(NAME_TOO_LONG)
    } else {
        Ok(())
    }
}

/// The body framing a head declares, gathered header by header as the caller walks the
/// head's lines (the inline server walks them once, for everything it needs).
#[derive(Debug, Clone, Copy)]
pub struct BodyHeaders {
    /// The body length as hyper's server reads it: one value of digits, or the same value
    /// in several `Content-Length` lines (a list in one line, `5, 5`, is refused).
    pub length: Option<u64>,
    /// One `Content-Length`, digits only (or none): the shape the inline server serves.
    pub plain: bool,
    bad_length: bool,
    /// A `Transfer-Encoding` came; `chunked`: it is `chunked` alone.
    pub te: bool,
    pub chunked: bool,
    /// Over every `Transfer-Encoding` line: the last coding is `chunked`, how many times
    /// `chunked` came, another coding came, and one is not a token.
    te_last_chunked: bool,
    te_chunked: u8,
    te_other: bool,
    te_bad: bool,
}

impl Default for BodyHeaders {
    fn default() -> Self {
        BodyHeaders {
            length: None,
            plain: true,
            bad_length: false,
            te: false,
            chunked: false,
            te_last_chunked: false,
            te_chunked: 0,
            te_other: false,
            te_bad: false,
        }
    }
}

impl BodyHeaders {
    /// A `Content-Length` line.
    #[inline]
    pub fn content_length(&mut self, v: &[u8]) {
        let n = content_length(v);
        self.plain &= self.length.is_none() && n.is_some();
        match n {
            Some(n) if self.length.is_none_or(|l| l == n) => self.length = Some(n),
            _ => self.bad_length = true,
        }
    }

    /// A `Transfer-Encoding` line. Only `chunked` alone is served: the gateway decodes no
    /// other coding, and removes the header upstream (it is hop-by-hop), so `gzip, chunked`
    /// would reach the upstream as a plain body of gzip bytes, and `chunked, chunked` as a
    /// body still chunked (RFC 9112 §6.1: a sender must not chunk twice; nginx refuses both).
    /// A second line makes a list too.
    #[inline]
    pub fn transfer_encoding(&mut self, v: &[u8]) {
        self.chunked = !self.te && v.trim_ascii().eq_ignore_ascii_case(b"chunked");
        self.te = true;
        // What the refusal says: the list's shape, over every line.
        for coding in v.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
            if coding.is_empty() {
                continue;
            }
            // A coding's name (parameters after `;` are a coding's too).
            let name = coding
                .split(|&b| b == b';')
                .next()
                .unwrap_or_default()
                .trim_ascii();
            if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
                self.te_bad = true;
            } else if name.eq_ignore_ascii_case(b"chunked") {
                self.te_chunked = self.te_chunked.saturating_add(1);
                self.te_last_chunked = true;
                continue;
            } else {
                self.te_other = true;
            }
            self.te_last_chunked = false;
        }
    }

    /// The framing's verdict, once every line was seen.
    pub fn check(&self, http10: bool) -> Result<(), HeadFault> {
        if self.te && (self.length.is_some() || self.bad_length) {
            // The smuggling shape.
            return Err(HeadFault::Bad(
                "Content-Length together with Transfer-Encoding",
            ));
        }
        if self.bad_length {
            return Err(HeadFault::Bad("invalid or conflicting Content-Length"));
        }
        if self.te && http10 {
            return Err(HeadFault::Bad("Transfer-Encoding in an HTTP/1.0 request"));
        }
        if self.te && !self.chunked {
            // A coding the gateway does not decode before a final `chunked` is well framed
            // but not served: 501 (RFC 9112 §6.1, as nginx answers it). Anything else cannot
            // be framed: 400 (`chunked` not last, or twice, or not a coding at all).
            if self.te_last_chunked && self.te_chunked == 1 && self.te_other && !self.te_bad {
                return Err(HeadFault::NotImplemented(
                    "transfer codings other than chunked are not decoded",
                ));
            }
            return Err(HeadFault::Bad(
                "a Transfer-Encoding other than chunked alone",
            ));
        }
        Ok(())
    }
}

/// A `tchar` of RFC 9110 §5.6.2 (the characters of a token).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A `Content-Length` value: digits only, and below the two values hyper reserves for its
/// own use (`u64::MAX - 1` and up).
pub fn content_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.iter()
        .try_fold(0u64, |n, &b| {
            if b.is_ascii_digit() {
                n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
            } else {
                None
            }
        })
        .filter(|&n| n <= u64::MAX - 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many times a head dripped `step` bytes at a time is found worth parsing.
    fn parses(head: &[u8], step: usize, max_head: usize) -> usize {
        let mut scan = HeadScan::default();
        (1..=head.len().div_ceil(step))
            .filter(|i| scan.worth_parsing(&head[..(i * step).min(head.len())], max_head))
            .count()
    }

    /// Empty lines alone past the limit are over it, however many there are.
    #[test]
    fn a_head_of_empty_lines_is_over_the_limit() {
        for n in [100, 101, 5000] {
            assert_eq!(over_limit(&b"\r\n".repeat(n), 100), OVER_LIMIT);
            assert_eq!(over_limit(&b"\n".repeat(n), 100), OVER_LIMIT);
        }
        // Not counted before a request line.
        let head = [b"\r\n".repeat(80), b"GET /".to_vec(), vec![b'a'; 150]].concat();
        assert!(matches!(over_limit(&head, 100), HeadFault::UriTooLong(_)));
    }

    #[test]
    fn a_dripped_head_is_parsed_once_per_line() {
        let mut head = b"GET /path HTTP/1.1\r\nHost: example\r\n".to_vec();
        for i in 0..40 {
            head.extend_from_slice(format!("x-filler-{i}: {}\r\n", "v".repeat(300)).as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        let lines = head.iter().filter(|&&b| b == b'\n').count();
        // A byte at a time (13 KB): the first byte, then each line's end.
        assert_eq!(parses(&head, 1, 16 * 1024), lines + 1);
        // In 7-byte pieces: never more.
        assert!(parses(&head, 7, 16 * 1024) <= lines + 1);
        // All at once: one parse.
        assert_eq!(parses(&head, head.len(), 16 * 1024), 1);
    }

    #[test]
    fn empty_lines_before_a_request_line_are_not_parsed_one_by_one() {
        // httparse skips them; each was a parse of all before it.
        assert_eq!(parses(&[b'\n'; 16 * 1024], 1, 16 * 1024), 0);
        assert_eq!(parses(&b"\r\n".repeat(8 * 1024), 1, 16 * 1024), 0);
        let mut head = b"\r\n".repeat(1000);
        head.extend_from_slice(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        // The request line's first byte, then its three lines' ends.
        assert_eq!(parses(&head, 1, 16 * 1024), 4);
        // Over the limit, they are parsed (and refused).
        assert_eq!(parses(&[b'\n'; 2000], 1000, 1024), 1);
        // A CR not followed by LF is no empty line: parsed (and refused) at once.
        assert!(HeadScan::default().worth_parsing(b"\r\r", 1024));
        let mut scan = HeadScan::default();
        assert!(!scan.worth_parsing(b"\r\n\r", 1024));
        assert!(scan.worth_parsing(b"\r\n\r\r", 1024));
    }

    #[test]
    fn a_forced_look_parses_once() {
        let mut scan = HeadScan::default();
        assert!(scan.worth_parsing(b"GET / HTTP/1.1\r\nx", 1024));
        assert!(!scan.worth_parsing(b"GET / HTTP/1.1\r\nx\x01", 1024));
        scan.force();
        assert!(scan.worth_parsing(b"GET / HTTP/1.1\r\nx\x01", 1024));
        assert!(!scan.worth_parsing(b"GET / HTTP/1.1\r\nx\x01y", 1024));
    }

    #[test]
    fn a_head_is_parsed_at_its_first_bytes_and_over_the_limit() {
        let mut scan = HeadScan::default();
        // Not HTTP at all (a TLS hello): parsed, so refused, at once.
        assert!(scan.worth_parsing(&[0x16, 0x03, 0x01], 1024));
        let mut scan = HeadScan::default();
        let long = vec![b'a'; 2000];
        assert!(scan.worth_parsing(&long[..10], 1024));
        assert!(!scan.worth_parsing(&long[..1000], 1024));
        assert!(!scan.worth_parsing(&long[..1024], 1024));
        // One line with no end, over the limit: parsed (and refused).
        assert!(scan.worth_parsing(&long[..1025], 1024));
    }

    fn framing(lines: &[(&str, &str)], http10: bool) -> Result<BodyHeaders, HeadFault> {
        let mut b = BodyHeaders::default();
        for (name, value) in lines {
            match *name {
                "content-length" => b.content_length(value.as_bytes()),
                "transfer-encoding" => b.transfer_encoding(value.as_bytes()),
                _ => unreachable!(),
            }
        }
        b.check(http10).map(|()| b)
    }

    #[test]
    fn lengths_as_hyper_reads_them() {
        let one = framing(&[("content-length", "5")], false).expect("accepted");
        assert_eq!((one.length, one.plain), (Some(5), true));
        // The same value twice: accepted, not the plain shape.
        let twice =
            framing(&[("content-length", "5"), ("content-length", "5")], false).expect("accepted");
        assert_eq!((twice.length, twice.plain), (Some(5), false));
        // hyper's server takes no list in one line, not even of one value.
        for bad in [
            "5, 5",
            "5, 6",
            "+5",
            "-1",
            "",
            "5 5",
            "99999999999999999999",
            "18446744073709551614",
        ] {
            assert_eq!(
                framing(&[("content-length", bad)], false).expect_err("refused"),
                HeadFault::Bad("invalid or conflicting Content-Length"),
                "{bad:?}"
            );
        }
        assert!(framing(&[("content-length", "5"), ("content-length", "6")], false).is_err());
    }

    /// `chunked` alone is served; any other coding, or `chunked` twice, is refused.
    #[test]
    fn only_chunked_alone_is_a_transfer_encoding() {
        for ok in ["chunked", "Chunked", " chunked\t"] {
            assert!(
                framing(&[("transfer-encoding", ok)], false)
                    .expect("accepted")
                    .chunked,
                "{ok:?}"
            );
        }
        for (lines, http10) in [
            (&[("transfer-encoding", "gzip, chunked")][..], false),
            (&[("transfer-encoding", "chunked, chunked")][..], false),
            (&[("transfer-encoding", "identity")][..], false),
            (
                &[
                    ("transfer-encoding", "gzip"),
                    ("transfer-encoding", "chunked"),
                ][..],
                false,
            ),
            (
                &[
                    ("transfer-encoding", "chunked"),
                    ("transfer-encoding", "chunked"),
                ][..],
                false,
            ),
            (
                &[("transfer-encoding", "chunked"), ("content-length", "3")][..],
                false,
            ),
            (
                &[("content-length", "x"), ("transfer-encoding", "chunked")][..],
                false,
            ),
            (&[("transfer-encoding", "chunked, gzip")][..], false),
            (&[("transfer-encoding", "\u{e9}, chunked")][..], false),
            (&[("transfer-encoding", "chunked")][..], true),
        ] {
            assert!(framing(lines, http10).is_err(), "{lines:?}");
        }
    }

    /// A coding the gateway does not decode before a final `chunked` is 501; a list that
    /// cannot frame a body (`chunked` not last, twice, or a coding that is not a token) is
    /// 400.
    #[test]
    fn an_undecoded_coding_before_chunked_is_501_and_an_unframed_list_400() {
        let not_implemented = |lines: &[(&str, &str)]| {
            matches!(framing(lines, false), Err(HeadFault::NotImplemented(_)))
        };
        for lines in [
            &[("transfer-encoding", "gzip, chunked")][..],
            &[("transfer-encoding", "GZIP ,chunked")][..],
            &[("transfer-encoding", "deflate;q=1, chunked")][..],
            &[
                ("transfer-encoding", "gzip"),
                ("transfer-encoding", "chunked"),
            ][..],
        ] {
            assert!(not_implemented(lines), "{lines:?}");
        }
        for lines in [
            &[("transfer-encoding", "gzip")][..],
            &[("transfer-encoding", "identity")][..],
            &[("transfer-encoding", "chunked, gzip")][..],
            &[("transfer-encoding", "chunked, chunked")][..],
            &[("transfer-encoding", "gzip, chunked, chunked")][..],
            &[("transfer-encoding", "g\u{e9}, chunked")][..],
            &[
                ("transfer-encoding", "chunked"),
                ("transfer-encoding", "chunked"),
            ][..],
            &[
                ("transfer-encoding", "chunked"),
                ("transfer-encoding", "gzip"),
            ][..],
        ] {
            assert!(
                matches!(framing(lines, false), Err(HeadFault::Bad(_))),
                "{lines:?}"
            );
        }
    }
}
