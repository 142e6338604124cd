//! From [`RawConfig`] to a checked [`Config`]: every cross-reference resolved to an index,
//! every address parsed, every duration read; all problems collected with their place.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml::Spanned;

mod dns;
mod hedge;
mod rewrite;

use super::file::{RawCluster, RawConfig, RawRoute};
use super::upstream_tls;
use super::{
    Cluster, Config, ConfigError, ConfigErrors, Listener, LogFormat, LogSettings, Route,
    ServerSettings, Tenant, TlsFiles,
};

/// Headers the request id cannot be carried in, beside the hop-by-hop ones the gateway
/// removes (`pipeline::headers::is_hop_by_hop`): the message's framing and routing, and the
/// forwarding headers it writes.
const RESERVED_ID_HEADERS: &[&str] = &[
    "content-length",
    "host",
    "expect",
    "content-type",
    "content-encoding",
    "date",
    "via",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    // Credentials and state, whose values (often with spaces, so not kept as an id) the
    // id would replace.
    "cookie",
    "set-cookie",
    "authorization",
    "www-authenticate",
    // A client's key, printable, would be kept as its id, and written in every access
    // log line.
    "x-api-key",
    // Headers of their own in each direction: a client's user agent (with spaces, so
    // nearly always replaced by a new id, and the upstream would never see it), and the
    // upstream's server name.
    "user-agent",
    "server",
    // Headers with a meaning of their own in a request or an answer, which the id would
    // overwrite on every message: a redirect's target, a range, a cache's validators and
    // rules, a WebSocket handshake's key (with `sec-` and `if-` below).
    "location",
    "content-location",
    "content-range",
    "content-language",
    "content-disposition",
    "range",
    "accept-ranges",
    "etag",
    "last-modified",
    "vary",
    "cache-control",
    "pragma",
    "expires",
    "age",
    "retry-after",
    "allow",
    "origin",
    "referer",
    "link",
    "alt-svc",
    "accept",
    "accept-encoding",
    "accept-language",
    "strict-transport-security",
    "content-security-policy",
    "http2-settings",
];

/// Prefixes of header families [`RESERVED_ID_HEADERS`] refuses too: conditional requests,
/// fetch metadata and WebSocket handshakes, CORS.
const RESERVED_ID_PREFIXES: &[&str] = &["proxy-", "x-forwarded-", "if-", "sec-", "access-control-"];

/// The longest duration a setting takes (longer ones would overflow deadline arithmetic).
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

pub(super) struct Checker<'a> {
    path: &'a Path,
    text: &'a str,
    errors: Vec<ConfigError>,
    /// Where each line of `text` starts, made at the first error: each error's position is
    /// then a binary search, not a scan from the start (a config with thousands of errors
    /// is reported at once, not in time quadratic in its size).
    line_starts: Vec<usize>,
}

impl Checker<'_> {
    /// Errors found so far: a cross-check of two values skips when either was refused
    /// (it would judge a default the user never wrote, or the refused value again).
    pub(super) fn errors_found(&self) -> usize {
        self.errors.len()
    }

    pub(super) fn err(
        &mut self,
        span: Option<Range<usize>>,
        field: String,
        message: String,
        hint: Option<&str>,
    ) {
        let (line, col) = span.map_or((0, 0), |s| self.line_col(s.start));
        self.errors.push(ConfigError {
            file: self.path.to_path_buf(),
            line,
            col,
            field,
            message,
            hint: hint.map(str::to_owned),
        });
    }

    /// [`line_col`] of `offset` in the config's text, by the line index.
    fn line_col(&mut self, offset: usize) -> (usize, usize) {
        if self.line_starts.is_empty() {
            self.line_starts = std::iter::once(0)
                .chain(self.text.match_indices('\n').map(|(i, _)| i + 1))
                .collect();
        }
        let offset = offset.min(self.text.len());
        // The last line starting at or before `offset` (the first starts at 0).
        let line = self.line_starts.partition_point(|&start| start <= offset);
        let start = self.line_starts[line - 1];
        let col = self
            .text
            .get(start..offset)
            .map_or(0, |t| t.chars().count())
            + 1;
        (line, col)
    }

    pub(super) fn duration(
        &mut self,
        v: &Option<Spanned<String>>,
        field: String,
        default: Duration,
    ) -> Duration {
        let Some(v) = v else { return default };
        match humantime::parse_duration(v.get_ref()) {
            Ok(d) if d > MAX_DURATION => {
                self.err(
                    Some(v.span()),
                    field,
                    format!("`{}` is longer than 30 days", v.get_ref()),
                    Some("write a shorter duration, e.g. \"60s\""),
                );
                default
            }
            Ok(d) => d,
            Err(e) => {
                self.err(
                    Some(v.span()),
                    field,
                    format!("`{}` is not a duration ({e})", v.get_ref()),
                    Some("write a number with a unit, e.g. \"250ms\", \"10s\" or \"2m\""),
                );
                default
            }
        }
    }

    /// A timeout: a [`duration`](Self::duration) longer than zero (a zero timeout would
    /// cut off every request, connection or head at once).
    pub(super) fn timeout(
        &mut self,
        v: &Option<Spanned<String>>,
        field: String,
        default: Duration,
    ) -> Duration {
        let d = self.duration(v, field.clone(), default);
        if let Some(v) = v
            && d < Duration::from_millis(1)
        {
            // Timers fire on the millisecond: anything shorter is zero in effect.
            let message = if d.is_zero() {
                "a timeout of 0 would cut everything off at once".into()
            } else {
                format!(
                    "a timeout of {} is shorter than the timers' 1ms tick, and would cut everything off at once",
                    humantime::format_duration(d)
                )
            };
            self.err(
                Some(v.span()),
                field,
                message,
                Some(&format!(
                    "write at least \"1ms\", e.g. \"{}\", or remove it for that default",
                    humantime::format_duration(default)
                )),
            );
            return default;
        }
        d
    }

    /// The file `v` names (relative to `base_dir`), if it exists; else an error saying
    /// to write the path of a PEM `what`.
    pub(super) fn existing_file(
        &mut self,
        v: &Spanned<String>,
        field: String,
        base_dir: &Path,
        what: &str,
    ) -> Option<PathBuf> {
        let path = resolve(base_dir, v.get_ref());
        if path.is_file() {
            return Some(path);
        }
        let problem = if v.get_ref().trim().is_empty() {
            // (Resolved, it would name the config's own directory, which the user never
            // wrote.)
            "the path is empty".to_owned()
        } else if path.is_dir() {
            format!("{} is a directory, not a file", path.display())
        } else {
            format!("no such file: {}", path.display())
        };
        self.err(
            Some(v.span()),
            field,
            problem,
            Some(&format!(
                "write the path of a PEM {what} (relative paths are relative to the config file)"
            )),
        );
        None
    }

    pub(super) fn address(&mut self, v: &Spanned<String>, field: String) -> Option<SocketAddr> {
        match socket_addr(v.get_ref()) {
            Ok(a) => Some(a),
            Err(NotAddr::Zone { message, hint }) => {
                self.err(Some(v.span()), field, message, hint);
                None
            }
            Err(NotAddr::Other) => {
                self.err(
                    Some(v.span()),
                    field,
                    port_out_of_range(v.get_ref())
                        .unwrap_or_else(|| format!("`{}` is not an address", v.get_ref())),
                    Some("write an IP literal and a port: \"127.0.0.1:8080\" or \"[::1]:8080\""),
                );
                None
            }
        }
    }

    /// Can a listening socket be bound to `a` and reached by TCP? A multicast or the
    /// broadcast address binds, but no connection can ever arrive there. A link-local address with no scope is
    /// refused by the kernel; so is an IPv4-mapped one on an IPv6-only socket (listeners'
    /// sockets; the admin plane's and demos' are `dual_stack`).
    pub(super) fn bindable(
        &mut self,
        a: SocketAddr,
        v: &Spanned<String>,
        field: String,
        dual_stack: bool,
    ) -> bool {
        if let Some(refused) = not_for_listening(a, v.get_ref()) {
            self.err(Some(v.span()), field, refused, Some(NOT_FOR_LISTENING));
            return false;
        }
        let SocketAddr::V6(v6) = a else { return true };
        let (message, hint) = if let Some(v4) = v6.ip().to_ipv4_mapped()
            && !dual_stack
        {
            (
                format!("`{}` is an IPv4 address written as IPv6", v.get_ref()),
                format!("write it as IPv4: \"{v4}:{}\"", a.port()),
            )
        } else if let Some(refused) = unzoned_link_local(a, v.get_ref()) {
            refused
        } else {
            return true;
        };
        self.err(Some(v.span()), field, message, Some(&hint));
        false
    }
}

/// Why a text is not a socket address.
pub(super) enum NotAddr {
    /// Its zone names an interface this machine does not have (the message, with a hint),
    /// or one that could not be looked up (the message, no hint).
    Zone {
        message: String,
        hint: Option<&'static str>,
    },
    /// Not an IP literal with a port.
    Other,
}

/// `text` as a socket address: what `std` parses (an IPv6 zone only as an index,
/// `[fe80::1%2]:80`), and an IPv6 zone that names its interface (`[fe80::1%eth0]:80`, as
/// `ping` and `ip` take it), which becomes that interface's index here and now, at load
/// (an interface made again later, with a new index, needs a reload). The index is asked
/// of the kernel as `if_nametoindex(3)` asks it (`SIOCGIFINDEX` on a socket), in this
/// process's network namespace.
pub(super) fn socket_addr(text: &str) -> Result<SocketAddr, NotAddr> {
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok(a);
    }
    let named = text
        .strip_prefix('[')
        .and_then(|t| t.split_once("]:"))
        .and_then(|(host, port)| Some((host.split_once('%')?, port)));
    let Some(((ip, zone), port)) = named else {
        return Err(NotAddr::Other);
    };
    let (Ok(ip), Ok(port)) = (ip.parse::<std::net::Ipv6Addr>(), port.parse::<u16>()) else {
        return Err(NotAddr::Other);
    };
    // An interface's name as the kernel takes it (at most 15 bytes, no `/`, not `.`/`..`).
    let plausible = !zone.is_empty()
        && zone.len() < 16
        && zone != "."
        && zone != ".."
        && zone
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'%');
    if !plausible {
        return Err(NotAddr::Other);
    }
    match interface_index(zone) {
        Ok(i) => Ok(SocketAddr::V6(std::net::SocketAddrV6::new(ip, port, 0, i))),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NODEV.raw_os_error()) => {
            Err(NotAddr::Zone {
                message: format!("`{text}`: this machine has no interface `{zone}`"),
                hint: Some(
                    "name an interface this machine has, or its index (`ip link` lists both)",
                ),
            })
        }
        Err(e) => Err(NotAddr::Zone {
            message: format!("`{text}`: could not look up the interface `{zone}`: {e}"),
            hint: None,
        }),
    }
}

/// `if_nametoindex(3)`: the ioctl takes a socket of any family, and, as glibc does, the
/// next family is tried when one is not allowed here (a sandbox that forbids some).
fn interface_index(name: &str) -> std::io::Result<u32> {
    use socket2::{Domain, Socket, Type};
    let mut last = None;
    for domain in [Domain::UNIX, Domain::IPV4, Domain::IPV6] {
        match Socket::new(domain, Type::DGRAM, None) {
            Ok(s) => return Ok(rustix::net::netdevice::name_to_index(&s, name)?),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::ErrorKind::Unsupported.into()))
}

const NOT_FOR_LISTENING: &str =
    "write one of this host's own addresses, or 0.0.0.0 for all of them";

/// Why TCP can never reach a listening socket bound to `a`, if it cannot.
fn not_for_listening(a: SocketAddr, written: &str) -> Option<String> {
    let ip = a.ip().to_canonical();
    if ip.is_multicast() {
        Some(format!(
            "`{written}` is a multicast address: TCP connections never arrive there"
        ))
    } else if ip == std::net::IpAddr::V4(std::net::Ipv4Addr::BROADCAST) {
        Some(format!(
            "`{written}` is the broadcast address: TCP connections never arrive there"
        ))
    } else {
        None
    }
}

/// A link-local IPv6 address with no interface named (`written` as the config wrote it),
/// which the kernel refuses to bind or connect to (`EINVAL`: which link is not said): the
/// message and the hint, for a listener and an endpoint alike.
pub(super) fn unzoned_link_local(a: SocketAddr, written: &str) -> Option<(String, String)> {
    let SocketAddr::V6(v6) = a else { return None };
    (v6.ip().is_unicast_link_local() && v6.scope_id() == 0).then(|| {
        (
            format!("`{written}` is link-local, with no interface named"),
            format!(
                "add its interface, by name or index: \"[{}%eth0]:{}\" (`ip link` lists them)",
                v6.ip(),
                a.port()
            ),
        )
    })
}

/// A socket the gateway binds: its address, and whether it is dual-stack. The admin plane
/// and demos bind with `std` (an IPv6 socket takes IPv4 too, and an IPv4-mapped address is
/// its IPv4 one); listeners bind IPv6 addresses IPv6-only.
#[derive(Clone, Copy)]
struct Bound {
    addr: SocketAddr,
    dual: bool,
}

