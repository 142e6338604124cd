//! A strict parser for the Prometheus 0.0.4 and OpenMetrics 1.0 text formats, to check what
//! `/metrics` writes: names, types, label syntax, one TYPE per family before its samples,
//! families contiguous, no duplicate series, histogram buckets cumulative and ending in
//! `+Inf` equal to `_count`.

use std::collections::{HashMap, HashSet};

/// Label pairs, in the order written (or sorted, as a key).
type Labels = Vec<(String, String)>;

#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, k: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Default)]
pub struct Exposition {
    /// Family name → type.
    pub types: HashMap<String, String>,
    pub samples: Vec<Sample>,
}

impl Exposition {
    /// Samples named `name` whose labels include all of `with`.
    pub fn find(&self, name: &str, with: &[(&str, &str)]) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| s.name == name && with.iter().all(|(k, v)| s.label(k) == Some(*v)))
            .collect()
    }

    /// The one sample matching, or panics with what there is.
    pub fn value(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        let found = self.find(name, with);
        assert_eq!(
            found.len(),
            1,
            "expected one {name} with {with:?}, found {found:?}"
        );
        found[0].value
    }
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Parses `{k="v",...}`; returns the labels and the rest of the line.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    let mut rest = &s[1..];
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or("label without =")?;
        let name = &rest[..eq];
        if !valid_label_name(name) {
            return Err(format!("bad label name `{name}`"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some((i, '"')) => break i,
                Some((_, '\n')) => return Err("newline in label value".into()),
                Some((_, c)) => value.push(c),
                None => return Err("unterminated label value".into()),
            }
        };
        if labels.iter().any(|(n, _): &(String, String)| n == name) {
            return Err(format!("label `{name}` twice"));
        }
        labels.push((name.to_owned(), value));
        rest = &rest[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with('}') {
            return Err("expected , or } after a label".into());
        }
    }
}

fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v.parse().map_err(|_| format!("bad value `{v}`")),
    }
}

/// The family a sample belongs to, given the declared types.
fn family_of(name: &str, types: &HashMap<String, String>, openmetrics: bool) -> Option<String> {
    if let Some(t) = types.get(name) {
        // Prometheus 0.0.4 declares counters by their full `_total` name.
        if t != "histogram" && !(openmetrics && t == "counter") {
            return Some(name.to_owned());
        }
    }
    for suffix in ["_bucket", "_sum", "_count", "_total"] {
        if let Some(base) = name.strip_suffix(suffix)
            && let Some(t) = types.get(base)
        {
            let ok = match suffix {
                "_total" => openmetrics && t == "counter",
                _ => t == "histogram",
            };
            if ok {
                return Some(base.to_owned());
            }
        }
    }
    None
}

pub fn parse(text: &str, openmetrics: bool) -> Result<Exposition, String> {
    let mut ex = Exposition::default();
    let mut done_families: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut series: HashSet<(String, Vec<(String, String)>)> = HashSet::new();
    let mut saw_eof = false;
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: `{line}`", n + 1);
        if saw_eof {
            return Err(at("content after # EOF".into()));
        }
        if line == "# EOF" {
            if !openmetrics {
                return Err(at("# EOF in the Prometheus format".into()));
            }
            saw_eof = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("");
            if !valid_name(name) {
                return Err(at("bad metric name in HELP".into()));
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let (name, ty) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
            if !valid_name(name) || !["counter", "gauge", "histogram"].contains(&ty) {
                return Err(at("bad TYPE line".into()));
            }
            if openmetrics && ty == "counter" && name.ends_with("_total") {
                return Err(at(
                    "an OpenMetrics counter family is named without _total".into()
                ));
            }
            if !openmetrics && ty == "counter" && !name.ends_with("_total") {
                return Err(at("counter not named *_total".into()));
            }
            if ex.types.insert(name.to_owned(), ty.to_owned()).is_some() {
                return Err(at("TYPE declared twice".into()));
            }
            if let Some(prev) = current.replace(name.to_owned()) {
                done_families.insert(prev);
            }
            continue;
        }
        if line.starts_with('#') {
            return Err(at("unexpected comment".into()));
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        if !valid_name(name) {
            return Err(at("bad metric name".into()));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(at)?
        } else {
            (Vec::new(), &line[name_end..])
        };
        let value = rest
            .strip_prefix(' ')
            .ok_or_else(|| at("no space before the value".into()))?;
        if value.contains(' ') {
            return Err(at("timestamps are not expected".into()));
        }
        let value = parse_value(value).map_err(at)?;
        let family = family_of(name, &ex.types, openmetrics)
            .ok_or_else(|| at("sample of an undeclared family".into()))?;
        if done_families.contains(&family) || current.as_deref() != Some(family.as_str()) {
            return Err(at("family is not contiguous".into()));
        }
        let ty = ex.types[&family].as_str();
        if ty == "counter" && (value.is_nan() || value < 0.0) {
            return Err(at("negative counter".into()));
        }
        let mut key_labels = labels.clone();
        key_labels.sort();
        if !series.insert((name.to_owned(), key_labels)) {
            return Err(at("duplicate series".into()));
        }
        ex.samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    if openmetrics && !saw_eof {
        return Err("OpenMetrics exposition without # EOF".into());
    }
    check_histograms(&ex)?;
    Ok(ex)
}

/// Buckets cumulative with increasing `le`, ending in `+Inf` equal to `_count`, with a `_sum`.
fn check_histograms(ex: &Exposition) -> Result<(), String> {
    // (name, sorted labels) → value, for the _count and _sum lookups.
    let index: HashMap<(&str, Labels), f64> = ex
        .samples
        .iter()
        .map(|s| {
            let mut k = s.labels.clone();
            k.sort();
            ((s.name.as_str(), k), s.value)
        })
        .collect();
    for (family, ty) in &ex.types {
        if ty != "histogram" {
            continue;
        }
        let bucket = format!("{family}_bucket");
        let mut groups: HashMap<Labels, Vec<(f64, f64)>> = HashMap::new();
        for s in ex.samples.iter().filter(|s| s.name == bucket) {
            let le = s.label("le").ok_or(format!("{bucket} without le"))?;
            let le = parse_value(le)?;
            let mut key: Vec<_> = s
                .labels
                .iter()
                .filter(|(k, _)| k != "le")
                .cloned()
                .collect();
            key.sort();
            groups.entry(key).or_default().push((le, s.value));
        }
        for (key, buckets) in groups {
            for w in buckets.windows(2) {
                if w[1].0 <= w[0].0 || w[1].1 < w[0].1 {
                    return Err(format!(
                        "{family} {key:?}: buckets not increasing: {buckets:?}"
                    ));
                }
            }
            let last = buckets.last().ok_or("no buckets")?;
            if last.0 != f64::INFINITY {
                return Err(format!("{family} {key:?}: last bucket is not +Inf"));
            }
            let count_name = format!("{family}_count");
            let sum_name = format!("{family}_sum");
            let count = index.get(&(count_name.as_str(), key.clone()));
            if !index.contains_key(&(sum_name.as_str(), key.clone())) {
                return Err(format!("{family} {key:?}: no _sum"));
            }
            match count {
                Some(&c) if c == last.1 => {}
                other => {
                    return Err(format!(
                        "{family} {key:?}: +Inf bucket {} != _count {other:?}",
                        last.1
                    ));
                }
            }
        }
    }
    Ok(())
}
