//! Envoy's matchers (`StringMatcher`, `HeaderMatcher`) translated into plain data, and the
//! request view they are evaluated against. A leaf the route table, the router and the HTTP
//! filters all build on, so none of them imports another for its matchers.

use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::r#type::matcher::v3 as mpb;
use http::HeaderMap;
use regex::Regex;

/// What routing needs to know of a request. `host` is lowercase.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The authority as vhost selection sees it: lowercase, port stripped as configured.
    pub host: &'a str,
    /// The authority as received, for `:authority` header matchers.
    pub authority: &'a str,
    /// The `:path` as received, query string included.
    pub path: &'a str,
    pub method: &'a str,
    pub scheme: &'a str,
    pub headers: &'a HeaderMap,
}

impl<'a> RequestView<'a> {
    pub(crate) fn path_only(&self) -> &'a str {
        let end = self.path.find(['?', '#']).unwrap_or(self.path.len());
        &self.path[..end]
    }

    pub(crate) fn query(&self) -> Option<&'a str> {
        let q = self.path.split_once('?')?.1;
        Some(q.split_once('#').map_or(q, |(q, _)| q))
    }
}

pub fn header_matches(h: &HeaderMatcher, req: &RequestView<'_>) -> bool {
    if let Some(p) = h.pseudo {
        let v = match p {
            Pseudo::Authority => req.authority,
            Pseudo::Path => req.path,
            Pseudo::Method => req.method,
            Pseudo::Scheme => req.scheme,
        };
        return value_matches(h, v) != h.invert;
    }
    let Some(name) = &h.name else {
        // A name no request can carry: the header is always missing.
        return if h.treat_missing_as_empty {
            value_matches(h, "") != h.invert
        } else {
            matches!(h.kind, HeaderMatch::Present(p) if p == h.invert)
        };
    };
    let mut values = req.headers.get_all(name).iter().peekable();
    if values.peek().is_none() {
        if h.treat_missing_as_empty {
            return value_matches(h, "") != h.invert;
        }
        // A missing header matches only "present_match: false" (or its inversion).
        return matches!(h.kind, HeaderMatch::Present(p) if p == h.invert);
    }
    // Envoy matches each header line on its own: the matcher holds if any line matches.
    let any = values.any(|v| value_matches(h, &String::from_utf8_lossy(v.as_bytes())));
    any != h.invert
}

fn value_matches(h: &HeaderMatcher, value: &str) -> bool {
    match &h.kind {
        HeaderMatch::LegacyExact(s) => s.is_empty() || value == s.as_str(),
        HeaderMatch::String(m) => m.matches(value),
        HeaderMatch::Range { start, end } => {
            value.parse::<i64>().is_ok_and(|v| v >= *start && v < *end)
        }
        HeaderMatch::Present(p) => *p,
    }
}