/// Would a connection to `endpoint` reach a socket listening on `listener`: the same
/// address, or a wildcard listener of the same family and a loopback endpoint? (Another
/// local address on a wildcard listener is not seen: that takes the host's interfaces.)
fn reaches(endpoint: SocketAddr, listener: SocketAddr) -> bool {
    if listener.port() != endpoint.port() {
        return false;
    }
    // (`[::ffff:127.0.0.1]` is 127.0.0.1 to a dual-stack connect.)
    let (e, l) = (endpoint.ip().to_canonical(), listener.ip());
    e == l || (l.is_unspecified() && e.is_ipv4() == l.is_ipv4() && e.is_loopback())
}

/// Would the second of two exclusive binds fail (`EADDRINUSE`)?
fn clash(a: Bound, b: Bound) -> bool {
    use std::net::IpAddr;
    if a.addr.port() == 0 || a.addr.port() != b.addr.port() {
        return false;
    }
    let ip = |s: Bound| match s.addr.ip() {
        IpAddr::V6(v6) if s.dual => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        ip => ip,
    };
    let (x, y) = (ip(a), ip(b));
    if x == y {
        return true;
    }
    if x.is_ipv4() == y.is_ipv4() {
        return x.is_unspecified() || y.is_unspecified();
    }
    // Across families, only a dual-stack IPv6 wildcard takes the IPv4 side too.
    let takes_v4 = |s: Bound, ip: IpAddr| s.dual && ip.is_ipv6() && ip.is_unspecified();
    takes_v4(a, x) || takes_v4(b, y)
}

/// Can a request's path hold this byte as it is? What the request parsers take in a path
/// (`http::uri`): not a space or control byte, nor `<`, `>` or `` ` ``, and not `?` or
/// `#`, which end it. Raw UTF-8 and `"`, `{`, `}`, `|`, `[`, `]`, `^`, `\` pass, as some
/// clients send them so.
fn in_request_path(b: u8) -> bool {
    b > 0x20 && b != 0x7f && !matches!(b, b'<' | b'>' | b'`' | b'?' | b'#')
}

/// The error for an address a socket bound before it already takes.
fn taken(a: SocketAddr, b: SocketAddr) -> String {
    if a == b {
        format!("address {a} is used twice")
    } else {
        format!("address {a} overlaps {b}, bound before it")
    }
}

/// 1-based line and column (in characters) of a byte offset.
pub(super) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = text[line_start..offset].chars().count() + 1;
    (line, col)
}

pub(super) fn parse_and_validate(path: &Path, text: &str) -> Result<Config, ConfigErrors> {
    let raw: RawConfig = match toml::from_str(text) {
        Ok(raw) => raw,
        Err(e) => {
            let (line, col) = e.span().map_or((0, 0), |s| line_col(text, s.start));
            let message = e.message().trim().to_owned();
            let field = key_at(text, line, col);
            return Err(ConfigErrors(vec![ConfigError {
                file: path.to_path_buf(),
                line,
                col,
                hint: Some(toml_hint(&message, &field).to_owned()),
                field,
                message: without_type_names(&message),
            }]));
        }
    };
    let mut c = Checker {
        path,
        text,
        errors: Vec::new(),
        line_starts: Vec::new(),
    };
    let config = check(&mut c, raw);
    if c.errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(c.errors))
    }
}

/// The reader's message with the file's internal type names (`struct RawAdmin`) said as
/// what they are in the file: a table.
fn without_type_names(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("struct Raw") {
        out.push_str(&rest[..at]);
        out.push_str("a table");
        rest =
            rest[at + "struct Raw".len()..].trim_start_matches(|c: char| c.is_ascii_alphanumeric());
    }
    out.push_str(rest);
    out
}

/// What to write instead, for an error the TOML reader found (before any field is checked).
fn toml_hint(message: &str, field: &str) -> &'static str {
    // An integer out of the field's type: "invalid value" within i64, "invalid type ...
    // as i128" past it.
    let integer =
        message.contains("invalid value: integer") || message.contains(" as i128, expected u");
    if integer && let Some(range) = ranged_hint(field) {
        range
    } else if integer && message.contains("integer `-") {
        "write a number of 0 or more"
    } else if integer && message.contains("expected u32") {
        // Past a u32 field's largest (the README gives a range only for some).
        "write a number of at most 4294967295"
    } else if integer {
        // Past the type's largest (a usize or u64 field).
        "write a number of at most 18446744073709551615"
    } else if message.contains("unknown field") {
        "remove it, or use one of the expected fields listed above"
    } else if message.contains("missing field") {
        "add the field to this table"
    } else if message.contains("duplicate key") {
        "keep one of the two"
    } else if message.contains("invalid type: map, expected a sequence") {
        "write this table's header with double brackets, as each of its kind is one of a list: [[listener]], [[tenant]], [[cluster]], [[route]]"
    } else if message.contains("expected a sequence") {
        "write a list in brackets, e.g. [\"GET\", \"POST\"] or [\"127.0.0.1:9000\"]"
    } else if message.contains("expected struct RawTls") {
        "write a table here, e.g. tls = { cert = \"cert.pem\", key = \"key.pem\" }; see the README's config reference"
    } else if message.contains("invalid type: map")
        && ["server", "admin", "log", "dns", "metrics"].contains(&field)
    {
        // `[[server]]`: a list of tables, read field by field as if it were one.
        "write this table's header with single brackets, as there is one of it: [server], [admin], [log], [dns], [metrics]"
    } else if message.contains("expected struct") {
        "write a table here: a header such as [admin] with one `key = value` per line below it; see the README's config reference"
    } else if message.contains("invalid type: string") && field.ends_with("_bytes") {
        // (`"10m"`, as nginx writes sizes: unquoted it would be no TOML at all.)
        "write a number of bytes without quotes and without a unit, e.g. 10485760 for 10 MiB"
    } else if message.contains("invalid type: string") {
        "write this value without quotes (a number or true/false); see the README's config reference"
    } else if message.contains("expected a string") {
        "write this value in quotes, e.g. \"30s\" or \"127.0.0.1:8080\""
    } else if message.contains("invalid type") {
        "write a value of the type the README's config reference gives for this field"
    } else {
        "check this line's TOML: `key = value`, strings in quotes, tables as [name] or [[name]]"
    }
}

/// What to write for a negative value of an integer field with a range narrower than "0
/// or more" (the checks below give the same range once the value is in the type's).
fn ranged_hint(field: &str) -> Option<&'static str> {
    match field {
        "workers" => Some("write a number between 1 and 1024"),
        "max_header_bytes" => {
            Some("write a number between 1024 and 1048576; 16384 is a good default")
        }
        "retry_budget_percent" | "hedge_budget_percent" => Some("write a number between 0 and 100"),
        "max_consumers" => Some("write a number between 1 and 1000000"),
        _ => None,
    }
}

/// The key an error the TOML reader found at `line` and `col` (1-based) of `text` is about:
/// the last `key =` before it on its line (within an inline table, `tls = { cert = "a",
/// key = 5 }` gives `tls.key`), else, for a value on a line of its own (an element of a
/// list written over several lines), the key of the nearest line above that has one.
fn key_at(text: &str, line: usize, col: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let Some(this) = lines.get(line.saturating_sub(1)) else {
        return String::new();
    };
    let before: String = this.chars().take(col.saturating_sub(1)).collect();
    // On a table's header (`[server]` repeated, say): the table.
    if let Some(header) = this.trim_start().strip_prefix('[') {
        let name = header.trim_start_matches('[');
        return name[..name.find(']').unwrap_or(name.len())]
            .trim()
            .to_owned();
    }
    if before.contains('=') {
        // The last `key =` before the column, under the keys of the inline tables it is in.
        let (mut tables, mut key, mut word, mut quoted) =
            (Vec::new(), String::new(), String::new(), false);
        // The brackets open at each point: a `,` in an inline table starts a new key, one
        // in an array another value of the key before.
        let mut open = Vec::new();
        for ch in before.chars() {
            match ch {
                '"' => quoted = !quoted,
                _ if quoted => {}
                '=' => key = std::mem::take(&mut word).trim().to_owned(),
                '{' => {
                    open.push('{');
                    tables.push(std::mem::take(&mut key));
                    word.clear();
                }
                '}' => {
                    open.pop();
                    // The key whose value the table was, for another table in its array.
                    key = tables.pop().unwrap_or_default();
                    word.clear();
                }
                '[' => {
                    open.push('[');
                    word.clear();
                }
                ']' => {
                    open.pop();
                    word.clear();
                }
                ',' => {
                    if open.last() == Some(&'{') {
                        key.clear();
                    }
                    word.clear();
                }
                c => word.push(c),
            }
        }
        if key.is_empty() {
            // At a key of an inline table not yet followed by its `=`: the key under the
            // column (`kee` of `tls = { cert = "a", kee = "b" }`).
            key = this
                .chars()
                .skip(col.saturating_sub(1))
                .take_while(|&c| !matches!(c, '=' | ',' | '}' | '{') && !c.is_whitespace())
                .collect();
        }
        tables.push(key);
        let key = tables.join(".");
        return if key.is_empty() || key.starts_with('[') {
            String::new()
        } else {
            key
        };
    }
    if before.trim().is_empty() {
        // At the start of a line: the reader puts an unknown or repeated key's error on the
        // key itself, and a missing field's or a table of the wrong kind's on the table's
        // header. Either names what is wrong; the lines above belong to other fields.
        let rest = this.trim_start();
        if let Some(header) = rest.strip_prefix('[') {
            let name = header.trim_start_matches('[');
            return name[..name.find(']').unwrap_or(name.len())]
                .trim()
                .to_owned();
        }
        if let Some((key, _)) = rest.split_once('=')
            && !key.trim().is_empty()
            && !key.contains('"')
        {
            return key.trim().to_owned();
        }
    }
    lines[..line.saturating_sub(1)]
        .iter()
        .rev()
        .take_while(|l| !l.trim_start().starts_with('['))
        .find_map(|l| l.split_once('='))
        .map(|(k, _)| k.trim().to_owned())
        .filter(|k| !k.is_empty())
        .unwrap_or_default()
}

