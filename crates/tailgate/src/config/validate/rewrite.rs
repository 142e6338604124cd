//! Checks for a route's `rewrite_prefix` and `host_rewrite`.

use super::super::file::RawRoute;
use super::Checker;

impl Checker<'_> {
    /// A route's `rewrite_prefix`: an absolute path in normal form (what is sent upstream
    /// must not be a path the routes would read otherwise), without a query; ending in `/`
    /// when `path_prefix` does, or the segment after it would be glued to it (`/api/users`
    /// through `/api/` → `/v2` would go up as `/v2users`).
    pub(super) fn rewrite_prefix(
        &mut self,
        r: &RawRoute,
        i: usize,
        path_prefix: &str,
    ) -> Option<String> {
        let raw = r.rewrite_prefix.as_ref()?;
        let to = raw.get_ref();
        let field = format!("route[{i}].rewrite_prefix");
        let normal = |p: &str| crate::pipeline::route::normal_path(p).map(|n| n.into_owned());
        // The value suggested, whatever the first problem: with a leading `/`, without a
        // query, in normal form, and ending with `/` where the prefix does (below). A hint
        // mending one problem only would be refused in turn once written.
        let mended = {
            let p = to.split(['?', '#']).next().unwrap_or("");
            let p = if p.starts_with('/') {
                p.to_owned()
            } else {
                format!("/{p}")
            };
            let p = normal(&p).unwrap_or(p);
            if path_prefix.ends_with('/') && !p.ends_with('/') {
                format!("{p}/")
            } else {
                p
            }
        };
        let problem = if !to.starts_with('/') {
            Some((
                format!("`{to}` does not start with `/`"),
                format!("write \"{mended}\""),
            ))
        } else if to.contains(['?', '#']) {
            Some((
                format!("`{to}` has a query or fragment; the client's query is kept as it is"),
                format!("write \"{mended}\""),
            ))
        } else if !is_path(to.as_bytes()) {
            Some((
                format!("`{to}` has bytes a request target cannot carry"),
                "percent-encode them (a space is %20)".to_owned(),
            ))
        } else {
            match (normal(to), normal(&format!("{to}x"))) {
                (Ok(a), Ok(b)) if a == *to && b == format!("{to}x") => None,
                (Ok(_), _) => Some((
                    format!(
                        "`{to}` is not in normal form (`;` parameters, `%XX` that is decoded, `.` and `..` segments or `//`)"
                    ),
                    format!("write \"{mended}\""),
                )),
                (Err(e), _) => Some((
                    format!("`{to}` cannot be sent upstream: {}", e.message()),
                    "write the prefix without `.` or `..` segments, `//`, or `;` parameters"
                        .to_owned(),
                )),
            }
        };
        let problem = problem.or_else(|| {
            (path_prefix.ends_with('/') && !to.ends_with('/')).then(|| {
                (
                    format!("`path_prefix` `{path_prefix}` ends with `/` and `{to}` does not: `{path_prefix}users` would go upstream as `{to}users`"),
                    format!("write \"{to}/\""),
                )
            })
        });
        match problem {
            None => Some(to.clone()),
            Some((what, help)) => {
                self.err(Some(raw.span()), field, what, Some(&help));
                None
            }
        }
    }

    /// A route's `host_rewrite`: what a Host header may be, `host[:port]` (a name, an IPv4
    /// address or a bracketed IPv6 one), as it goes into the request head as written.
    pub(super) fn host_rewrite(&mut self, r: &RawRoute, i: usize) -> Option<String> {
        let raw = r.host_rewrite.as_ref()?;
        let h = raw.get_ref();
        if crate::pipeline::route::is_host_value(h) {
            return Some(h.clone());
        }
        let help = match h.split_once("://") {
            Some((_, rest)) => {
                let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
                format!(
                    "write \"{}\", without the scheme (or path)",
                    authority.rsplit('@').next().unwrap_or(authority)
                )
            }
            None => "write the name (and port) the upstream expects in its Host, like \"api.internal\" or \"api.internal:8443\"".to_owned(),
        };
        self.err(
            Some(raw.span()),
            format!("route[{i}].host_rewrite"),
            format!("`{h}` is not a Host value (`host[:port]`)"),
            Some(&help),
        );
        None
    }
}

