//! Local rate limiting (`envoy.filters.http.local_ratelimit`): a token bucket per config
//! (the listener's filter config, or a route / virtual host / route configuration override),
//! refilled continuously at `tokens_per_fill / fill_interval` as Envoy's atomic bucket does.
//! Limited requests get `status` (429) with `local_rate_limited`. The bucket is one atomic:
//! the request path takes no lock.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3 as lpb;
use envoy_types::pb::google::protobuf::Any;
use http::{HeaderName, HeaderValue};
use prost::Message;

use super::{Decision, FilterDecl, FilterState, LocalReply, Request, Translated};

pub const TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit";

/// Envoy's `<stat_prefix>.http_local_rate_limit.*` counters. Configs with the same prefix
/// share them, as Envoy's stats share a name.
#[derive(Debug, Default)]
pub struct RateLimitStats {
    pub enabled: AtomicU64,
    pub enforced: AtomicU64,
    pub rate_limited: AtomicU64,
    pub ok: AtomicU64,
}

type StatsByPrefix = std::sync::Mutex<std::collections::BTreeMap<String, Arc<RateLimitStats>>>;

fn registry() -> &'static StatsByPrefix {
    static STATS: OnceLock<StatsByPrefix> = OnceLock::new();
    STATS.get_or_init(Default::default)
}

/// The counters of a stat prefix (they live as long as the process, as Envoy's do).
pub fn stats_for(prefix: &str) -> Arc<RateLimitStats> {
    let mut m = registry().lock().unwrap_or_else(|p| p.into_inner());
    m.entry(prefix.to_string()).or_default().clone()
}

/// Every prefix's counters, by prefix.
pub fn all_stats() -> Vec<(String, Arc<RateLimitStats>)> {
    let m = registry().lock().unwrap_or_else(|p| p.into_inner());
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[derive(Debug)]
pub struct LocalRateLimit {
    pub stat_prefix: String,
    /// Found by prefix on first use rather than at translation (which touches nothing
    /// live); configs with one prefix share their counters, as Envoy's stats share a name.
    stats: OnceLock<Arc<RateLimitStats>>,
    pub status: u16,
    pub bucket: Option<TokenBucket>,
    pub enabled_per_million: u32,
    pub enforced_per_million: u32,
    pub response_headers: Vec<(HeaderName, HeaderValue, bool)>,
    pub request_headers_not_enforced: Vec<(HeaderName, HeaderValue, bool)>,
    /// `enable_x_ratelimit_headers: DRAFT_VERSION_03`.
    pub x_ratelimit_headers: bool,
    pub retry_after: bool,
    pub grpc_resource_exhausted: bool,
}

/// Tokens refill continuously; the state is the instant (ns since [`epoch`]) at which the
/// bucket was (or would have been) empty.
#[derive(Debug)]
pub struct TokenBucket {
    pub max_tokens: u32,
    /// Nanoseconds to earn one token.
    per_token_ns: u64,
    pub fill_interval: Duration,
    empty_at: AtomicU64,
}

fn epoch() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// Nanoseconds since the epoch, offset so that a full bucket's empty instant is not negative.
fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64 + (1 << 62)
}

impl TokenBucket {
    fn new(max_tokens: u32, per_fill: u32, fill_interval: Duration) -> TokenBucket {
        let per_token_ns = (fill_interval.as_nanos() / u128::from(per_fill.max(1))).max(1) as u64;
        TokenBucket {
            max_tokens,
            per_token_ns,
            fill_interval,
            // Starts full, as Envoy's does.
            empty_at: AtomicU64::new(now_ns().saturating_sub(u64::from(max_tokens) * per_token_ns)),
        }
    }