fn check(c: &mut Checker<'_>, raw: RawConfig) -> Config {
    let base_dir = c.path.parent().map(Path::to_path_buf).unwrap_or_default();

    // [server]
    let s = &raw.server;
    let workers = match &s.workers {
        Some(w) if *w.get_ref() == 0 || *w.get_ref() > 1024 => {
            c.err(
                Some(w.span()),
                "server.workers".into(),
                "must be between 1 and 1024".into(),
                Some("remove it to get one worker per core"),
            );
            1
        }
        Some(w) => *w.get_ref(),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let max_header_bytes = match &s.max_header_bytes {
        Some(m) if *m.get_ref() < 1024 || *m.get_ref() > 1 << 20 => {
            c.err(
                Some(m.span()),
                "server.max_header_bytes".into(),
                "must be between 1024 and 1048576".into(),
                Some("16384 is a good default"),
            );
            16 * 1024
        }
        Some(m) => *m.get_ref(),
        None => 16 * 1024,
    };
    let request_id_header = match &s.request_id_header {
        Some(h) => match http::HeaderName::from_bytes(h.get_ref().as_bytes()) {
            // The id is set on every request and response: a header that frames or routes
            // a message, or that the gateway removes as hop-by-hop, would break them all.
            Ok(n)
                if crate::pipeline::headers::is_hop_by_hop(&n)
                    || RESERVED_ID_HEADERS.contains(&n.as_str())
                    || RESERVED_ID_PREFIXES
                        .iter()
                        .any(|p| n.as_str().starts_with(p)) =>
            {
                c.err(
                    Some(h.span()),
                    "server.request_id_header".into(),
                    format!(
                        "`{}` frames, routes or is removed from every message, is set by the gateway, carries credentials, or means something of its own that the id would overwrite; it cannot carry the request id",
                        h.get_ref()
                    ),
                    Some("write a header of its own, such as \"x-request-id\""),
                );
                http::HeaderName::from_static("x-request-id")
            }
            Ok(n) => n,
            Err(_) => {
                c.err(
                    Some(h.span()),
                    "server.request_id_header".into(),
                    format!("`{}` is not a header name", h.get_ref()),
                    Some("write a token such as \"x-request-id\""),
                );
                http::HeaderName::from_static("x-request-id")
            }
        },
        None => http::HeaderName::from_static("x-request-id"),
    };
    let server = ServerSettings {
        workers,
        shutdown_grace: c.duration(
            &s.shutdown_grace,
            "server.shutdown_grace".into(),
            Duration::from_secs(10),
        ),
        shutdown_delay: c.duration(
            &s.shutdown_delay,
            "server.shutdown_delay".into(),
            Duration::ZERO,
        ),
        header_read_timeout: c.timeout(
            &s.header_read_timeout,
            "server.header_read_timeout".into(),
            Duration::from_secs(10),
        ),
        idle_timeout: c.timeout(
            &s.idle_timeout,
            "server.idle_timeout".into(),
            Duration::from_secs(60),
        ),
        max_header_bytes,
        max_body_bytes: s.max_body_bytes.unwrap_or(10 * 1024 * 1024),
        request_id_header,
        warm_wait: c.duration(
            &s.warm_wait,
            "server.warm_wait".into(),
            Duration::from_secs(10),
        ),
        max_connections: s.max_connections.unwrap_or(0),
        max_connections_unset: s.max_connections.is_none(),
        max_requests_per_connection: s.max_requests_per_connection.unwrap_or(0),
    };

    // [log]
    let level = match &raw.log.level {
        Some(l) => {
            let v = l.get_ref().to_ascii_lowercase();
            if !["error", "warn", "info", "debug", "trace", "off"].contains(&v.as_str()) {
                c.err(
                    Some(l.span()),
                    "log.level".into(),
                    format!("`{}` is not a log level", l.get_ref()),
                    Some(
                        "write one of \"error\", \"warn\", \"info\", \"debug\", \"trace\", \"off\"",
                    ),
                );
            }
            v
        }
        None => "info".into(),
    };
    let format = match &raw.log.format {
        Some(f) => match f.get_ref().as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                c.err(
                    Some(f.span()),
                    "log.format".into(),
                    format!("`{other}` is not a log format"),
                    Some("write \"text\" or \"json\""),
                );
                LogFormat::Text
            }
        },
        None => LogFormat::Text,
    };
    let log = LogSettings {
        level,
        format,
        access_log: raw.log.access_log.unwrap_or(true),
    };
    let dns = c.dns(&raw.dns);

    // [[tenant]]
    let mut tenant_index: HashMap<String, usize> = HashMap::new();
    let mut host_owner: HashMap<String, String> = HashMap::new();
    let mut tenants = Vec::new();
    for (i, t) in raw.tenant.iter().enumerate() {
        let name = t.name.get_ref().clone();
        if name.is_empty() {
            c.err(
                Some(t.name.span()),
                format!("tenant[{i}].name"),
                "must not be empty".into(),
                Some(
                    "write a name such as \"acme\": metrics, logs and routes name the tenant by it",
                ),
            );
        }
        if tenant_index.insert(name.clone(), i).is_some() {
            c.err(
                Some(t.name.span()),
                format!("tenant[{i}].name"),
                format!("tenant `{name}` is defined twice"),
                Some("give each tenant a unique name"),
            );
        }
        let mut hosts = Vec::new();
        for (j, h) in t.hosts.iter().enumerate() {
            let host = h.get_ref().to_ascii_lowercase();
            if !valid_host_pattern(&host) {
                c.err(Some(h.span()), format!("tenant[{i}].hosts[{j}]"), format!("`{}` is not a host name", h.get_ref()), Some("write a name like \"api.example.com\" or \"*.example.com\", without scheme, port or trailing dot"));
                continue;
            }
            if let Some(other) = host_owner.insert(host.clone(), name.clone()) {
                let (message, hint) = if other == name {
                    (
                        format!("host `{host}` is listed twice"),
                        "list each host once",
                    )
                } else {
                    (
                        format!("host `{host}` already belongs to tenant `{other}`"),
                        "a host belongs to one tenant only",
                    )
                };
                c.err(
                    Some(h.span()),
                    format!("tenant[{i}].hosts[{j}]"),
                    message,
                    Some(hint),
                );
            }
            hosts.push(host);
        }
        tenants.push(Tenant { name, hosts });
    }

    let tenant_ref =
        |c: &mut Checker<'_>, v: &Option<Spanned<String>>, field: String| -> Option<usize> {
            let v = v.as_ref()?;
            match tenant_index.get(v.get_ref()) {
                Some(&i) => Some(i),
                None => {
                    let known: Vec<&str> = raw
                        .tenant
                        .iter()
                        .map(|t| t.name.get_ref().as_str())
                        .collect();
                    c.err(
                        Some(v.span()),
                        field,
                        format!("no tenant named `{}`", v.get_ref()),
                        Some(&format!(
                            "define it in a [[tenant]] table, or use one of: {}",
                            list_or_none(&known)
                        )),
                    );
                    None
                }
            }
        };

    // [[demo]]
    let mut demos = Vec::new();
    // Every socket bound so far: demos first, then listeners.
    let mut bound: Vec<Bound> = Vec::new();
    for (i, d) in raw.demo.iter().enumerate() {
        if let Some(a) = c
            .address(&d.address, format!("demo[{i}].address"))
            .filter(|a| c.bindable(*a, &d.address, format!("demo[{i}].address"), true))
        {
            let this = Bound {
                addr: a,
                dual: true,
            };
            if let Some(b) = bound.iter().find(|b| clash(this, **b)) {
                c.err(
                    Some(d.address.span()),
                    format!("demo[{i}].address"),
                    taken(a, b.addr),
                    Some("give each listener and demo its own address"),
                );
            }
            bound.push(this);
            demos.push(a);
        }
    }

    // [[listener]]
    let mut listeners = Vec::new();
    for (i, l) in raw.listener.iter().enumerate() {
        let address = c
            .address(&l.address, format!("listener[{i}].address"))
            .filter(|a| c.bindable(*a, &l.address, format!("listener[{i}].address"), false));
        if let Some(a) = address {
            let this = Bound {
                addr: a,
                dual: false,
            };
            // Listeners share ports among themselves (SO_REUSEPORT): only the same
            // address twice is a mistake; a demo's socket is exclusive.
            let other = bound.iter().find(|b| {
                if b.dual {
                    clash(this, **b)
                } else {
                    a.port() != 0 && b.addr == a
                }
            });
            if let Some(b) = other {
                c.err(
                    Some(l.address.span()),
                    format!("listener[{i}].address"),
                    taken(a, b.addr),
                    Some("give each listener and demo its own address"),
                );
            }
            bound.push(this);
        }
        let tenant = tenant_ref(c, &l.tenant, format!("listener[{i}].tenant"));
        let tls = l.tls.as_ref().map(|t| {
            // A missing file is an error, so the config is never used with an empty path.
            let cert = c.existing_file(
                &t.cert,
                format!("listener[{i}].tls.cert"),
                &base_dir,
                "certificate chain",
            );
            let key = c.existing_file(
                &t.key,
                format!("listener[{i}].tls.key"),
                &base_dir,
                "private key",
            );
            let files = TlsFiles {
                cert: cert.unwrap_or_default(),
                key: key.unwrap_or_default(),
            };
            // Read now, so that `check` finds what `serve` would fail to start with: an
            // empty file, a key that is not the certificate's, a swapped pair.
            if !files.cert.as_os_str().is_empty()
                && !files.key.as_os_str().is_empty()
                && let Err(e) = crate::listener::tls::acceptor(&files)
            {
                // At the file the error is about.
                let span = match e {
                    crate::listener::tls::TlsError::Key { .. }
                    | crate::listener::tls::TlsError::UnusableKey { .. } => t.key.span(),
                    _ => t.cert.span(),
                };
                c.err(
                    Some(span),
                    format!("listener[{i}].tls"),
                    e.to_string(),
                    Some("write the paths of a PEM certificate chain (`cert`) and of its own private key (`key`)"),
                );
            }
            files
        });
        let name = match &l.name {
            Some(n) => {
                let name = n.get_ref().clone();
                if name.is_empty() {
                    c.err(
                        Some(n.span()),
                        format!("listener[{i}].name"),
                        "must not be empty".into(),
                        Some("write a name such as \"public\", or remove it for `listener<index>`"),
                    );
                } else if let Some(j) = raw.listener.iter().enumerate().position(|(j, o)| {
                    // An earlier listener's name, or the default (`listener<index>`) of any
                    // unnamed one.
                    match &o.name {
                        Some(o) => j < i && *o.get_ref() == name,
                        None => name == format!("listener{j}"),
                    }
                }) {
                    c.err(
                        Some(n.span()),
                        format!("listener[{i}].name"),
                        format!("listener `{name}` is defined twice (also listener[{j}])"),
                        Some("give each listener a unique name: metrics and logs tell them apart by it"),
                    );
                }
                name
            }
            None => format!("listener{i}"),
        };
        if let Some(address) = address {
            listeners.push(Listener {
                name,
                address,
                tenant,
                tls,
            });
        }
    }
    if raw.listener.is_empty() {
        c.err(
            None,
            "listener".into(),
            "no listener is defined".into(),
            Some("add [[listener]] with address = \"127.0.0.1:8080\""),
        );
    }

    // [[cluster]]
    let mut cluster_index: HashMap<String, usize> = HashMap::new();
    let mut clusters = Vec::new();
    // The system's trusted roots, read once for every https cluster that names no CA.
    let mut system_roots = None;
    for (i, cl) in raw.cluster.iter().enumerate() {
        let name = cl.name.get_ref().clone();
        if name.is_empty() {
            c.err(
                Some(cl.name.span()),
                format!("cluster[{i}].name"),
                "must not be empty".into(),
                Some("write a name such as \"api\"; routes refer to the cluster by it"),
            );
        }
        if cluster_index.insert(name.clone(), i).is_some() {
            c.err(
                Some(cl.name.span()),
                format!("cluster[{i}].name"),
                format!("cluster `{name}` is defined twice"),
                Some("give each cluster a unique name"),
            );
        }
        let mut endpoints = Vec::new();
        if cl.endpoints.get_ref().is_empty() {
            c.err(
                Some(cl.endpoints.span()),
                format!("cluster[{i}].endpoints"),
                "no endpoints".into(),
                Some("list at least one, e.g. endpoints = [\"127.0.0.1:9000\"]"),
            );
        }
        let mut hostnames = Vec::new();
        let mut schemes = Vec::new();
        for (j, e) in cl.endpoints.get_ref().iter().enumerate() {
            let (https, e) = upstream_tls::strip_scheme(e);
            match c.endpoint(&e, format!("cluster[{i}].endpoints[{j}]")) {
                Some(dns::Endpoint::Addr(a)) => {
                    if let Some(l) = bound.iter().find(|b| !b.dual && reaches(a, b.addr)) {
                        c.err(
                            Some(e.span()),
                            format!("cluster[{i}].endpoints[{j}]"),
                            format!(
                                "`{a}` is this gateway's own listener ({}): each request sent there would come back to the gateway, be routed there again, and loop until a limit cut it",
                                l.addr
                            ),
                            Some("write the address of the upstream server the cluster stands for, e.g. \"127.0.0.1:9000\""),
                        );
                    }
                    endpoints.push(a)
                }
                Some(dns::Endpoint::Name(n)) => hostnames.push(n),
                None => continue,
            }
            schemes.push((https, e.span()));
        }
        let protocol = upstream_tls::protocol(c, cl, i, &schemes);
        let http2_keepalive_interval = upstream_tls::http2_keepalive(c, cl, i, protocol);
        let tls = upstream_tls::cluster_tls(
            c,
            cl,
            i,
            &base_dir,
            upstream_tls::Written {
                schemes: &schemes,
                hostnames: &hostnames,
            },
            protocol,
            &mut system_roots,
        );
        clusters.push(Cluster {
            name,
            endpoints,
            hostnames,
            connect_timeout: c.timeout(
                &cl.connect_timeout,
                format!("cluster[{i}].connect_timeout"),
                Duration::from_secs(2),
            ),
            max_idle_per_endpoint: cl.max_idle_per_endpoint.unwrap_or(256),
            max_connections_per_endpoint: cl
                .max_connections_per_endpoint
                .as_ref()
                .map_or(0, |m| *m.get_ref()),
            idle_timeout: c.duration(
                &cl.idle_timeout,
                format!("cluster[{i}].idle_timeout"),
                Duration::from_secs(4),
            ),
            max_requests_per_connection: cl.max_requests_per_connection.unwrap_or(0),
            max_connection_lifetime: cl.max_connection_lifetime.as_ref().map(|_| {
                c.duration(
                    &cl.max_connection_lifetime,
                    format!("cluster[{i}].max_connection_lifetime"),
                    Duration::from_secs(300),
                )
            }),
            min_warm_connections: cl.min_warm_connections.as_ref().map_or(0, |m| *m.get_ref()),
            balance: match &cl.balance {
                None => crate::upstream::Balance::P2c,
                Some(b) => match b.get_ref().as_str() {
                    "p2c" => crate::upstream::Balance::P2c,
                    "round_robin" => crate::upstream::Balance::RoundRobin,
                    other => {
                        c.err(Some(b.span()), format!("cluster[{i}].balance"), format!("`{other}` is not a balancer"), Some("write \"p2c\" (power of two choices over latency) or \"round_robin\""));
                        crate::upstream::Balance::P2c
                    }
                },
            },
            eject_after_failures: cl.eject_after_failures.unwrap_or(5),
            retry_budget_percent: match &cl.retry_budget_percent {
                Some(p) if *p.get_ref() > 100 => {
                    c.err(Some(p.span()), format!("cluster[{i}].retry_budget_percent"), "must be between 0 and 100".into(), Some("10 lets retries add at most a tenth to the requests sent"));
                    10
                }
                Some(p) => *p.get_ref(),
                None => 10,
            },
            hedge_budget_percent: match &cl.hedge_budget_percent {
                Some(p) if *p.get_ref() > 100 => {
                    c.err(Some(p.span()), format!("cluster[{i}].hedge_budget_percent"), "must be between 0 and 100".into(), Some("10 hedges at most one request in ten"));
                    10
                }
                Some(p) => *p.get_ref(),
                None => 10,
            },
            eject_duration: eject_duration(c, cl, i),
            max_requests: cl.max_requests.unwrap_or(0),
            tls,
            protocol,
            http2_keepalive_interval,
        });
        if let Some(last) = clusters.last() {
            pool_limits(c, cl, i, last);
        }
    }

    // [[route]]
    let mut routes = Vec::new();
    // Every route so far, by (tenant as the route's scope has it, host, path_prefix)
    // (`pipeline::route::scope`): its methods and span, in order. Only routes of one key can
    // be duplicates, so a config of many routes is checked in linear time.
    type RouteKey = (Option<usize>, Option<String>, String);
    type SeenRoute = (Vec<http::Method>, Range<usize>);
    let mut seen_routes: HashMap<RouteKey, Vec<SeenRoute>> = HashMap::new();
    // Unnamed routes are labelled `route<index>`: those names are taken too.
    let mut route_names: HashSet<String> = raw
        .route
        .iter()
        .enumerate()
        .filter(|(_, r)| r.name.is_none())
        .map(|(j, _)| format!("route{j}"))
        .collect();
    let owners = HostOwners::new(&tenants);
    for (i, r) in raw.route.iter().enumerate() {
        let tenant = tenant_ref(c, &r.tenant, format!("route[{i}].tenant"));
        // (A tenant not found is no scope: no duplicate is looked for then.)
        let tenant_refused = r.tenant.is_some() && tenant.is_none();
        let cluster = match cluster_index.get(r.cluster.get_ref()) {
            Some(&ci) => Some(ci),
            None => {
                let known: Vec<&str> = raw
                    .cluster
                    .iter()
                    .map(|x| x.name.get_ref().as_str())
                    .collect();
                c.err(
                    Some(r.cluster.span()),
                    format!("route[{i}].cluster"),
                    format!("no cluster named `{}`", r.cluster.get_ref()),
                    Some(&format!(
                        "define it in a [[cluster]] table, or use one of: {}",
                        list_or_none(&known)
                    )),
                );
                None
            }
        };
        let path_prefix = r.path_prefix.get_ref().clone();
        if !path_prefix.starts_with('/') {
            c.err(
                Some(r.path_prefix.span()),
                format!("route[{i}].path_prefix"),
                format!("`{path_prefix}` does not start with `/`"),
                Some("write an absolute path prefix such as \"/\" or \"/api/\""),
            );
        } else if let Some(b) = path_prefix.bytes().find(|&b| !in_request_path(b)) {
            c.err(
                Some(r.path_prefix.span()),
                format!("route[{i}].path_prefix"),
                format!("`{path_prefix}` has {}, which no request path holds as it is (a request refuses it, or it ends the path), so no request would match it", match b {
                    b' ' => "a space".to_owned(),
                    b'?' | b'#' => format!("`{}`", b as char),
                    b if b.is_ascii_graphic() => format!("`{}`", b as char),
                    b => format!("the control byte 0x{b:02x}"),
                }),
                Some("percent-encode it, as requests carry it: \"/a%20b\""),
            );
        } else {
            // Requests are matched in normal form (`pipeline::route::normal_path`): a prefix
            // that is not would never match anything. Its last segment may be cut short
            // (`/static/.` matches `/static/.env`): checked as if a letter followed it,
            // unless it has a `;` (the letter would be part of the parameter).
            let params = path_prefix.contains(';');
            let whole = if params {
                path_prefix.clone()
            } else {
                format!("{path_prefix}x")
            };
            use crate::pipeline::route::BadPath;
            match crate::pipeline::route::normal_path(&whole) {
                Ok(normal) if normal == whole.as_str() => {}
                Ok(normal) => c.err(
                    Some(r.path_prefix.span()),
                    format!("route[{i}].path_prefix"),
                    format!("`{path_prefix}` is not in normal form, so no request would match it: paths are matched with `;` parameters dropped, `%XX` decoded where the byte may stand raw in a path (not `;` or `%`), bytes above 0x7F (raw UTF-8) percent-encoded, `.` and `..` resolved and `//` merged"),
                    Some(&format!(
                        "write \"{}\"",
                        if params {
                            &normal
                        } else {
                            normal.strip_suffix('x').unwrap_or(&normal)
                        }
                    )),
                ),
                Err(bad) => {
                    let (what, help) = match bad {
                        BadPath::AboveRoot => (
                            "climbs above `/` with `..`",
                            "write the prefix without `..` segments",
                        ),
                        BadPath::DotsAfterEmpty => (
                            "has a `..` that takes off an empty segment; such paths are refused with 400",
                            "write the prefix without `//` or `..` segments",
                        ),
                        BadPath::DotsWithParams => (
                            "has a `.` or `..` segment with `;` parameters; such paths are refused with 400",
                            "write the prefix without `.` or `..` segments",
                        ),
                        BadPath::Nul => (
                            "has an encoded NUL; such paths are refused with 400",
                            "write the prefix without `%00`",
                        ),
                        BadPath::SlashInParams => (
                            "has a `;` parameter with an encoded slash or a backslash in it; such paths are refused with 400",
                            "write the prefix without `%2F`, `%5C` or `\\` after a `;`",
                        ),
                        BadPath::BadEscape => (
                            "has a `%` not followed by two hex digits; such paths are refused with 400",
                            "write `%25` for a `%` itself",
                        ),
                    };
                    c.err(
                        Some(r.path_prefix.span()),
                        format!("route[{i}].path_prefix"),
                        format!("`{path_prefix}` {what}"),
                        Some(help),
                    );
                }
            }
        }
        let host = route_host(c, r, i, tenant, &tenants, &owners);
        let methods = route_methods(c, r, i);
        let span = r.path_prefix.span();
        // (A host already refused is no host: no duplicate is looked for then.)
        let host_refused = r.host.is_some() && host.is_none() || tenant_refused;
        let (scope, _) = crate::pipeline::route::scope(tenant, host.as_deref());
        let key = (scope, host.clone(), path_prefix.clone());
        let same_key = seen_routes.get(&key).filter(|_| !host_refused);
        for (m, prev) in same_key.into_iter().flatten() {
            // A route without `methods` takes every method but TRACE
            // (`pipeline::route`): beside a TRACE-only route it does not overlap. Routes
            // of one host and prefix are tried in the config's order, so one without
            // `methods` after routes that list some takes the methods they do not (GET to
            // a replica, the rest to the primary, as in Envoy's first match): no
            // duplicate. Before them, it would take all of theirs.
            let any_but_trace = |ms: &[http::Method]| ms.iter().any(|x| *x != http::Method::TRACE);
            let overlap = m.is_empty() && (methods.is_empty() || any_but_trace(&methods))
                || m.iter().any(|x| methods.contains(x));
            if overlap {
                let (pl, _) = c.line_col(prev.start);
                c.err(Some(span.clone()), format!("route[{i}]"), format!("duplicate route: the same host (or, without one, tenant), path_prefix `{path_prefix}` and methods as the route at line {pl}, which would always be chosen"), Some("remove one of them, or make them differ by host, path_prefix or methods"));
                break;
            }
        }
        if !host_refused {
            seen_routes
                .entry(key)
                .or_default()
                .push((methods.clone(), span));
        }
        let found = c.errors_found();
        let response_timeout = c.timeout(
            &r.response_timeout,
            format!("route[{i}].response_timeout"),
            Duration::from_secs(30),
        );
        let response_refused = c.errors_found() > found;
        let found = c.errors_found();
        let total_timeout = r.total_timeout.as_ref().map(|_| {
            c.timeout(
                &r.total_timeout,
                format!("route[{i}].total_timeout"),
                Duration::from_secs(60),
            )
        });
        let total_refused = c.errors_found() > found;
        let hedge_delay = r
            .hedge_delay
            .as_ref()
            .and_then(|v| c.hedge_delay(v, format!("route[{i}].hedge_delay")));
        // (Against the timeouts as written: a refused one is left out, not judged as the
        // default in its place.)
        if let (Some(d), Some(v)) = (&hedge_delay, &r.hedge_delay)
            && !response_refused
        {
            let total = total_timeout.filter(|_| !total_refused);
            c.hedge_reachable(d, v, i, response_timeout, total);
        }
        // A hedge goes to another endpoint than the first copy's: a cluster of one address
        // (written once or more, and no host name that may resolve to more) would never
        // send one, and the route's setting would say it does.
        if let (Some(_), Some(v), Some(ci)) = (&hedge_delay, &r.hedge_delay, cluster)
            && let Some(cl) = clusters.get(ci)
            && cl.hostnames.is_empty()
            && cl.endpoints.iter().all(|a| *a == cl.endpoints[0])
        {
            c.err(
                Some(v.span()),
                format!("route[{i}].hedge_delay"),
                format!(
                    "a hedge goes to another endpoint than the first copy, and cluster `{}` has one",
                    cl.name
                ),
                Some("give the cluster a second endpoint, or remove hedge_delay"),
            );
        }
        // Two more ways a hedge written would never be sent: a cluster with no budget for
        // any, and a route whose every method may not be sent twice (without
        // `idempotent = true`).
        if let (Some(_), Some(v)) = (&hedge_delay, &r.hedge_delay) {
            if let Some(cl) = cluster.and_then(|ci| clusters.get(ci))
                && cl.hedge_budget_percent == 0
            {
                c.err(
                    Some(v.span()),
                    format!("route[{i}].hedge_delay"),
                    format!(
                        "cluster `{}` has hedge_budget_percent = 0: no hedge would ever be within its budget",
                        cl.name
                    ),
                    Some("raise the cluster's hedge_budget_percent (10 hedges at most one request in ten), or remove hedge_delay"),
                );
            }
            if !r.idempotent.unwrap_or(false)
                && !methods.is_empty()
                && !methods.iter().any(crate::pipeline::is_idempotent)
            {
                let list: Vec<&str> = methods.iter().map(http::Method::as_str).collect();
                c.err(
                    Some(v.span()),
                    format!("route[{i}].hedge_delay"),
                    format!(
                        "the route takes only {}, which may not be sent twice: none of its requests would be hedged",
                        list.join(", ")
                    ),
                    Some("set idempotent = true if its requests may be sent twice, or remove hedge_delay"),
                );
            }
        }
        let rewrite_prefix = c.rewrite_prefix(r, i, &path_prefix);
        let host_rewrite = c.host_rewrite(r, i);
        // Named whatever its cluster: a name used twice is reported with an unknown
        // cluster, not only once that is mended.
        let name = route_name(c, r, i, &mut route_names);
        if let Some(cluster) = cluster {
            routes.push(Route {
                name,
                tenant,
                host,
                path_prefix,
                methods,
                cluster,
                response_timeout,
                total_timeout,
                idempotent: r.idempotent.unwrap_or(false),
                hedge_delay,
                rewrite_prefix,
                host_rewrite,
            });
        }
    }

    let (admin, metrics) = super::admin::check(c, raw.admin.as_ref(), &raw.metrics);
    // The admin plane binds after the listeners: an address they took would stop the start.
    if let (Some(a), Some(raw_admin)) = (&admin, &raw.admin) {
        let this = Bound {
            addr: a.address,
            dual: true,
        };
        if let Some(b) = bound.iter().find(|b| clash(this, **b)).map(|b| b.addr) {
            c.err(
                Some(raw_admin.address.span()),
                "admin.address".into(),
                format!("{} is taken by a listener or demo ({b})", a.address),
                Some("give the admin plane its own port, e.g. \"127.0.0.1:9901\""),
            );
        }
    }

    Config {
        source: c.path.to_path_buf(),
        server,
        log,
        dns,
        demos,
        listeners,
        tenants,
        clusters,
        routes,
        admin,
        metrics,
    }
}