/// Only what a path may carry as it is (RFC 3986 §3.3: unreserved, sub-delims, `:`, `@`,
/// `/`) and `%` with two hex digits: the value goes into request lines as written.
fn is_path(p: &[u8]) -> bool {
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            b'%' if p.len() > i + 2
                && p[i + 1].is_ascii_hexdigit()
                && p[i + 2].is_ascii_hexdigit() =>
            {
                i += 3;
                continue;
            }
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' => {}
            b'-' | b'.' | b'_' | b'~' | b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+'
            | b',' | b';' | b'=' | b':' | b'@' | b'/' => {}
            _ => return false,
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::Config;

    const BASE: &str = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n";

    fn parse(prefix: &str, to: &str) -> Result<Config, String> {
        Config::parse(
            Path::new("t.toml"),
            &format!("{BASE}[[route]]\npath_prefix = \"{prefix}\"\ncluster = \"c\"\nrewrite_prefix = \"{to}\"\n"),
        )
        .map_err(|e| e.to_string())
    }

    #[test]
    fn a_rewrite_prefix_is_kept() {
        for (prefix, to) in [
            ("/api/", "/"),
            ("/api/", "/v2/"),
            ("/api", "/v2"),
            ("/api", "/"),
        ] {
            let cfg = parse(prefix, to).expect(to);
            assert_eq!(cfg.routes[0].rewrite_prefix.as_deref(), Some(to));
        }
        let cfg = Config::parse(
            Path::new("t.toml"),
            &format!("{BASE}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\n"),
        )
        .expect("valid");
        assert_eq!(cfg.routes[0].rewrite_prefix, None);
    }

    #[test]
    fn a_bad_rewrite_prefix_says_what_to_write() {
        for (prefix, to, says, write) in [
            ("/api/", "v2/", "does not start with `/`", "write \"/v2/\""),
            ("/api/", "/v2/?x=1", "query or fragment", "write \"/v2/\""),
            ("/api/", "/v 2/", "cannot carry", "percent-encode"),
            ("/api", "/a/%2", "cannot carry", "percent-encode"),
            ("/api", "/a/\u{e9}", "cannot carry", "percent-encode"),
            ("/api", "/a/{b}", "cannot carry", "percent-encode"),
            ("/api/", "/v2/./", "not in normal form", "write \"/v2/\""),
            ("/api/", "/a//b/", "not in normal form", "write \"/a/b/\""),
            ("/api/", "/%7Ev2/", "not in normal form", "write \"/~v2/\""),
            ("/api/", "/../", "climbs above", "without `.` or `..`"),
            (
                "/api/",
                "/.;/",
                "segment with `;` parameters",
                "or `;` parameters",
            ),
            ("/api/", "/a;%2F/", "encoded slash", "or `;` parameters"),
            ("/api/", "/v2", "ends with `/`", "write \"/v2/\""),
            // The value suggested for the first problem ends with `/` too, where the
            // prefix does: it would be refused next once written.
            ("/api/", "v2", "does not start with `/`", "write \"/v2/\""),
            ("/api/", "/v2?x=1", "query or fragment", "write \"/v2/\""),
            ("/api/", "/a//b", "not in normal form", "write \"/a/b/\""),
            ("/api", "v2", "does not start with `/`", "write \"/v2\""),
            (
                "/api/",
                "v2?x=1",
                "does not start with `/`",
                "write \"/v2/\"",
            ),
            (
                "/api/",
                "a//b",
                "does not start with `/`",
                "write \"/a/b/\"",
            ),
            ("/api/", "/a//b?x", "query or fragment", "write \"/a/b/\""),
        ] {
            let e = parse(prefix, to).expect_err(to);
            assert!(
                e.contains("t.toml:9:18: route[0].rewrite_prefix"),
                "{to}: {e}"
            );
            assert!(e.contains(says), "{to}: {e}");
            assert!(e.contains(write), "{to}: {e}");
        }
    }

    fn parse_host(v: &str) -> Result<Config, String> {
        Config::parse(
            Path::new("t.toml"),
            &format!(
                "{BASE}[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\nhost_rewrite = \"{v}\"\n"
            ),
        )
        .map_err(|e| e.to_string())
    }

    #[test]
    fn a_host_rewrite_is_kept_as_written() {
        for v in [
            "api.internal",
            "Api.Internal:8443",
            "10.0.0.5:80",
            "[::1]:9000",
        ] {
            let cfg = parse_host(v).expect(v);
            assert_eq!(cfg.routes[0].host_rewrite.as_deref(), Some(v));
        }
    }

    #[test]
    fn a_bad_host_rewrite_says_what_to_write() {
        for (v, write) in [
            (
                "https://api.internal/v1",
                "write \"api.internal\", without the scheme",
            ),
            (
                "http://u@api.internal:81?x",
                "write \"api.internal:81\", without the scheme",
            ),
            ("api.internal:99999", "like \"api.internal\""),
            ("api.internal/v1", "like \"api.internal\""),
            ("", "like \"api.internal\""),
            ("user@api.internal", "like \"api.internal\""),
            ("api.internal:http", "like \"api.internal\""),
            ("a b", "like \"api.internal\""),
        ] {
            let e = parse_host(v).expect_err(v);
            assert!(e.contains("t.toml:9:16: route[0].host_rewrite"), "{v}: {e}");
            assert!(e.contains("is not a Host value"), "{v}: {e}");
            assert!(e.contains(write), "{v}: {e}");
        }
    }
}