    /// Takes one token if there is one.
    pub fn consume(&self) -> bool {
        let full_span = u64::from(self.max_tokens) * self.per_token_ns;
        loop {
            let now = now_ns();
            let seen = self.empty_at.load(Relaxed);
            // More than `max_tokens` of idle time earns nothing more.
            let from = seen.max(now.saturating_sub(full_span));
            let next = from + self.per_token_ns;
            if next > now {
                return false;
            }
            if self
                .empty_at
                .compare_exchange(seen, next, Relaxed, Relaxed)
                .is_ok()
            {
                return true;
            }
        }
    }

    /// Whole tokens left now.
    pub fn remaining(&self) -> u32 {
        let now = now_ns();
        let full_span = u64::from(self.max_tokens) * self.per_token_ns;
        let from = self
            .empty_at
            .load(Relaxed)
            .max(now.saturating_sub(full_span));
        (now.saturating_sub(from) / self.per_token_ns).min(u64::from(self.max_tokens)) as u32
    }

    /// Whole seconds until the next token, at least 1 (Retry-After / x-ratelimit-reset).
    pub fn seconds_to_next(&self) -> u64 {
        let now = now_ns();
        let from = self.empty_at.load(Relaxed);
        let next = from + self.per_token_ns;
        next.saturating_sub(now).div_ceil(1_000_000_000).max(1)
    }
}

fn per_million(
    f: Option<&envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent>,
) -> Result<u32, String> {
    // Envoy: absent means 0% (the filter is off unless a fraction turns it on).
    crate::units::per_million(f, 0)
}

fn header_list(
    list: &[envoy_types::pb::envoy::config::core::v3::HeaderValueOption],
    what: &str,
) -> Result<Vec<(HeaderName, HeaderValue, bool)>, String> {
    use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction as A;
    list.iter()
        .map(|o| {
            let h = o
                .header
                .as_ref()
                .ok_or(format!("{what}: header is required"))?;
            let name = HeaderName::from_bytes(h.key.as_bytes())
                .map_err(|_| format!("{what}: invalid header name '{}'", h.key))?;
            let value = HeaderValue::from_str(&h.value)
                .map_err(|_| format!("{what}: invalid value for '{}'", h.key))?;
            #[allow(deprecated)]
            let append = match &o.append {
                Some(b) => b.value,
                None => A::try_from(o.append_action) == Ok(A::AppendIfExistsOrAdd),
            };
            Ok((name, value, append))
        })
        .collect()
}

impl LocalRateLimit {
    pub fn from_any(any: &Any) -> Result<LocalRateLimit, String> {
        let c = lpb::LocalRateLimit::decode(any.value.as_slice())
            .map_err(|e| format!("cannot decode LocalRateLimit: {e}"))?;
        if c.stat_prefix.is_empty() {
            return Err("stat_prefix: value length must be at least 1 characters".into());
        }
        if !c.descriptors.is_empty() || !c.rate_limits.is_empty() {
            return Err("descriptors / rate_limits are not supported yet".into());
        }
        if c.local_rate_limit_per_downstream_connection {
            return Err("local_rate_limit_per_downstream_connection is not supported yet".into());
        }
        if c.local_cluster_rate_limit.is_some() {
            return Err("local_cluster_rate_limit is not supported".into());
        }
        let bucket = match &c.token_bucket {
            Some(b) => {
                let interval = b
                    .fill_interval
                    .as_ref()
                    .ok_or("token_bucket.fill_interval is required")?;
                let interval = crate::units::duration(interval)
                    .map_err(|e| format!("token_bucket.fill_interval: {e}"))?;
                if interval.is_zero() {
                    return Err("token_bucket.fill_interval: value must be greater than 0s".into());
                }
                if b.max_tokens == 0 {
                    return Err("token_bucket.max_tokens: value must be greater than 0".into());
                }
                let per_fill = b.tokens_per_fill.as_ref().map_or(1, |v| v.value);
                if per_fill == 0 {
                    return Err("token_bucket.tokens_per_fill: value must be greater than 0".into());
                }
                Some(TokenBucket::new(b.max_tokens, per_fill, interval))
            }
            None => None,
        };
        let status = match &c.status {
            Some(s) if (200..600).contains(&s.code) => s.code as u16,
            Some(s) if s.code != 0 => {
                return Err(format!("status: {} is not an HTTP status", s.code))
            }
            _ => 429,
        };
        Ok(LocalRateLimit {
            stats: OnceLock::new(),
            stat_prefix: c.stat_prefix.clone(),
            status,
            bucket,
            enabled_per_million: per_million(c.filter_enabled.as_ref())
                .map_err(|e| format!("filter_enabled: {e}"))?,
            enforced_per_million: per_million(c.filter_enforced.as_ref())
                .map_err(|e| format!("filter_enforced: {e}"))?,
            response_headers: header_list(&c.response_headers_to_add, "response_headers_to_add")?,
            request_headers_not_enforced: header_list(
                &c.request_headers_to_add_when_not_enforced,
                "request_headers_to_add_when_not_enforced",
            )?,
            x_ratelimit_headers: c.enable_x_ratelimit_headers == 1,
            retry_after: c.enable_retry_after_header,
            grpc_resource_exhausted: c.rate_limited_as_resource_exhausted,
        })
    }