/// Pool settings that would make the warm keeper open connections in a loop, or rotate
/// connections faster than they can be opened.
fn pool_limits(c: &mut Checker<'_>, raw: &super::file::RawCluster, i: usize, cl: &Cluster) {
    // At the field that says it, else at the cluster's name.
    let warm_at = Some(
        raw.min_warm_connections
            .as_ref()
            .map_or_else(|| raw.name.span(), |m| m.span()),
    );
    // `max_idle_per_endpoint` bounds idle HTTP/1.1 connections only: an HTTP/2 cluster's
    // warm connections are shared, never idle in that list.
    if cl.protocol != crate::upstream::Protocol::Http2
        && cl.min_warm_connections > 0
        && cl.min_warm_connections > cl.max_idle_per_endpoint
    {
        c.err(
            warm_at.clone(),
            format!("cluster[{i}].min_warm_connections"),
            format!(
                "{} warm connections cannot be kept with max_idle_per_endpoint = {}",
                cl.min_warm_connections, cl.max_idle_per_endpoint
            ),
            Some("keep min_warm_connections at or below max_idle_per_endpoint"),
        );
    }
    if cl.protocol == crate::upstream::Protocol::Http2
        && let Some(m) = &raw.max_connections_per_endpoint
        && *m.get_ref() > 0
    {
        c.err(
            Some(m.span()),
            format!("cluster[{i}].max_connections_per_endpoint"),
            "caps HTTP/1.1 connections, and this cluster speaks HTTP/2 only (its requests share a few connections, bounded by the server's stream limit)".into(),
            Some("remove it, or cap the cluster's requests with max_requests"),
        );
    }
    if cl.protocol != crate::upstream::Protocol::Http2
        && cl.max_connections_per_endpoint > 0
        && cl.min_warm_connections > cl.max_connections_per_endpoint
    {
        c.err(
            warm_at.clone(),
            format!("cluster[{i}].min_warm_connections"),
            format!(
                "{} warm connections cannot be kept with max_connections_per_endpoint = {}",
                cl.min_warm_connections, cl.max_connections_per_endpoint
            ),
            Some("keep min_warm_connections at or below max_connections_per_endpoint"),
        );
    }
    // A spare that expires before the next is open keeps the keeper opening them without
    // a pause; one that expires within a tick of it, replacing them all at each tick.
    if cl.min_warm_connections > 0 && cl.idle_timeout < Duration::from_millis(100) {
        let idle_at = raw.idle_timeout.as_ref().map(|v| v.span()).or(warm_at);
        c.err(
            idle_at,
            format!("cluster[{i}].idle_timeout"),
            "warm connections with an idle timeout under 100ms would expire about as soon as they open, and be opened again without end".into(),
            Some("write an idle timeout such as \"4s\", or remove min_warm_connections"),
        );
    }
    if let (Some(life), Some(v)) = (cl.max_connection_lifetime, &raw.max_connection_lifetime)
        && life < Duration::from_millis(100)
    {
        c.err(
            Some(v.span()),
            format!("cluster[{i}].max_connection_lifetime"),
            format!("a lifetime of {life:?} would rotate connections as fast as they open"),
            Some("write at least \"100ms\"; minutes (\"5m\") are usual"),
        );
    }
}

