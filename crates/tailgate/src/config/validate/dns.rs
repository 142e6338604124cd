//! Checks for what DNS adds to the config: host-name endpoints and the `[dns]` table.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use toml::Spanned;

use super::super::file::RawDns;
use super::super::{DnsFamily, DnsSettings, HostPort};
use super::{Checker, valid_host_pattern};

/// A cluster endpoint as written: an IP literal with port, or a host name with port.
pub(super) enum Endpoint {
    Addr(SocketAddr),
    Name(HostPort),
}

impl Checker<'_> {
    /// `"10.0.0.1:80"`, `"[::1]:80"` or `"api.internal:8080"`; anything else is an error.
    pub(super) fn endpoint(&mut self, v: &Spanned<String>, field: String) -> Option<Endpoint> {
        let text = v.get_ref();
        let parsed = match super::socket_addr(text) {
            Err(super::NotAddr::Zone { message, hint }) => {
                self.err(Some(v.span()), field, message, hint);
                return None;
            }
            parsed => parsed.ok(),
        };
        if let Some(a) = parsed {
            // Addresses nothing can be connected to, or that name no port.
            let why = if a.port() == 0 {
                Some("port 0 names no port to connect to")
            } else {
                crate::config::unconnectable(a.ip())
            };
            if let Some(why) = why {
                self.err(
                    Some(v.span()),
                    field,
                    format!("`{text}`: {why}"),
                    Some("write the address and port an upstream server listens on, e.g. \"127.0.0.1:8080\""),
                );
                return None;
            }
            if let Some((message, hint)) = super::unzoned_link_local(a, text) {
                self.err(Some(v.span()), field, message, Some(&hint));
                return None;
            }
            return Some(Endpoint::Addr(a));
        }
        let named = text.rsplit_once(':').and_then(|(host, port)| {
            let host = host.to_ascii_lowercase();
            let fqdn = host.ends_with('.');
            let host = host.strip_suffix('.').unwrap_or(&host).to_owned();
            let port = port.parse::<u16>().ok().filter(|&p| p != 0)?;
            // A bare IP (no port, or a port that did not parse) is not a host name; nor is
            // a mistyped one (`999.1.1.1`, `1.2.3`): no top-level domain is all digits.
            let numeric = host
                .rsplit('.')
                .next()
                .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
            (valid_host_pattern(&host)
                && !host.starts_with("*.")
                && !numeric
                && host.parse::<IpAddr>().is_err())
            .then_some(HostPort { host, port, fqdn })
        });
        match named {
            Some(n) => Some(Endpoint::Name(n)),
            None => {
                self.err(
                    Some(v.span()),
                    field,
                    super::port_out_of_range(text)
                        .unwrap_or_else(|| format!("`{text}` is not an address")),
                    Some("write an IP literal or a host name, and a port: \"127.0.0.1:8080\", \"[::1]:8080\" or \"api.internal:8080\""),
                );
                None
            }
        }
    }

    pub(super) fn dns(&mut self, raw: &RawDns) -> DnsSettings {
        let mut nameservers = Vec::new();
        for (i, ns) in raw.nameservers.iter().enumerate() {
            let text = ns.get_ref();
            // As an endpoint's address, or an IP literal alone (port 53).
            let parsed = super::socket_addr(text)
                .ok()
                .ok_or(())
                .or_else(|_| text.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)));
            // What no query could reach: the rules an endpoint's address has.
            let unusable = parsed.as_ref().ok().and_then(|&a| {
                if a.port() == 0 {
                    return Some((
                        "port 0 is no name server's".to_owned(),
                        "write the server's port, or none for 53".to_owned(),
                    ));
                }
                if let Some(why) = super::super::unconnectable(a.ip()) {
                    return Some((
                        format!("`{text}` is not one server: {why}"),
                        "write the IP address of a name server".to_owned(),
                    ));
                }
                // The resolver connects to the address alone: a zone (an interface) would
                // be dropped, and the kernel refuses a link-local address without one.
                if let SocketAddr::V6(v6) = a
                    && v6.ip().is_unicast_link_local()
                {
                    return Some((
                        format!("`{text}` is link-local: the resolver cannot send to an interface's link-local address"),
                        "write a global or unique-local address of the name server, or a local resolver's (\"127.0.0.1\")".to_owned(),
                    ));
                }
                None
            });
            match parsed {
                Ok(_) if let Some((message, hint)) = unusable => self.err(
                    Some(ns.span()),
                    format!("dns.nameservers[{i}]"),
                    message,
                    Some(&hint),
                ),
                Ok(a) => nameservers.push(a),
                Err(_) => self.err(
                    Some(ns.span()),
                    format!("dns.nameservers[{i}]"),
                    format!("`{text}` is not a name server address"),
                    Some("write an IP literal, optionally with a port: \"10.0.0.2\" or \"127.0.0.1:5353\""),
                ),
            }
        }
        let found = self.errors_found();
        let min_refresh = self.duration(
            &raw.min_refresh,
            "dns.min_refresh".into(),
            Duration::from_secs(1),
        );
        let max_refresh = self.duration(
            &raw.max_refresh,
            "dns.max_refresh".into(),
            Duration::from_secs(300),
        );
        let refused = self.errors_found() > found;
        if min_refresh < Duration::from_millis(10) {
            self.err(
                raw.min_refresh.as_ref().map(Spanned::span),
                "dns.min_refresh".into(),
                "must be at least 10ms".into(),
                Some("a name is re-resolved at most this often; \"1s\" is a good default"),
            );
        }
        if max_refresh < min_refresh && !refused {
            // At the field that was written: with only min_refresh set, it is the one
            // above the other's default.
            match (&raw.max_refresh, &raw.min_refresh) {
                (None, Some(min)) => self.err(
                    Some(min.span()),
                    "dns.min_refresh".into(),
                    format!("{min_refresh:?} is longer than dns.max_refresh ({max_refresh:?}, its default)"),
                    Some("make min_refresh at most max_refresh, or set max_refresh too"),
                ),
                (max, _) => self.err(
                    max.as_ref().map(Spanned::span),
                    "dns.max_refresh".into(),
                    format!("{max_refresh:?} is shorter than dns.min_refresh ({min_refresh:?})"),
                    Some("make max_refresh at least min_refresh"),
                ),
            }
        }
        let query_timeout = self.timeout(
            &raw.query_timeout,
            "dns.query_timeout".into(),
            Duration::from_secs(2),
        );
        let startup_timeout = self.timeout(
            &raw.startup_timeout,
            "dns.startup_timeout".into(),
            Duration::from_secs(5),
        );
        let family = match &raw.family {
            None => DnsFamily::Any,
            Some(f) => {
                match f.get_ref().as_str() {
                    "any" => DnsFamily::Any,
                    "ipv4" => DnsFamily::Ipv4,
                    "ipv6" => DnsFamily::Ipv6,
                    other => {
                        self.err(
                        Some(f.span()),
                        "dns.family".into(),
                        format!("`{other}` is not an address family"),
                        Some("write \"any\" (A and AAAA), \"ipv4\" (A only) or \"ipv6\" (AAAA only)"),
                    );
                        DnsFamily::Any
                    }
                }
            }
        };
        DnsSettings {
            nameservers,
            min_refresh,
            max_refresh,
            query_timeout,
            startup_timeout,
            family,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::Config;

    fn errors(toml: &str) -> String {
        let text = format!("[[listener]]\naddress = \"127.0.0.1:0\"\n{toml}");
        match Config::parse(Path::new("t.toml"), &text) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn host_name_endpoints_are_kept_apart_from_addresses() {
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"10.0.0.1:80\", \"API.internal.:8080\"]\n";
        let cfg = Config::parse(Path::new("t.toml"), text).expect("valid");
        let c = &cfg.clusters[0];
        assert_eq!(c.endpoints, vec!["10.0.0.1:80".parse().expect("addr")]);
        assert_eq!(c.hostnames.len(), 1);
        assert_eq!(c.hostnames[0].host, "api.internal");
        assert_eq!(c.hostnames[0].port, 8080);
        // Written fully qualified: looked up so (no search domains), named without the dot
        // (TLS names).
        assert!(c.hostnames[0].fqdn);
        assert_eq!(c.hostnames[0].lookup_name(), "api.internal.");
        let text = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"api:8080\"]\n";
        let cfg = Config::parse(Path::new("t.toml"), text).expect("valid");
        assert_eq!(cfg.clusters[0].hostnames[0].lookup_name(), "api");
    }

    #[test]
    fn bad_endpoints_and_dns_settings_point_at_the_place() {
        let e = errors(
            "[[cluster]]\nname = \"c\"\nendpoints = [\"api.internal\", \"10.0.0.1\", \"a b:80\", \"x.y:0\"]\n",
        );
        for i in 0..4 {
            assert!(e.contains(&format!("cluster[0].endpoints[{i}]")), "{e}");
        }
        assert!(e.contains("t.toml:5:14"), "{e}");
        let e = errors(
            "[dns]\nnameservers = [\"resolver\"]\nmin_refresh = \"5s\"\nmax_refresh = \"1s\"\nquery_timeout = \"0s\"\n",
        );
        assert!(e.contains("t.toml:4:16: dns.nameservers[0]"), "{e}");
        assert!(e.contains("t.toml:6:15: dns.max_refresh"), "{e}");
        assert!(
            e.contains("t.toml:7:17: dns.query_timeout: a timeout of 0 would cut everything off"),
            "{e}"
        );
        assert!(e.contains("help:"), "{e}");
        // A refused max_refresh is not then judged, as its default, against min_refresh.
        let e = errors("[dns]\nmin_refresh = \"10m\"\nmax_refresh = \"31d\"\n");
        assert!(
            e.contains("t.toml:5:15: dns.max_refresh: `31d` is longer than 30 days"),
            "{e}"
        );
        assert_eq!(e.matches("dns.m").count(), 1, "one mistake, one error: {e}");
        // Only min_refresh written: the error is at it, about it.
        let e = errors("[dns]\nmin_refresh = \"10m\"\n");
        assert!(
            e.contains("t.toml:4:15: dns.min_refresh: 600s is longer than dns.max_refresh (300s, its default)"),
            "{e}"
        );
    }

    /// `dns.family` takes the three it names, and says what to write for anything else.
    #[test]
    fn the_address_family_is_one_of_three() {
        use crate::config::DnsFamily;
        for (text, family) in [
            ("any", DnsFamily::Any),
            ("ipv4", DnsFamily::Ipv4),
            ("ipv6", DnsFamily::Ipv6),
        ] {
            let toml =
                format!("[[listener]]\naddress = \"127.0.0.1:0\"\n[dns]\nfamily = \"{text}\"\n");
            let cfg = Config::parse(Path::new("t.toml"), &toml).expect("valid");
            assert_eq!(cfg.dns.family, family);
        }
        let e = errors("[dns]\nfamily = \"v4\"\n");
        assert!(
            e.contains("t.toml:4:10: dns.family: `v4` is not an address family"),
            "{e}"
        );
        assert!(e.contains("\"ipv4\" (A only)"), "{e}");
    }
}