    /// The counters of this config's `stat_prefix`.
    pub fn stats(&self) -> &RateLimitStats {
        self.stats.get_or_init(|| stats_for(&self.stat_prefix))
    }

    /// Whether this request is limited, and whether that is enforced: (limited, enforced).
    /// `None` when the filter is not enabled for it.
    pub fn check(&self) -> Option<(bool, bool)> {
        let draw = |pm: u32| pm >= 1_000_000 || (pm > 0 && fastrand::u32(..1_000_000) < pm);
        if !draw(self.enabled_per_million) {
            return None;
        }
        let s = self.stats();
        s.enabled.fetch_add(1, Relaxed);
        // No bucket: nothing limits (Envoy allows every request).
        let allowed = self.bucket.as_ref().is_none_or(TokenBucket::consume);
        if allowed {
            s.ok.fetch_add(1, Relaxed);
            return Some((false, false));
        }
        s.rate_limited.fetch_add(1, Relaxed);
        let enforced = draw(self.enforced_per_million);
        if enforced {
            s.enforced.fetch_add(1, Relaxed);
        }
        Some((true, enforced))
    }
}

/// A local rate limit filter of the chain; a route's per-filter config of the same name
/// replaces its config (a filter-level config without a bucket limits nothing).
#[derive(Debug)]
pub struct RateLimitFilter {
    pub name: String,
    pub config: Arc<LocalRateLimit>,
    pub disabled: bool,
}

/// The registry's translate function for `http_filters` entries of this type.
pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    if d.config.type_url != TYPE {
        return Err("a local_ratelimit config wrapped in a TypedStruct is not supported".into());
    }
    Ok(Translated::Run(super::HttpFilter::LocalRateLimit(
        RateLimitFilter {
            name: d.name.to_string(),
            config: Arc::new(LocalRateLimit::from_any(d.config)?),
            disabled: d.disabled,
        },
    )))
}

impl RateLimitFilter {
    /// Takes a token (route override first); an enforced limit answers the request, one that
    /// is not enforced lets it on with the configured request headers.
    pub fn decode(&self, req: &Request<'_>, st: &mut FilterState) -> Decision {
        let own = req
            .route
            .and_then(|r| r.rate_limits.iter().find(|(n, _)| *n == self.name));
        let config = match own {
            Some((_, c)) => c,
            None if self.disabled => return Decision::Continue,
            None => &self.config,
        };
        let Some((limited, enforced)) = config.check() else {
            return Decision::Continue;
        };
        if config.x_ratelimit_headers && config.bucket.is_some() {
            st.rate_limit_response = Some(config.clone());
        }
        if limited && enforced {
            return Decision::Reply(config.reply());
        }
        if limited {
            st.rate_limit_headers = Some(config.clone());
        }
        Decision::Continue
    }
}