/// How long an ejection lasts at first. Zero would end each at once with a probe due, so
/// a failing endpoint would be picked again after every failure: the opposite of ejecting.
fn eject_duration(c: &mut Checker<'_>, cl: &RawCluster, i: usize) -> Duration {
    let field = format!("cluster[{i}].eject_duration");
    let d = c.duration(&cl.eject_duration, field.clone(), Duration::from_secs(1));
    if let Some(v) = &cl.eject_duration
        && d < Duration::from_millis(1)
    {
        c.err(
            Some(v.span()),
            field,
            "an ejection this short ends at once, and the failing endpoint is probed after every failure".into(),
            Some("write a duration such as \"1s\"; to turn ejection off, set eject_after_failures = 0"),
        );
        return Duration::from_secs(1);
    }
    d
}

fn route_name(c: &mut Checker<'_>, r: &RawRoute, i: usize, seen: &mut HashSet<String>) -> String {
    let Some(n) = &r.name else {
        return format!("route{i}");
    };
    let name = n.get_ref().clone();
    if name.is_empty() || name.chars().count() > 128 || name.chars().any(|ch| ch.is_control()) {
        c.err(
            Some(n.span()),
            format!("route[{i}].name"),
            format!("`{name}` is not a usable name"),
            Some("write 1 to 128 printable characters, e.g. \"users-api\""),
        );
    } else if !seen.insert(name.clone()) {
        c.err(
            Some(n.span()),
            format!("route[{i}].name"),
            format!("route name `{name}` is used twice"),
            Some("give each route a unique name (an unnamed route N is named `routeN`)"),
        );
    }
    name
}

fn route_host(
    c: &mut Checker<'_>,
    r: &RawRoute,
    i: usize,
    tenant: Option<usize>,
    tenants: &[Tenant],
    owners: &HostOwners<'_>,
) -> Option<String> {
    let h = r.host.as_ref()?;
    let host = h.get_ref().to_ascii_lowercase();
    let wildcard = host.starts_with("*.");
    if wildcard || !valid_host_pattern(&host) {
        let (what, help) = if wildcard && valid_host_pattern(&host) {
            (
                "is a wildcard: a route's host is one exact host",
                "list the wildcard in a tenant's `hosts` and give the route that `tenant` (and no `host`), or write an exact host like \"api.example.com\"",
            )
        } else {
            (
                "is not a host name",
                "write an exact host like \"api.example.com\", without scheme or port",
            )
        };
        c.err(
            Some(h.span()),
            format!("route[{i}].host"),
            format!("`{}` {what}", h.get_ref()),
            Some(help),
        );
        return None;
    }
    if let Some(ti) = tenant
        && let Some(t) = tenants.get(ti)
    {
        match owners.owner(&host) {
            Some(owner) if owner == ti => {}
            // One of the tenant's patterns takes the host, but another tenant's takes it
            // first: requests for it are that tenant's, and the route would answer none.
            Some(owner) if t.hosts.iter().any(|p| host_matches(p, &host)) => c.err(
                Some(h.span()),
                format!("route[{i}].host"),
                format!(
                    "host `{host}` belongs to tenant `{}`, not `{}`: an exact host comes before a wildcard, and a longer wildcard before a shorter one",
                    tenants[owner].name, t.name
                ),
                Some(&format!(
                    "put the route under tenant `{}`, or add \"{host}\" to the hosts of tenant `{}`",
                    tenants[owner].name, t.name
                )),
            ),
            _ => c.err(Some(h.span()), format!("route[{i}].host"), format!("host `{host}` does not belong to tenant `{}`", t.name), Some("add the host to the tenant's hosts, or remove `host` to match all of the tenant's hosts")),
        }
    }
    Some(host)
}

/// The tenant whose hosts take a host (lower case), as requests are given to tenants
/// (`RouteTable::tenant_of_host`): an exact host first, else the longest matching
/// wildcard, the first in the config among equally long ones. Built once for every
/// route's host (looked up per route, a config's check stays linear in its exact hosts).
struct HostOwners<'a> {
    exact: HashMap<&'a str, usize>,
    /// Longest first; equally long ones in the config's order.
    wildcards: Vec<(&'a str, usize)>,
}

impl<'a> HostOwners<'a> {
    fn new(tenants: &'a [Tenant]) -> Self {
        let mut exact = HashMap::new();
        let mut wildcards = Vec::new();
        for (i, t) in tenants.iter().enumerate() {
            for h in &t.hosts {
                if h.starts_with("*.") {
                    wildcards.push((h.as_str(), i));
                } else {
                    exact.entry(h.as_str()).or_insert(i);
                }
            }
        }
        wildcards.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        HostOwners { exact, wildcards }
    }

    fn owner(&self, host: &str) -> Option<usize> {
        if let Some(&t) = self.exact.get(host) {
            return Some(t);
        }
        self.wildcards
            .iter()
            .find(|(p, _)| host_matches(p, host))
            .map(|&(_, t)| t)
    }
}

fn route_methods(c: &mut Checker<'_>, r: &RawRoute, i: usize) -> Vec<http::Method> {
    let Some(ms) = &r.methods else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (j, m) in ms.get_ref().iter().enumerate() {
        let upper = m.get_ref().to_ascii_uppercase();
        match http::Method::from_bytes(upper.as_bytes()) {
            // A tunnel: its 2xx turns the connection into raw bytes both ways, which a
            // route's exchange is not (nginx answers CONNECT `405`).
            Ok(method) if method == http::Method::CONNECT => c.err(
                Some(m.span()),
                format!("route[{i}].methods[{j}]"),
                "CONNECT (a tunnel) is not proxied; requests with it are answered 405".into(),
                Some("remove it (WebSocket upgrades go through a GET route)"),
            ),
            // Tokens a method may be, but meant as "every method" (API Gateway's `ANY`):
            // as methods, no request would ever have them.
            Ok(_) if ["*", "ANY", "ALL"].contains(&upper.as_str()) => c.err(
                Some(m.span()),
                format!("route[{i}].methods[{j}]"),
                format!(
                    "`{}` is no method a request has; it would match nothing",
                    m.get_ref()
                ),
                Some("remove `methods` to match every method"),
            ),
            Ok(method) if !upper.is_empty() => out.push(method),
            _ => c.err(
                Some(m.span()),
                format!("route[{i}].methods[{j}]"),
                format!("`{}` is not an HTTP method", m.get_ref()),
                Some("write a method such as \"GET\" or \"POST\""),
            ),
        }
    }
    if ms.get_ref().is_empty() {
        c.err(
            Some(ms.span()),
            format!("route[{i}].methods"),
            "empty list".into(),
            Some("remove `methods` to match every method"),
        );
    }
    out
}

/// A host pattern is a DNS-ish name, optionally starting with `*.`: labels of letters,
/// digits, `-` and `_`, none empty (no leading, trailing or doubled dot: a request's
/// `Host` is matched without its trailing dot) and none starting or ending with `-`.
fn valid_host_pattern(h: &str) -> bool {
    let name = h.strip_prefix("*.").unwrap_or(h);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Does the lower-case `host` match the `pattern` (exact, or `*.suffix` for subdomains)?
pub fn host_matches(pattern: &str, host: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            host.len() > suffix.len() + 1
                && host.ends_with(suffix)
                && host.as_bytes()[host.len() - suffix.len() - 1] == b'.'
        }
        None => pattern == host,
    }
}