#[derive(Debug)]
pub struct HeaderMatcher {
    /// Lowercase header name (None: a name no request can carry), unless `pseudo` is set.
    pub name: Option<http::HeaderName>,
    pub pseudo: Option<Pseudo>,
    pub kind: HeaderMatch,
    pub invert: bool,
    pub treat_missing_as_empty: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pseudo {
    Authority,
    Path,
    Method,
    Scheme,
}

#[derive(Debug)]
pub enum HeaderMatch {
    /// Legacy `exact_match`: an empty value matches any value.
    LegacyExact(String),
    String(StringMatch),
    Range {
        start: i64,
        end: i64,
    },
    Present(bool),
}

/// `envoy.type.matcher.v3.StringMatcher`.
#[derive(Debug)]
pub enum StringMatch {
    Exact(String, bool),
    Prefix(String, bool),
    Suffix(String, bool),
    Contains(String, bool),
    Regex(Regex),
}

impl StringMatch {
    pub fn matches(&self, value: &str) -> bool {
        match self {
            StringMatch::Exact(s, false) => value == s,
            StringMatch::Exact(s, true) => value.eq_ignore_ascii_case(s),
            StringMatch::Prefix(s, false) => value.starts_with(s.as_str()),
            StringMatch::Prefix(s, true) => {
                value.len() >= s.len()
                    && value.as_bytes()[..s.len()].eq_ignore_ascii_case(s.as_bytes())
            }
            StringMatch::Suffix(s, false) => value.ends_with(s.as_str()),
            StringMatch::Suffix(s, true) => {
                value.len() >= s.len()
                    && value.as_bytes()[value.len() - s.len()..].eq_ignore_ascii_case(s.as_bytes())
            }
            StringMatch::Contains(s, false) => value.contains(s.as_str()),
            // `s` was lowercased at translation.
            StringMatch::Contains(s, true) => value.to_ascii_lowercase().contains(s.as_str()),
            StringMatch::Regex(r) => r.is_match(value),
        }
    }
}

/// Compiles an RE2-style regex for a whole-string match, as Envoy's `safe_regex` does.
/// RE2 refuses repetition counts over 1000 (`{1001}`), which the regex crate would accept.
pub(crate) fn check_repeat_limit(re: &str) -> Result<(), String> {
    let b = re.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'{' => {
                let digits: String = re[i + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || *c == ',')
                    .collect();
                if !digits.is_empty() && re[i + 1 + digits.len()..].starts_with('}') {
                    for n in digits.split(',').filter(|n| !n.is_empty()) {
                        if n.parse::<u64>().map_or(true, |n| n > 1000) {
                            return Err(format!(
                                "invalid regex '{re}': bad repetition operator: {{{digits}}}"
                            ));
                        }
                    }
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    Ok(())
}

pub fn compile_full_regex(re: &str) -> Result<Regex, String> {
    check_repeat_limit(re)?;
    regex::RegexBuilder::new(&format!("^(?:{re})$"))
        .size_limit(1 << 20)
        .build()
        .map_err(|e| {
            // The regex crate's message is multi-line with a caret diagram; keep the last line.
            let msg = e.to_string();
            let reason = msg
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid regex")
                .trim()
                .trim_start_matches("error: ")
                .to_string();
            format!("invalid regex '{re}': {reason}")
        })
}

pub(crate) fn regex_matcher(m: &mpb::RegexMatcher) -> Result<Regex, String> {
    if m.regex.is_empty() {
        return Err("regex must not be empty".into());
    }
    compile_full_regex(&m.regex)
}

pub fn string_matcher(m: &mpb::StringMatcher) -> Result<StringMatch, String> {
    use mpb::string_matcher::MatchPattern as P;
    let ic = m.ignore_case;
    Ok(match &m.match_pattern {
        Some(P::Exact(s)) => StringMatch::Exact(s.clone(), ic),
        Some(P::Prefix(s)) if !s.is_empty() => StringMatch::Prefix(s.clone(), ic),
        Some(P::Suffix(s)) if !s.is_empty() => StringMatch::Suffix(s.clone(), ic),
        Some(P::Contains(s)) if !s.is_empty() => StringMatch::Contains(
            if ic {
                s.to_ascii_lowercase()
            } else {
                s.clone()
            },
            ic,
        ),
        Some(P::Prefix(_)) | Some(P::Suffix(_)) | Some(P::Contains(_)) => {
            return Err("string matcher: prefix, suffix and contains must not be empty".into())
        }
        Some(P::SafeRegex(_)) if ic => {
            return Err("string matcher: ignore_case has no effect for safe_regex".into())
        }
        Some(P::SafeRegex(r)) => StringMatch::Regex(regex_matcher(r)?),
        Some(P::Custom(c)) => {
            return Err(format!(
                "string matcher: custom matcher '{}' is not supported",
                c.name
            ))
        }
        None => return Err("string matcher: no match pattern set".into()),
    })
}

pub fn header_matcher(h: &rpb::HeaderMatcher) -> Result<HeaderMatcher, String> {
    #[allow(deprecated)]
    use rpb::header_matcher::HeaderMatchSpecifier as H;
    if h.name.is_empty() {
        return Err("name must not be empty".into());
    }
    let lname = h.name.to_ascii_lowercase();
    let pseudo = match lname.as_str() {
        ":authority" | "host" => Some(Pseudo::Authority),
        ":path" => Some(Pseudo::Path),
        ":method" => Some(Pseudo::Method),
        ":scheme" => Some(Pseudo::Scheme),
        n if n.starts_with(':') => return Err("unknown pseudo-header".into()),
        _ => None,
    };
    // A name no request can carry (a space, say) is valid config to Envoy; it never matches.
    let name = if pseudo.is_some() {
        Some(http::HeaderName::from_static("host"))
    } else {
        http::HeaderName::from_bytes(lname.as_bytes()).ok()
    };
    #[allow(deprecated)]
    let kind = match &h.header_match_specifier {
        Some(H::ExactMatch(s)) => HeaderMatch::LegacyExact(s.clone()),
        Some(H::SafeRegexMatch(r)) => HeaderMatch::String(StringMatch::Regex(regex_matcher(r)?)),
        Some(H::RangeMatch(r)) => HeaderMatch::Range {
            start: r.start,
            end: r.end,
        },
        Some(H::PresentMatch(p)) => HeaderMatch::Present(*p),
        Some(H::PrefixMatch(s) | H::SuffixMatch(s) | H::ContainsMatch(s)) if s.is_empty() => {
            return Err("prefix_match, suffix_match and contains_match must not be empty".into())
        }
        Some(H::PrefixMatch(s)) => HeaderMatch::String(StringMatch::Prefix(s.clone(), false)),
        Some(H::SuffixMatch(s)) => HeaderMatch::String(StringMatch::Suffix(s.clone(), false)),
        Some(H::ContainsMatch(s)) => HeaderMatch::String(StringMatch::Contains(s.clone(), false)),
        Some(H::StringMatch(s)) => HeaderMatch::String(string_matcher(s)?),
        // No specifier: Envoy treats the matcher as "header is present".
        None => HeaderMatch::Present(true),
    };
    Ok(HeaderMatcher {
        name,
        pseudo,
        kind,
        invert: h.invert_match,
        treat_missing_as_empty: h.treat_missing_header_as_empty,
    })
}