impl LocalRateLimit {
    /// Envoy's local rate limit reply: `status` (429) with `local_rate_limited`, the
    /// configured response headers, and Retry-After when asked for.
    fn reply(&self) -> LocalReply {
        let mut headers: Vec<(HeaderName, String)> = self
            .response_headers
            .iter()
            .filter_map(|(k, v, _)| Some((k.clone(), v.to_str().ok()?.to_string())))
            .collect();
        if self.retry_after
            && self.status == 429
            && !headers.iter().any(|(k, _)| k == http::header::RETRY_AFTER)
        {
            if let Some(b) = &self.bucket {
                headers.push((http::header::RETRY_AFTER, b.seconds_to_next().to_string()));
            }
        }
        LocalReply {
            status: self.status,
            body: Some(bytes::Bytes::from_static(b"local_rate_limited")),
            headers,
            grpc_status: self.grpc_resource_exhausted.then_some(8),
            details: std::borrow::Cow::Borrowed("local_rate_limited"),
        }
    }

    /// `enable_x_ratelimit_headers: DRAFT_VERSION_03`: the bucket's size, what is left, and
    /// the seconds until the next token.
    pub fn x_ratelimit_headers(&self, mut put: impl FnMut(&'static str, &str)) {
        if let Some(b) = &self.bucket {
            put("x-ratelimit-limit", &b.max_tokens.to_string());
            put("x-ratelimit-remaining", &b.remaining().to_string());
            put("x-ratelimit-reset", &b.seconds_to_next().to_string());
        }
    }
}

/// The per-filter override of a route, virtual host or route configuration, by filter name.
pub fn per_route(
    map: &std::collections::HashMap<String, Any>,
) -> Result<Vec<(String, Arc<LocalRateLimit>)>, String> {
    let mut out = Vec::new();
    for (name, a) in map {
        if a.type_url == TYPE {
            let c = LocalRateLimit::from_any(a)
                .map_err(|e| format!("typed_per_filter_config['{name}']: {e}"))?;
            // Envoy's wording: at the route level a config without a bucket makes no sense.
            if c.bucket.is_none() {
                return Err(format!(
                    "typed_per_filter_config['{name}']: local rate limit token bucket must be set for per filter configs"
                ));
            }
            out.push((name.clone(), Arc::new(c)));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_starts_full_and_refills_over_time() {
        let b = TokenBucket::new(3, 3, Duration::from_millis(300));
        assert_eq!(b.remaining(), 3);
        assert!(b.consume() && b.consume() && b.consume());
        assert!(!b.consume());
        assert_eq!(b.remaining(), 0);
        std::thread::sleep(Duration::from_millis(120));
        assert!(b.consume(), "one token per 100 ms");
        assert!(!b.consume());
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(b.remaining(), 3, "never above max_tokens");
    }

    #[test]
    fn rejections() {
        let any = |c: lpb::LocalRateLimit| Any {
            type_url: TYPE.into(),
            value: c.encode_to_vec(),
        };
        let e = LocalRateLimit::from_any(&any(lpb::LocalRateLimit::default())).unwrap_err();
        assert!(e.contains("stat_prefix"));
        let c = lpb::LocalRateLimit {
            stat_prefix: "rl".into(),
            local_rate_limit_per_downstream_connection: true,
            ..Default::default()
        };
        assert!(LocalRateLimit::from_any(&any(c))
            .unwrap_err()
            .contains("per_downstream_connection"));
        let ok = LocalRateLimit::from_any(&any(lpb::LocalRateLimit {
            stat_prefix: "rl".into(),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!((ok.status, ok.enabled_per_million), (429, 0));
        assert_eq!(ok.check(), None, "filter_enabled absent: off");
        let per_route = |c: lpb::LocalRateLimit| {
            per_route(&std::collections::HashMap::from([(
                "rl".to_string(),
                any(c),
            )]))
        };
        let e = per_route(lpb::LocalRateLimit {
            stat_prefix: "rl".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            e.contains("token bucket must be set for per filter configs"),
            "{e}"
        );
    }
}