fn resolve(base: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

fn list_or_none(names: &[&str]) -> String {
    if names.is_empty() {
        "(none defined)".to_owned()
    } else {
        names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What is wrong with `text` when it is its port: digits past the largest port (which
/// otherwise reads as "not an address", the host part blamed with it).
pub(super) fn port_out_of_range(text: &str) -> Option<String> {
    let (_, port) = text.rsplit_once(':')?;
    let digits = !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
    (digits && port.parse::<u16>().is_err())
        .then(|| format!("`{text}`: port {port} is out of range (ports go up to 65535)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_from_one() {
        let t = "a = 1\nbb = 2\n";
        assert_eq!(line_col(t, 0), (1, 1));
        assert_eq!(line_col(t, 6), (2, 1));
        assert_eq!(line_col(t, 9), (2, 4));
        // The checker's index gives the same, at every offset (past the end: the end).
        for t in [t, "a = \"é\"\n\nbb = 2\nc", ""] {
            let mut c = Checker {
                path: Path::new("t.toml"),
                text: t,
                errors: Vec::new(),
                line_starts: Vec::new(),
            };
            for offset in 0..=t.len() + 2 {
                if t.is_char_boundary(offset.min(t.len())) {
                    assert_eq!(c.line_col(offset), line_col(t, offset), "{t:?} at {offset}");
                }
            }
        }
    }

    fn errors_of(text: &str) -> String {
        match parse_and_validate(Path::new("t.toml"), text) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    const TAIL: &str = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n";

    /// HTTP/2 keepalive pings are off unless asked for (gRPC servers close connections that
    /// ping more than their policy allows); an interval written is taken.
    #[test]
    fn http2_keepalive_is_off_by_default() {
        let cluster = |extra: &str| {
            format!(
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nprotocol = \"http2\"\n{extra}"
            )
        };
        let cfg = parse_and_validate(Path::new("t.toml"), &cluster("")).expect("valid");
        assert_eq!(cfg.clusters[0].http2_keepalive_interval, None);
        let cfg = parse_and_validate(
            Path::new("t.toml"),
            &cluster("http2_keepalive_interval = \"30s\"\n"),
        )
        .expect("valid");
        assert_eq!(
            cfg.clusters[0].http2_keepalive_interval,
            Some(Duration::from_secs(30))
        );
        // Under a second, pings would follow each other at the round trip's pace.
        let errs = parse_and_validate(
            Path::new("t.toml"),
            &cluster("http2_keepalive_interval = \"1us\"\n"),
        )
        .expect_err("a flood of pings")
        .to_string();
        assert!(
            errs.contains("t.toml:7:28: cluster[0].http2_keepalive_interval: `1us` would ping the server about as fast as it answers"),
            "{errs}"
        );
    }

    /// The field an error of the TOML reader names is the key at its place: in an inline
    /// table after another key, in the second table of an inline array, on a table's
    /// header.
    #[test]
    fn a_reader_error_names_the_key_at_its_place() {
        for (text, want) in [
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\ntls = { cert = \"a.pem\", kee = \"b\" }\n".to_owned(),
                "t.toml:3:25: tls.kee: unknown field `kee`",
            ),
            (
                "listener = [ { address = \"127.0.0.1:1\" }, { address = \"127.0.0.1:2\", tls = { cert = \"a\", kee = \"b\" } } ]\n".to_owned(),
                ": listener.tls.kee: unknown field `kee`",
            ),
            (
                format!("[server]\nworkers = 2\n[server]\n{TAIL}"),
                "t.toml:3:2: server: ",
            ),
        ] {
            let errs = errors_of(&text);
            assert!(errs.contains(want), "{text}\n{errs}");
        }
    }

    /// A mistyped key is refused in every table, at its place, not taken silently (a
    /// `conect_timeout` would otherwise leave the default in force while `check` says ok).
    #[test]
    fn an_unknown_key_is_refused_in_every_table() {
        let route = "[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n";
        for (table, text) in [
            ("top level", format!("typo = 1\n{TAIL}")),
            ("server", format!("[server]\ntypo = 1\n{TAIL}")),
            ("log", format!("[log]\ntypo = 1\n{TAIL}")),
            (
                "admin",
                format!("[admin]\naddress = \"127.0.0.1:0\"\ntypo = 1\n{TAIL}"),
            ),
            ("metrics", format!("[metrics]\ntypo = 1\n{TAIL}")),
            ("dns", format!("[dns]\ntypo = 1\n{TAIL}")),
            (
                "demo",
                format!("[[demo]]\naddress = \"127.0.0.1:0\"\ntypo = 1\n{TAIL}"),
            ),
            (
                "listener",
                format!("[[listener]]\naddress = \"127.0.0.1:0\"\ntypo = 1\n{TAIL}"),
            ),
            (
                "listener.tls",
                format!(
                    "[[listener]]\naddress = \"127.0.0.1:0\"\n[listener.tls]\ncert = \"c\"\nkey = \"k\"\ntypo = 1\n{TAIL}"
                ),
            ),
            (
                "tenant",
                format!("[[tenant]]\nname = \"t\"\ntypo = 1\n{TAIL}"),
            ),
            ("cluster", format!("{TAIL}typo = 1\n")),
            ("route", format!("{TAIL}{route}typo = 1\n")),
        ] {
            let e = errors_of(&text);
            assert!(e.contains("unknown field `typo`"), "{table}: {e}");
            let line = text
                .lines()
                .position(|l| l == "typo = 1")
                .expect("typo line")
                + 1;
            assert!(e.contains(&format!("t.toml:{line}:1")), "{table}: {e}");
        }
    }

    /// A route whose host is refused gets that error alone, not also a duplicate's.
    #[test]
    fn a_refused_route_host_is_no_duplicate() {
        let route = |host: &str| format!("[[route]]\n{host}path_prefix = \"/\"\ncluster = \"c\"\n");
        let (plain, refused) = (route(""), route("host = \"a b\"\n"));
        // In either order.
        for text in [
            format!("{TAIL}{plain}{refused}"),
            format!("{TAIL}{refused}{plain}"),
        ] {
            let errs = errors_of(&text);
            assert!(errs.contains("is not a host name"), "{errs}");
            assert!(!errs.contains("duplicate"), "{errs}");
        }
    }

    /// What the TOML reader refuses gets a hint that, followed, makes valid TOML of the
    /// right shape.
    #[test]
    fn toml_errors_get_a_hint_that_fits_them() {
        for (text, want) in [
            (
                format!(
                    "{TAIL}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\nmethods = \"GET\"\n"
                ),
                "help: write a list in brackets",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\ntls = \"c.pem\"\n".to_owned(),
                "help: write a table here",
            ),
            (
                format!("{TAIL}[route]\npath_prefix = \"/\"\ncluster = \"c\"\n"),
                "help: write this table's header with double brackets",
            ),
            (
                format!("[server]\nmax_body_bytes = -1\n{TAIL}"),
                "t.toml:2:18: max_body_bytes: invalid value: integer `-1`, expected u64\n  help: write a number of 0 or more",
            ),
            (
                format!("[server]\nmax_header_bytes = -1\n{TAIL}"),
                "max_header_bytes: invalid value: integer `-1`, expected usize\n  help: write a number between 1024 and 1048576",
            ),
            (
                format!("[server]\nworkers = -2\n{TAIL}"),
                "help: write a number between 1 and 1024",
            ),
            (
                format!("[[cluster]]\nname = \"d\"\nendpoints = [\"127.0.0.1:1\"]\nretry_budget_percent = 4294967296\n{TAIL}"),
                "retry_budget_percent: invalid value: integer `4294967296`, expected u32\n  help: write a number between 0 and 100",
            ),
            (
                format!("[server]\nmax_body_bytes = 18446744073709551616\n{TAIL}"),
                "help: write a number of at most 18446744073709551615",
            ),
            // A u32 field the README gives no range for: the type's own; a number below
            // 0, however large, is told so.
            (
                format!("[[cluster]]\nname = \"d\"\nendpoints = [\"127.0.0.1:1\"]\neject_after_failures = 5000000000\n{TAIL}"),
                "eject_after_failures: invalid value: integer `5000000000`, expected u32\n  help: write a number of at most 4294967295",
            ),
            (
                format!("[server]\nmax_body_bytes = -99999999999999999999\n{TAIL}"),
                "help: write a number of 0 or more",
            ),
            // Past u64 (read as i128): the field's own range, or its type's largest.
            (
                format!("[[cluster]]\nname = \"d\"\nendpoints = [\"127.0.0.1:1\"]\neject_after_failures = 99999999999999999999\n{TAIL}"),
                "help: write a number of at most 4294967295",
            ),
            (
                format!("[[cluster]]\nname = \"d\"\nendpoints = [\"127.0.0.1:1\"]\nretry_budget_percent = 99999999999999999999\n{TAIL}"),
                "help: write a number between 0 and 100",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\ntls = { cert = \"a.pem\", key = 5 }\n".to_owned(),
                "t.toml:3:31: tls.key: invalid type: integer `5`, expected a string",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\n  \"127.0.0.1:1\",\n  8080,\n]\n".to_owned(),
                "t.toml:7:3: endpoints: invalid type: integer `8080`, expected a string",
            ),
            (
                format!("[[tenant]]\nname = \"\"\nhosts = []\n{TAIL}"),
                "tenant[0].name: must not be empty\n  help: write a name such as",
            ),
            // Errors the reader puts at a line's start name that line's key or table, not
            // the key of a line above.
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\ntimeout = \"5s\"\n"),
                ": timeout: unknown field `timeout`",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\npath_prefix = \"/a\"\n"),
                ": path_prefix: duplicate key",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\n".to_owned(),
                "t.toml:3:1: cluster: missing field `endpoints`",
            ),
            (
                format!("{TAIL}[route]\npath_prefix = \"/\"\ncluster = \"c\"\n"),
                ": route: invalid type",
            ),
            // A table of one given as a string, or as a list: said as a table, with a
            // hint that fits it.
            (
                format!("admin = \"127.0.0.1:9901\"\n{TAIL}"),
                "t.toml:1:9: admin: invalid type: string \"127.0.0.1:9901\", expected a table\n  help: write a table here: a header such as [admin]",
            ),
            (
                format!("[[server]]\nworkers = 1\n{TAIL}"),
                "t.toml:1:1: server: invalid type: map, expected usize\n  help: write this table's header with single brackets",
            ),
        ] {
            let errs = errors_of(&text);
            assert!(errs.contains(want), "{text}\n{errs}");
        }
    }

    /// A TRACE-only route beside a route without `methods` (which takes every method but
    /// TRACE) is no duplicate; beside one that lists GET, neither.
    #[test]
    fn a_trace_route_beside_an_any_method_route_is_no_duplicate() {
        let text = format!(
            "{TAIL}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n[[route]]\npath_prefix = \"/\"\nmethods = [\"TRACE\"]\ncluster = \"c\"\n"
        );
        assert_eq!(errors_of(&text), "");
        let text = format!(
            "{TAIL}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n[[route]]\npath_prefix = \"/\"\nmethods = [\"GET\"]\ncluster = \"c\"\n"
        );
        assert!(errors_of(&text).contains("duplicate route"));
    }

    /// A route without `methods` after one of the same prefix that lists some takes the
    /// other methods: no duplicate. Before it, it would take them all: a duplicate.
    #[test]
    fn a_catch_all_after_a_method_route_is_no_duplicate() {
        let get = "[[route]]\npath_prefix = \"/x/\"\nmethods = [\"GET\"]\ncluster = \"c\"\n";
        let any = "[[route]]\npath_prefix = \"/x/\"\ncluster = \"c\"\n";
        assert_eq!(errors_of(&format!("{TAIL}{get}{any}")), "");
        let errs = errors_of(&format!("{TAIL}{any}{get}"));
        assert!(errs.contains("route[1]: duplicate route"), "{errs}");
        let errs = errors_of(&format!("{TAIL}{get}{any}{any}"));
        assert!(errs.contains("route[2]: duplicate route"), "{errs}");
    }

    /// Routes alike but for their host are no duplicates; a third like the first is, and
    /// names the first's line, past the second.
    #[test]
    fn routes_are_duplicates_only_of_their_own_host() {
        let route = |host: &str| {
            format!("[[route]]\nhost = \"{host}\"\npath_prefix = \"/\"\ncluster = \"c\"\n")
        };
        let two = format!("{TAIL}{}{}", route("a.test"), route("b.test"));
        assert_eq!(errors_of(&two), "");
        // (The line of the first route's `path_prefix`.)
        let first_line = TAIL.lines().count() + 3;
        let three = format!("{two}{}", route("a.test"));
        let errs = errors_of(&three);
        assert!(
            errs.contains(&format!(
                "route[2]: duplicate route: the same host (or, without one, tenant), path_prefix `/` and methods as the route at line {first_line},"
            )),
            "{errs}"
        );
    }

    /// Prefixes in normal form, the last segment possibly cut short, are accepted.
    #[test]
    fn prefixes_in_normal_form_are_accepted() {
        for prefix in [
            "/",
            "/api/",
            "/api/v",
            "/static/.",
            "/a.b/",
            "/x:",
            "/~u/",
            // Non-ASCII, escaped as requests are matched (raw, `check` asks for this).
            "/caf%C3%A9/",
            // What some clients send as it is, and requests hold so.
            "/a|b",
            "/x[1]",
            "/api/{v}",
        ] {
            let text = format!("{TAIL}[[route]]\npath_prefix = \"{prefix}\"\ncluster = \"c\"\n");
            assert_eq!(errors_of(&text), "", "{prefix}");
        }
    }

    /// Values that parse but cannot work at run time, refused with their place and what to
    /// write instead.
    #[test]
    fn values_that_cannot_work_are_refused() {
        for (text, want) in [
            (
                format!("[server]\nrequest_id_header = \"content-length\"\n{TAIL}"),
                "t.toml:2:21: server.request_id_header: `content-length` frames, routes or is removed",
            ),
            (
                format!("[server]\nrequest_id_header = \"X-Forwarded-For\"\n{TAIL}"),
                "server.request_id_header: `X-Forwarded-For` frames",
            ),
            (
                format!("[server]\nrequest_id_header = \"x-forwarded-prefix\"\n{TAIL}"),
                "server.request_id_header: `x-forwarded-prefix` frames",
            ),
            (
                format!("[server]\nrequest_id_header = \"Cookie\"\n{TAIL}"),
                "server.request_id_header: `Cookie` frames, routes or is removed from every message, is set by the gateway, carries credentials, or means something",
            ),
            (
                format!("[server]\nrequest_id_header = \"Location\"\n{TAIL}"),
                "server.request_id_header: `Location` frames, routes or is removed from every message, is set by the gateway, carries credentials, or means something of its own that the id would overwrite",
            ),
            (
                format!("[server]\nrequest_id_header = \"sec-websocket-accept\"\n{TAIL}"),
                "server.request_id_header: `sec-websocket-accept` frames",
            ),
            // A client's key would be kept as its id, and written in every access log line.
            (
                format!("[server]\nrequest_id_header = \"X-Api-Key\"\n{TAIL}"),
                "server.request_id_header: `X-Api-Key` frames",
            ),
            (
                format!("[server]\nrequest_id_header = \"user-agent\"\n{TAIL}"),
                "server.request_id_header: `user-agent` frames",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"999.1.1.1:80\"]\n".to_owned(),
                "cluster[0].endpoints[0]: `999.1.1.1:80` is not an address",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:70000\"\n".to_owned(),
                "t.toml:2:11: listener[0].address: `127.0.0.1:70000`: port 70000 is out of range (ports go up to 65535)",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"[::1]:65536\", \"api.internal:99999\"]\n".to_owned(),
                "cluster[0].endpoints[0]: `[::1]:65536`: port 65536 is out of range",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"api.internal:99999\"]\n".to_owned(),
                "cluster[0].endpoints[0]: `api.internal:99999`: port 99999 is out of range",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"1.2.3:80\"]\n".to_owned(),
                "cluster[0].endpoints[0]: `1.2.3:80` is not an address",
            ),
            (
                format!("[dns]\nnameservers = [\"10.0.0.2:0\"]\n{TAIL}"),
                "t.toml:2:16: dns.nameservers[0]: port 0 is no name server's",
            ),
            (
                format!("[dns]\nnameservers = [\"224.0.0.1\"]\n{TAIL}"),
                "dns.nameservers[0]: `224.0.0.1` is not one server: a broadcast or multicast",
            ),
            (
                format!("[dns]\nnameservers = [\"0.0.0.0\"]\n{TAIL}"),
                "dns.nameservers[0]: `0.0.0.0` is not one server: an unspecified address",
            ),
            (
                format!("[dns]\nnameservers = [\"[fe80::1]:53\"]\n{TAIL}"),
                "dns.nameservers[0]: `[fe80::1]:53` is link-local: the resolver cannot send to an interface's link-local address",
            ),
            (
                format!("[metrics]\nmax_consumers = -1\n{TAIL}"),
                "help: write a number between 1 and 1000000",
            ),
            (
                format!("[[tenant]]\nname = \"t\"\nhosts = [\"a.com\"]\n{TAIL}[[route]]\ntenant = \"t\"\nhost = \"a.com\"\npath_prefix = \"/\"\ncluster = \"c\"\n[[route]]\nhost = \"a.com\"\npath_prefix = \"/\"\ncluster = \"c\"\n"),
                "route[1]: duplicate route: the same host (or, without one, tenant), path_prefix `/` and methods as the route at line 12",
            ),
            (
                format!("[[tenant]]\nname = \"t\"\nhosts = [\"a.com\", \"A.com\"]\n{TAIL}"),
                "tenant[0].hosts[1]: host `a.com` is listed twice",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n[[route]]\nhost = \"a b\"\npath_prefix = \"/\"\ncluster = \"c\"\n"),
                "route[1].host: `a b` is not a host name",
            ),
            (
                format!("{TAIL}[[route]]\nhost = \"*.a.test\"\npath_prefix = \"/\"\ncluster = \"c\"\n"),
                "route[0].host: `*.a.test` is a wildcard: a route's host is one exact host",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/\"\nmethods = [\"GET\", \"any\"]\ncluster = \"c\"\n"),
                "route[0].methods[1]: `any` is no method a request has; it would match nothing",
            ),
            (
                format!("[server]\nmax_body_bytes = \"10m\"\n{TAIL}"),
                "help: write a number of bytes without quotes and without a unit, e.g. 10485760",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a b\"\ncluster = \"c\"\n"),
                "t.toml:7:15: route[0].path_prefix: `/a b` has a space, which no request path holds as it is",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/caf\u{e9}?x\"\ncluster = \"c\"\n"),
                "has `?`, which no request path holds as it is",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a<b>\"\ncluster = \"c\"\n"),
                "help: percent-encode it",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:0\", \"0.0.0.0:80\", \"224.0.0.1:80\"]\n".to_owned(),
                "cluster[0].endpoints[0]: `127.0.0.1:0`: port 0",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"0.0.0.0:80\"]\n".to_owned(),
                "`0.0.0.0:80`: an unspecified address",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"[::ffff:0.0.0.0]:80\"]\n".to_owned(),
                "`[::ffff:0.0.0.0]:80`: an unspecified address",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"224.0.0.1:80\"]\n".to_owned(),
                "`224.0.0.1:80`: a broadcast or multicast address",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"[fe80::1]:80\"]\n".to_owned(),
                "cluster[0].endpoints[0]: `[fe80::1]:80` is link-local, with no interface named\n  help: add its interface, by name or index: \"[fe80::1%eth0]:80\"",
            ),
            (
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"\"\nendpoints = [\"127.0.0.1:1\"]\n".to_owned(),
                "t.toml:4:8: cluster[0].name: must not be empty",
            ),
            (
                format!("[[listener]]\nname = \"\"\naddress = \"127.0.0.1:1\"\n{TAIL}"),
                "t.toml:2:8: listener[0].name: must not be empty",
            ),
            (
                format!("[[listener]]\nname = \"a\"\naddress = \"127.0.0.1:1\"\n[[listener]]\nname = \"a\"\naddress = \"127.0.0.1:2\"\n{TAIL}"),
                "listener[1].name: listener `a` is defined twice (also listener[0])",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a//b/\"\ncluster = \"c\"\n"),
                "t.toml:7:15: route[0].path_prefix: `/a//b/` is not in normal form",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/%7Euser/./x\"\ncluster = \"c\"\n"),
                "help: write \"/~user/x\"",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/é/\"\ncluster = \"c\"\n"),
                "help: write \"/%C3%A9/\"",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/../x\"\ncluster = \"c\"\n"),
                "route[0].path_prefix: `/../x` climbs above `/`",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a%2fb\"\ncluster = \"c\"\n"),
                "help: write \"/a/b\"",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a;v=1/b/\"\ncluster = \"c\"\n"),
                "help: write \"/a/b/\"",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/box;v=2\"\ncluster = \"c\"\n"),
                "help: write \"/box\"",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a//../b\"\ncluster = \"c\"\n"),
                "`/a//../b` has a `..` that takes off an empty segment",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a/..;v=1/b\"\ncluster = \"c\"\n"),
                "`/a/..;v=1/b` has a `.` or `..` segment with `;` parameters",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/v1/items%3Apurge\"\ncluster = \"c\"\n"),
                "help: write \"/v1/items:purge\"",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/a;p=%2F../b\"\ncluster = \"c\"\n"),
                "`/a;p=%2F../b` has a `;` parameter with an encoded slash or a backslash in it",
            ),
            (
                format!("{TAIL}[[route]]\npath_prefix = \"/100%/\"\ncluster = \"c\"\n"),
                "`/100%/` has a `%` not followed by two hex digits",
            ),
            (
                format!("[[tenant]]\nname = \"t\"\nhosts = [\"api.test.\"]\n{TAIL}"),
                "tenant[0].hosts[0]: `api.test.` is not a host name",
            ),
            (
                format!("[[tenant]]\nname = \"t\"\nhosts = [\"a..b\"]\n{TAIL}"),
                "`a..b` is not a host name",
            ),
            (
                format!("[[tenant]]\nname = \"t\"\nhosts = [\"-\"]\n{TAIL}"),
                "`-` is not a host name",
            ),
            (
                format!("[admin]\naddress = \"[fe80::1]:9901\"\n{TAIL}"),
                "t.toml:2:11: admin.address: `[fe80::1]:9901` is link-local, with no interface named",
            ),
            (
                format!("[[demo]]\naddress = \"[fe80::1]:9902\"\n{TAIL}"),
                "demo[0].address: `[fe80::1]:9902` is link-local",
            ),
            (
                format!("[[listener]]\naddress = \"127.0.0.1:1\"\ntls = {{ cert = \".\", key = \".\" }}\n{TAIL}"),
                "is a directory, not a file",
            ),
            // Not "no such file: " with no name, nor the config's directory.
            (
                format!("[[listener]]\naddress = \"127.0.0.1:1\"\ntls = {{ cert = \"\", key = \" \" }}\n{TAIL}"),
                "t.toml:3:16: listener[0].tls.cert: the path is empty",
            ),
            (
                format!("[server]\nworkers = \"2\"\n{TAIL}"),
                "t.toml:2:11: workers: invalid type: string \"2\", expected usize\n  help: write this value without quotes",
            ),
        ] {
            let errs = errors_of(&text);
            assert!(errs.contains(want), "missing {want:?} for:\n{text}\ngot:\n{errs}");
        }
    }

    /// A hedge on a route whose cluster has one address would never be sent: refused.
    #[test]
    fn a_hedge_with_no_other_endpoint_is_refused() {
        let base = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\n";
        let route = "[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\nhedge_delay = \"50ms\"\n";
        let one = format!("{base}endpoints = [\"127.0.0.1:1\", \"127.0.0.1:1\"]\n{route}");
        let errs = Config::parse(Path::new("t.toml"), &one)
            .expect_err("no other endpoint")
            .to_string();
        assert!(
            errs.contains("t.toml:9:15: route[0].hedge_delay: a hedge goes to another endpoint than the first copy, and cluster `c` has one"),
            "{errs}"
        );
        for endpoints in [
            "[\"127.0.0.1:1\", \"127.0.0.1:2\"]",
            "[\"api.internal:80\"]",
        ] {
            let two = format!("{base}endpoints = {endpoints}\n{route}");
            Config::parse(Path::new("t.toml"), &two).expect("another endpoint, or a name");
        }
    }

    /// A hedge that could never be sent is refused: the cluster allows no hedges
    /// (`hedge_budget_percent = 0`), or the route takes only methods that may not be sent
    /// twice and is not `idempotent`. Either alone, with the other mended, is taken.
    #[test]
    fn a_hedge_that_would_never_be_sent_is_refused() {
        let cluster = |extra: &str| {
            format!(
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\n{extra}"
            )
        };
        let route = |extra: &str| {
            format!(
                "[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\nhedge_delay = \"50ms\"\n{extra}"
            )
        };
        let errs = errors_of(&format!(
            "{}{}",
            cluster("hedge_budget_percent = 0\n"),
            route("")
        ));
        assert!(
            errs.contains("t.toml:10:15: route[0].hedge_delay: cluster `c` has hedge_budget_percent = 0: no hedge would ever be within its budget"),
            "{errs}"
        );
        let errs = errors_of(&format!(
            "{}{}",
            cluster(""),
            route("methods = [\"POST\", \"PATCH\"]\n")
        ));
        assert!(
            errs.contains("t.toml:9:15: route[0].hedge_delay: the route takes only POST, PATCH, which may not be sent twice"),
            "{errs}"
        );
        assert!(errs.contains("set idempotent = true"), "{errs}");
        for ok in [
            format!("{}{}", cluster("hedge_budget_percent = 1\n"), route("")),
            format!(
                "{}{}",
                cluster(""),
                route("methods = [\"POST\"]\nidempotent = true\n")
            ),
            format!(
                "{}{}",
                cluster(""),
                route("methods = [\"POST\", \"GET\"]\n")
            ),
        ] {
            assert_eq!(errors_of(&ok), "", "{ok}");
        }
    }

    /// `max_idle_per_endpoint` bounds idle HTTP/1.1 connections only: warm HTTP/2
    /// connections with it at 0 are fine.
    #[test]
    fn http2_warm_connections_ignore_the_idle_limit() {
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nprotocol = \"http2\"\nmax_idle_per_endpoint = 0\nmin_warm_connections = 2\n";
        assert_eq!(errors_of(text), "");
    }

    /// Warm spares take places under `max_connections_per_endpoint`: more than it cannot be
    /// kept. An HTTP/2 cluster's connections are not under it: it is refused there.
    #[test]
    fn warm_spares_past_max_connections_per_endpoint_are_refused() {
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nmax_connections_per_endpoint = 2\nmin_warm_connections = 3\n";
        assert!(
            errors_of(text).contains("t.toml:7:24: cluster[0].min_warm_connections: 3 warm connections cannot be kept with max_connections_per_endpoint = 2"),
            "{}",
            errors_of(text)
        );
        assert_eq!(errors_of(&text.replace("= 3", "= 2")), "");
        let h2 = errors_of(&format!("{text}protocol = \"http2\"\n"));
        assert!(
            h2.contains(
                "t.toml:6:32: cluster[0].max_connections_per_endpoint: caps HTTP/1.1 connections"
            ),
            "{h2}"
        );
        assert!(!h2.contains("min_warm_connections"), "{h2}");
    }

    /// An endpoint that is the gateway's own listener would send each request back to the
    /// gateway, to be routed there again: refused, where the listener is (on its address,
    /// or a wildcard one on its port reached over loopback). A demo's address is an
    /// endpoint as intended, and another port or another family is no loop.
    #[test]
    fn an_endpoint_that_is_the_gateways_own_listener_is_refused() {
        for (listener, endpoint) in [
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("0.0.0.0:8080", "127.0.0.1:8080"),
            ("0.0.0.0:8080", "127.0.0.2:8080"),
            ("[::]:8080", "[::1]:8080"),
            ("127.0.0.1:8080", "[::ffff:127.0.0.1]:8080"),
        ] {
            let text = format!(
                "[[listener]]\naddress = \"{listener}\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:9000\", \"{endpoint}\"]\n"
            );
            let errs = errors_of(&text);
            assert!(
                errs.contains(&format!("t.toml:5:32: cluster[0].endpoints[1]: `{endpoint}` is this gateway's own listener ({listener})")),
                "{listener} {endpoint}: {errs}"
            );
            assert!(
                errs.contains("write the address of the upstream server"),
                "{errs}"
            );
        }
        for (listener, endpoint) in [
            ("127.0.0.1:8080", "127.0.0.1:8081"),
            ("127.0.0.1:8080", "127.0.0.2:8080"),
            ("[::]:8080", "127.0.0.1:8080"),
            ("127.0.0.1:0", "127.0.0.1:8080"),
        ] {
            let text = format!(
                "[[listener]]\naddress = \"{listener}\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:9000\", \"{endpoint}\"]\n"
            );
            parse_and_validate(Path::new("t.toml"), &text)
                .unwrap_or_else(|e| panic!("{listener} {endpoint}: {e}"));
        }
        let demo = "[[demo]]\naddress = \"127.0.0.1:8081\"\n[[listener]]\naddress = \"127.0.0.1:8080\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:8081\"]\n";
        parse_and_validate(Path::new("t.toml"), demo).expect("a demo is an upstream");
    }

    #[test]
    fn pool_settings_that_would_loop_are_refused() {
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nmin_warm_connections = 4\nmax_idle_per_endpoint = 2\nmax_connection_lifetime = \"0s\"\n";
        let errs = parse_and_validate(Path::new("t.toml"), text)
            .expect_err("looping pool")
            .to_string();
        assert!(errs.contains("t.toml:6:24: cluster[0].min_warm_connections: 4 warm connections cannot be kept with max_idle_per_endpoint = 2"), "{errs}");
        assert!(
            errs.contains(
                "t.toml:8:27: cluster[0].max_connection_lifetime: a lifetime of 0ns would rotate"
            ),
            "{errs}"
        );
        // Spares that expire about as soon as they open.
        for idle in ["0s", "1ns", "50ms"] {
            let text = format!(
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nmin_warm_connections = 1\nidle_timeout = \"{idle}\"\n"
            );
            let errs = parse_and_validate(Path::new("t.toml"), &text)
                .expect_err("looping keeper")
                .to_string();
            assert!(errs.contains("t.toml:7:16: cluster[0].idle_timeout: warm connections with an idle timeout under 100ms"), "{idle}: {errs}");
        }
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nmin_warm_connections = 1\nidle_timeout = \"100ms\"\n";
        parse_and_validate(Path::new("t.toml"), text).expect("100ms is enough");
    }

    #[test]
    fn settings_that_validate_but_cannot_start_are_refused() {
        let text = r#"[server]
header_read_timeout = "0s"
[admin]
address = "0.0.0.0:8080"
[[listener]]
address = "127.0.0.1:8080"
[[listener]]
address = "[::ffff:127.0.0.1]:8081"
[[listener]]
address = "[fe80::1]:8082"
[[demo]]
address = "[::ffff:127.0.0.1]:8083"
[[cluster]]
name = "c"
endpoints = ["127.0.0.1:1"]
connect_timeout = "0ms"
retry_budget_percent = 150
[[route]]
path_prefix = "/"
cluster = "c"
response_timeout = "0s"
[[listener]]
address = "224.0.0.1:8084"
[[listener]]
address = "255.255.255.255:8085"
[[listener]]
address = "[ff02::1]:8086"
[[cluster]]
name = "d"
endpoints = ["127.0.0.1:2"]
connect_timeout = "500us"
eject_duration = "0s"
[[route]]
path_prefix = "/d/"
cluster = "d"
total_timeout = "999us"
"#;
        let errs = parse_and_validate(Path::new("t.toml"), text)
            .expect_err("unstartable")
            .to_string();
        for want in [
            "t.toml:2:23: server.header_read_timeout: a timeout of 0 would cut everything off at once",
            "t.toml:4:11: admin.address: 0.0.0.0:8080 is taken by a listener or demo (127.0.0.1:8080)",
            "t.toml:8:11: listener[1].address: `[::ffff:127.0.0.1]:8081` is an IPv4 address written as IPv6",
            "write it as IPv4: \"127.0.0.1:8081\"",
            "t.toml:10:11: listener[2].address: `[fe80::1]:8082` is link-local, with no interface named",
            "t.toml:16:19: cluster[0].connect_timeout: a timeout of 0",
            "t.toml:17:24: cluster[0].retry_budget_percent: must be between 0 and 100",
            "t.toml:21:20: route[0].response_timeout: a timeout of 0",
            "t.toml:23:11: listener[3].address: `224.0.0.1:8084` is a multicast address",
            "t.toml:25:11: listener[4].address: `255.255.255.255:8085` is the broadcast address",
            "t.toml:27:11: listener[5].address: `[ff02::1]:8086` is a multicast address",
            "help: write one of this host's own addresses, or 0.0.0.0 for all of them",
            "t.toml:31:19: cluster[1].connect_timeout: a timeout of 500us is shorter than the timers' 1ms tick",
            "help: write at least \"1ms\", e.g. \"2s\"",
            "t.toml:32:18: cluster[1].eject_duration: an ejection this short ends at once",
            "help: write a duration such as \"1s\"; to turn ejection off, set eject_after_failures = 0",
            "t.toml:36:17: route[1].total_timeout: a timeout of 999us is shorter",
        ] {
            assert!(errs.contains(want), "missing {want:?} in:\n{errs}");
        }
        // A demo binds dual-stack: an IPv4-mapped address is fine there.
        assert!(!errs.contains("demo[0]"), "{errs}");
    }

    /// A link-local endpoint with its interface's index is taken as written.
    #[test]
    fn a_link_local_endpoint_with_its_zone_is_accepted() {
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"[fe80::1%2]:80\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n";
        let config = parse_and_validate(Path::new("t.toml"), text)
            .unwrap_or_else(|e| panic!("refused: {e}"));
        let want: SocketAddr = "[fe80::1%2]:80".parse().expect("an address");
        assert_eq!(config.clusters[0].endpoints, [want]);
        assert_eq!(
            config.clusters[0].endpoints[0].to_string(),
            "[fe80::1%2]:80"
        );
    }

    /// A link-local address's zone may name its interface, as `ping` and `ip` take it: the
    /// interface's index is looked up at load, for an endpoint and a listener alike. An
    /// interface this machine lacks is an error at the zone's line, not a failed bind or
    /// connect later.
    #[test]
    fn a_link_local_zone_names_its_interface() {
        // Linux gives the loopback interface index 1 in every network namespace.
        let lo = 1;
        let text = "[[listener]]\naddress = \"[fe80::1%lo]:8080\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"[fe80::2%lo]:80\"]\n[[cluster]]\nname = \"t\"\nendpoints = [\"https://[fe80::3%lo]:443\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n";
        let config = parse_and_validate(Path::new("t.toml"), text)
            .unwrap_or_else(|e| panic!("refused: {e}"));
        let v6 = |a: &SocketAddr| match a {
            SocketAddr::V6(v6) => (v6.ip().to_string(), v6.port(), v6.scope_id()),
            SocketAddr::V4(_) => panic!("{a} is IPv4"),
        };
        assert_eq!(
            v6(&config.listeners[0].address),
            ("fe80::1".into(), 8080, lo)
        );
        assert_eq!(
            v6(&config.clusters[0].endpoints[0]),
            ("fe80::2".into(), 80, lo)
        );
        assert_eq!(
            v6(&config.clusters[1].endpoints[0]),
            ("fe80::3".into(), 443, lo)
        );

        let errs = parse_and_validate(
            Path::new("t.toml"),
            "[[listener]]\naddress = \"[fe80::1%nosuch9]:8080\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"[fe80::2%nosuch9]:80\", \"[fe80::2%../lo]:80\"]\n",
        )
        .expect_err("no such interface")
        .to_string();
        for want in [
            "t.toml:2:11: listener[0].address: `[fe80::1%nosuch9]:8080`: this machine has no interface `nosuch9`\n  help: name an interface this machine has, or its index",
            "t.toml:5:14: cluster[0].endpoints[0]: `[fe80::2%nosuch9]:80`: this machine has no interface `nosuch9`",
            "cluster[0].endpoints[1]: `[fe80::2%../lo]:80` is not an address",
        ] {
            assert!(errs.contains(want), "missing {want:?} in:\n{errs}");
        }
        // A link-local name server, even with its interface: the resolver sends to the
        // address alone, which the kernel refuses without one.
        let errs = parse_and_validate(
            Path::new("t.toml"),
            &format!("[dns]\nnameservers = [\"[fe80::1%lo]:53\"]\n{TAIL}"),
        )
        .expect_err("a link-local name server")
        .to_string();
        assert!(
            errs.contains("t.toml:2:16: dns.nameservers[0]: `[fe80::1%lo]:53` is link-local"),
            "{errs}"
        );
    }

    /// The admin socket and demos are dual-stack, listeners bind IPv6 IPv6-only: `[::]:P`
    /// beside an IPv4 admin address on P starts; an IPv4-mapped admin address is its IPv4
    /// one; a demo on `[::]:P` takes IPv4 too.
    #[test]
    fn admin_clashes_follow_the_address_families() {
        let demo = |admin: &str, demo: &str| {
            format!(
                "[admin]\naddress = \"{admin}\"\n[[demo]]\naddress = \"{demo}\"\n[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n"
            )
        };
        assert!(
            parse_and_validate(Path::new("t.toml"), &demo("127.0.0.1:9904", "[::]:9904")).is_err()
        );
        assert!(
            parse_and_validate(Path::new("t.toml"), &demo("127.0.0.1:9905", "[::1]:9905")).is_ok()
        );
        let errs = parse_and_validate(
            Path::new("t.toml"),
            "[[demo]]\naddress = \"[::]:9906\"\n[[listener]]\naddress = \"0.0.0.0:9906\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n",
        )
        .expect_err("the demo takes IPv4 too")
        .to_string();
        assert!(
            errs.contains("listener[0].address: address 0.0.0.0:9906 overlaps [::]:9906"),
            "{errs}"
        );
        let cfg = |admin: &str, listener: &str| {
            format!(
                "[admin]\naddress = \"{admin}\"\n[[listener]]\naddress = \"{listener}\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n"
            )
        };
        assert!(parse_and_validate(Path::new("t.toml"), &cfg("0.0.0.0:9901", "[::]:9901")).is_ok());
        let errs = parse_and_validate(
            Path::new("t.toml"),
            &cfg("[::ffff:127.0.0.1]:9902", "127.0.0.1:9902"),
        )
        .expect_err("the same socket")
        .to_string();
        assert!(
            errs.contains("admin.address: [::ffff:127.0.0.1]:9902 is taken"),
            "{errs}"
        );
        assert!(
            parse_and_validate(Path::new("t.toml"), &cfg("[::]:9903", "127.0.0.1:9903")).is_err(),
            "a dual-stack [::] takes IPv4 too"
        );
    }

    /// A listener's certificate and key are read by `check`, not first by `serve`.
    #[test]
    fn unreadable_listener_certificates_are_refused() {
        let dir = tempfile::Builder::new()
            .prefix("tailgate-config-")
            .tempdir()
            .expect("dir");
        std::fs::write(dir.path().join("empty.pem"), "").expect("write");
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\ntls = { cert = \"empty.pem\", key = \"empty.pem\" }\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n";
        let errs = parse_and_validate(&dir.path().join("t.toml"), text)
            .expect_err("no certificate")
            .to_string();
        // (An empty file holds no certificate: found first, where the certificate is
        // written.)
        assert!(
            errs.contains(":3:16: listener[0].tls: no certificate in "),
            "{errs}"
        );
        // A key that cannot be read is pointed at where the key is written.
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert");
        std::fs::write(dir.path().join("cert.pem"), cert.cert.pem()).expect("write");
        let text = text.replace("\"empty.pem\"", "\"cert.pem\"");
        let errs = parse_and_validate(&dir.path().join("t.toml"), &text)
            .expect_err("no key")
            .to_string();
        let col = text
            .lines()
            .nth(2)
            .and_then(|l| l.find("\"cert.pem\" }"))
            .expect("key")
            + 1;
        assert!(
            errs.contains(&format!(
                ":3:{col}: listener[0].tls: cannot read the private key"
            )),
            "{errs}"
        );
    }

    #[test]
    fn an_explicit_route_name_cannot_take_a_default_one() {
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n[[route]]\nname = \"route1\"\npath_prefix = \"/a\"\ncluster = \"c\"\n[[route]]\npath_prefix = \"/b\"\ncluster = \"c\"\n";
        let errs = parse_and_validate(Path::new("t.toml"), text)
            .expect_err("duplicate label")
            .to_string();
        assert!(
            errs.contains("t.toml:7:8: route[0].name: route name `route1` is used twice"),
            "{errs}"
        );
    }

    /// Every mistake at once: a route name used twice is reported beside the unknown
    /// cluster of one of the routes, not only once that is mended.
    #[test]
    fn a_route_name_used_twice_is_reported_with_an_unknown_cluster() {
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n[[route]]\nname = \"a\"\npath_prefix = \"/x\"\ncluster = \"nope\"\n[[route]]\nname = \"a\"\npath_prefix = \"/y\"\ncluster = \"c\"\n";
        let errs = parse_and_validate(Path::new("t.toml"), text)
            .expect_err("two mistakes")
            .to_string();
        assert!(errs.contains("no cluster named"), "{errs}");
        assert!(
            errs.contains("t.toml:11:8: route[1].name: route name `a` is used twice"),
            "{errs}"
        );
    }

    /// A route name is limited to 128 characters, as the README says, not 128 bytes.
    #[test]
    fn a_route_name_counts_characters() {
        let with = |name: &str| {
            format!(
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n[[route]]\nname = \"{name}\"\npath_prefix = \"/a\"\ncluster = \"c\"\n"
            )
        };
        let config = parse_and_validate(Path::new("t.toml"), &with(&"€".repeat(128)))
            .unwrap_or_else(|e| panic!("128 characters (384 bytes): {e}"));
        assert_eq!(config.routes[0].name.chars().count(), 128);
        let errs = parse_and_validate(Path::new("t.toml"), &with(&"€".repeat(129)))
            .expect_err("129 characters")
            .to_string();
        assert!(errs.contains("route[0].name: `"), "{errs}");
    }

    /// A route's host is its tenant's only if that tenant takes it as requests are given
    /// to tenants: an exact host first, else the longest wildcard. A route under a tenant
    /// whose wildcard another tenant's host outranks would answer every request `421`.
    #[test]
    fn a_route_host_is_its_tenants_only_if_no_other_tenant_takes_it_first() {
        let cfg = |tenant: &str, host: &str| {
            format!(
                "[[tenant]]\nname = \"acme\"\nhosts = [\"*.example.com\"]\n[[tenant]]\nname = \"eu\"\nhosts = [\"*.eu.example.com\", \"shop.example.com\"]\n{TAIL}[[route]]\ntenant = \"{tenant}\"\nhost = \"{host}\"\npath_prefix = \"/\"\ncluster = \"c\"\n"
            )
        };
        for (tenant, host) in [
            ("acme", "www.example.com"),
            ("eu", "api.eu.example.com"),
            ("eu", "shop.example.com"),
        ] {
            let errs = errors_of(&cfg(tenant, host));
            assert!(errs.is_empty(), "{tenant} {host}: {errs}");
        }
        for host in ["api.eu.example.com", "shop.example.com"] {
            let errs = errors_of(&cfg("acme", host));
            assert!(
                errs.contains(&format!(
                    "route[0].host: host `{host}` belongs to tenant `eu`, not `acme`"
                )),
                "{errs}"
            );
            assert!(
                errs.contains("help: put the route under tenant `eu`"),
                "{errs}"
            );
        }
        let errs = errors_of(&cfg("eu", "www.example.com"));
        assert!(
            errs.contains("host `www.example.com` does not belong to tenant `eu`"),
            "{errs}"
        );
    }

    /// A listener's name may not be another's default (`listener<index>`), nor a route
    /// with an unknown tenant be called a duplicate too.
    #[test]
    fn names_and_tenants_refused_once() {
        let errs = errors_of(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[listener]]\nname = \"listener0\"\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n",
        );
        assert!(
            errs.contains(
                "listener[1].name: listener `listener0` is defined twice (also listener[0])"
            ),
            "{errs}"
        );
        let errs = errors_of(&format!(
            "{TAIL}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n[[route]]\ntenant = \"nosuch\"\npath_prefix = \"/\"\ncluster = \"c\"\n"
        ));
        assert!(errs.contains("no tenant named `nosuch`"), "{errs}");
        assert!(!errs.contains("duplicate"), "{errs}");
    }

    #[test]
    fn wildcard_hosts_match_subdomains_only() {
        assert!(host_matches("*.acme.test", "api.acme.test"));
        assert!(!host_matches("*.acme.test", "acme.test"));
        assert!(!host_matches("*.acme.test", "xacme.test"));
        assert!(host_matches("acme.test", "acme.test"));
    }
}
