//! `envoy.filters.http.cors`: CORS policies as Envoy's filter applies them: per-filter configs
//! on the route, its virtual host and the route configuration under the filter's name (most
//! specific first, each field from the first policy that sets it), or the deprecated `cors`
//! fields when there are none. Resolved once per route at snapshot build time; the filter
//! answers preflights and latches an allowed origin for the response.

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::http::cors::v3 as cpb;
use envoy_types::pb::google::protobuf::Any;
use http::HeaderName;
use prost::Message;

use super::{Decision, FilterDecl, FilterState, LocalReply, Request, Translated};

use crate::matcher::{string_matcher, StringMatch};

pub const FILTER: &str = "envoy.filters.http.cors";
/// The filter's own config (no fields).
pub const CORS_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors";
const POLICY_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy";

/// The effective policy of one route.
#[derive(Debug, Default)]
pub struct Cors {
    pub allow_origins: Vec<StringMatch>,
    pub allow_methods: String,
    pub allow_headers: String,
    pub expose_headers: String,
    pub max_age: String,
    pub allow_credentials: bool,
    pub allow_private_network: bool,
    pub forward_not_matching_preflights: bool,
    /// The share of requests the filter acts on, in millionths (the most specific policy's
    /// `filter_enabled`; all when unset).
    pub enabled_per_million: u32,
}

/// One policy as configured, before merging.
struct Policy {
    allow_origins: Vec<StringMatch>,
    allow_methods: String,
    allow_headers: String,
    expose_headers: String,
    max_age: String,
    allow_credentials: Option<bool>,
    allow_private_network: Option<bool>,
    forward_not_matching_preflights: Option<bool>,
    enabled_per_million: u32,
}

fn per_million(
    f: Option<&envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent>,
) -> Result<u32, String> {
    // No fraction: the policy applies to every request.
    crate::units::per_million(f, 1_000_000).map_err(|e| format!("filter_enabled: {e}"))
}

/// `allow_origin_string_match`, in both policy messages (the filter's and the route's
/// deprecated one).
fn allow_origins(
    ms: &[envoy_types::pb::envoy::r#type::matcher::v3::StringMatcher],
) -> Result<Vec<StringMatch>, String> {
    ms.iter()
        .map(string_matcher)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cors allow_origin_string_match: {e}"))
}

fn from_typed(name: &str, any: &Any) -> Result<Policy, String> {
    if any.type_url != POLICY_TYPE {
        return Err(format!(
            "typed_per_filter_config['{name}']: expected {POLICY_TYPE}, found {}",
            any.type_url
        ));
    }
    let p = cpb::CorsPolicy::decode(any.value.as_slice())
        .map_err(|e| format!("typed_per_filter_config['{name}']: {e}"))?;
    Ok(Policy {
        allow_origins: allow_origins(&p.allow_origin_string_match)?,
        allow_methods: p.allow_methods,
        allow_headers: p.allow_headers,
        expose_headers: p.expose_headers,
        max_age: p.max_age,
        allow_credentials: p.allow_credentials.map(|b| b.value),
        allow_private_network: p.allow_private_network_access.map(|b| b.value),
        forward_not_matching_preflights: p.forward_not_matching_preflights.map(|b| b.value),
        enabled_per_million: per_million(p.filter_enabled.as_ref())?,
    })
}

fn from_deprecated(p: &rpb::CorsPolicy) -> Result<Policy, String> {
    Ok(Policy {
        allow_origins: allow_origins(&p.allow_origin_string_match)?,
        allow_methods: p.allow_methods.clone(),
        allow_headers: p.allow_headers.clone(),
        expose_headers: p.expose_headers.clone(),
        max_age: p.max_age.clone(),
        allow_credentials: p.allow_credentials.as_ref().map(|b| b.value),
        allow_private_network: p.allow_private_network_access.as_ref().map(|b| b.value),
        forward_not_matching_preflights: p
            .forward_not_matching_preflights
            .as_ref()
            .map(|b| b.value),
        enabled_per_million: match &p.enabled_specifier {
            Some(rpb::cors_policy::EnabledSpecifier::FilterEnabled(f)) => per_million(Some(f))?,
            None => 1_000_000,
        },
    })
}

/// A route's CORS policies, by the name of the filter they configure.
#[derive(Debug, Default)]
pub struct RoutePolicies {
    /// From `typed_per_filter_config` entries holding a `CorsPolicy`, by entry name.
    pub by_name: Vec<(String, Arc<Cors>)>,
    /// From the deprecated `cors` fields: what a CORS filter with no per-filter config of its
    /// name uses.
    pub deprecated: Option<Arc<Cors>>,
}

impl RoutePolicies {
    /// The policy the CORS filter named `name` applies (Envoy's `getAllPerFilterConfig` by the
    /// filter's config name, else the deprecated route entry and virtual host policies).
    pub fn for_filter(&self, name: &str) -> Option<&Arc<Cors>> {
        self.by_name
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c)
            .or(self.deprecated.as_ref())
    }
}

/// The CORS policies of a route, from its own, its virtual host's and its route
/// configuration's per-filter configs (in that order, per filter name), and their
/// deprecated `cors` fields.
pub fn resolve(
    route: &HashMap<String, Any>,
    vhost: &HashMap<String, Any>,
    config: &HashMap<String, Any>,
    deprecated: [Option<&rpb::CorsPolicy>; 2],
) -> Result<Option<RoutePolicies>, String> {
    let levels = [route, vhost, config];
    let mut names: Vec<&String> = Vec::new();
    for map in levels {
        for (name, any) in map {
            if any.type_url == POLICY_TYPE {
                if !names.contains(&name) {
                    names.push(name);
                }
            } else if name == FILTER {
                // The well-known name with another type: refused as before.
                from_typed(name, any)?;
            }
        }
    }
    // HashMap order is arbitrary; sorted, snapshots compare and print stably.
    names.sort();
    let mut by_name = Vec::with_capacity(names.len());
    for name in names {
        let mut policies = Vec::new();
        for map in levels {
            if let Some(any) = map.get(name).filter(|a| a.type_url == POLICY_TYPE) {
                policies.push(from_typed(name, any)?);
            }
        }
        if let Some(c) = merge(policies) {
            by_name.push((name.clone(), Arc::new(c)));
        }
    }
    let mut old = Vec::new();
    for p in deprecated.into_iter().flatten() {
        old.push(from_deprecated(p)?);
    }
    let deprecated = merge(old).map(Arc::new);
    if by_name.is_empty() && deprecated.is_none() {
        return Ok(None);
    }
    Ok(Some(RoutePolicies {
        by_name,
        deprecated,
    }))
}

/// Policies most specific first: each field from the first that sets it.
fn merge(policies: Vec<Policy>) -> Option<Cors> {
    let first = policies.first()?;
    let text = |f: fn(&Policy) -> &String| {
        policies
            .iter()
            .map(f)
            .find(|s| !s.is_empty())
            .cloned()
            .unwrap_or_default()
    };
    let flag = |f: fn(&Policy) -> Option<bool>| policies.iter().find_map(f);
    Some(Cors {
        enabled_per_million: first.enabled_per_million,
        allow_methods: text(|p| &p.allow_methods),
        allow_headers: text(|p| &p.allow_headers),
        expose_headers: text(|p| &p.expose_headers),
        max_age: text(|p| &p.max_age),
        allow_credentials: flag(|p| p.allow_credentials).unwrap_or(false),
        allow_private_network: flag(|p| p.allow_private_network).unwrap_or(false),
        forward_not_matching_preflights: flag(|p| p.forward_not_matching_preflights)
            .unwrap_or(true),
        allow_origins: policies
            .into_iter()
            .map(|p| p.allow_origins)
            .find(|o| !o.is_empty())
            .unwrap_or_default(),
    })
}

/// A CORS filter of the chain (its own config, `envoy.extensions.filters.http.cors.v3.Cors`,
/// is empty: the policies come from the routes).
#[derive(Debug)]
pub struct CorsFilter {
    pub name: String,
    /// `disabled: true` in the chain: the filter does nothing.
    pub disabled: bool,
}

/// The registry's translate function for `http_filters` entries of this type. Seen through a
/// TypedStruct too: the config has no fields.
pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    Ok(Translated::Run(super::HttpFilter::Cors(CorsFilter {
        name: d.name.to_string(),
        disabled: d.disabled,
    })))
}

impl CorsFilter {
    /// Envoy's CORS filter on the request: latches an allowed origin for the response, and
    /// answers a preflight (OPTIONS with an origin and `access-control-request-method`)
    /// itself. Only forwarding routes carry policies (their route entry is where Envoy's
    /// filter looks).
    pub fn decode(&self, req: &Request<'_>, st: &mut FilterState) -> Decision {
        if self.disabled {
            return Decision::Continue;
        }
        let Some(cors) = req
            .route
            .and_then(|r| r.cors.as_ref()?.for_filter(&self.name))
        else {
            return Decision::Continue;
        };
        if cors.enabled_per_million < 1_000_000
            && fastrand::u32(..1_000_000) >= cors.enabled_per_million
        {
            return Decision::Continue;
        }
        let text = |name: &str| {
            req.view
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
        };
        let origin = text("origin");
        if origin.is_empty() {
            return Decision::Continue;
        }
        let allowed = cors.origin_allowed(origin);
        if allowed {
            st.cors = Some((cors.clone(), origin.to_string()));
        }
        let method = text("access-control-request-method");
        if req.view.method != "OPTIONS" || method.is_empty() {
            return Decision::Continue;
        }
        if !allowed && cors.forward_not_matching_preflights {
            return Decision::Continue;
        }
        let mut out = Vec::new();
        let h = HeaderName::from_static;
        if allowed {
            out.push((h("access-control-allow-origin"), origin.to_string()));
        }
        if cors.allow_credentials {
            out.push((h("access-control-allow-credentials"), "true".into()));
        }
        match cors.allow_methods.as_str() {
            "" => {}
            "*" => out.push((h("access-control-allow-methods"), method.to_string())),
            m => out.push((h("access-control-allow-methods"), m.to_string())),
        }
        match cors.allow_headers.as_str() {
            "" => {}
            "*" => out.push((
                h("access-control-allow-headers"),
                text("access-control-request-headers").to_string(),
            )),
            v => out.push((h("access-control-allow-headers"), v.to_string())),
        }
        if !cors.max_age.is_empty() {
            out.push((h("access-control-max-age"), cors.max_age.clone()));
        }
        if cors.allow_private_network && text("access-control-request-private-network") == "true" {
            out.push((h("access-control-allow-private-network"), "true".into()));
        }
        // The answer passes the filter's response side too (expose-headers included), as in
        // Envoy.
        Decision::Reply(LocalReply {
            status: 200,
            body: None,
            headers: out,
            grpc_status: None,
            details: std::borrow::Cow::Borrowed("cors_preflight"),
        })
    }
}

/// Envoy's CORS filter on the response to a request from an allowed origin.
pub fn response_headers(cors: &Cors, origin: &str, mut put: impl FnMut(&'static str, &str)) {
    put("access-control-allow-origin", origin);
    if cors.allow_credentials {
        put("access-control-allow-credentials", "true");
    }
    if !cors.expose_headers.is_empty() {
        put("access-control-expose-headers", &cors.expose_headers);
    }
}

impl Cors {
    /// Envoy: an origin is allowed when a matcher matches it, or matches `*` itself.
    pub fn origin_allowed(&self, origin: &str) -> bool {
        self.allow_origins
            .iter()
            .any(|m| m.matches("*") || m.matches(origin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::r#type::matcher::v3::{
        string_matcher::MatchPattern, StringMatcher,
    };
    use envoy_types::pb::google::protobuf::BoolValue;

    fn typed(p: cpb::CorsPolicy) -> HashMap<String, Any> {
        [(
            FILTER.to_string(),
            Any {
                type_url: POLICY_TYPE.into(),
                value: p.encode_to_vec(),
            },
        )]
        .into()
    }

    fn origin(o: &str) -> StringMatcher {
        StringMatcher {
            match_pattern: Some(MatchPattern::Exact(o.into())),
            ..Default::default()
        }
    }

    #[test]
    fn the_most_specific_policy_setting_a_field_wins() {
        let route = typed(cpb::CorsPolicy {
            allow_methods: "GET".into(),
            ..Default::default()
        });
        let vhost = typed(cpb::CorsPolicy {
            allow_origin_string_match: vec![origin("https://a")],
            allow_methods: "PUT".into(),
            allow_credentials: Some(BoolValue { value: true }),
            ..Default::default()
        });
        let all = resolve(&route, &vhost, &HashMap::new(), [None, None])
            .unwrap()
            .unwrap();
        let c = all.for_filter(FILTER).unwrap();
        assert_eq!(c.allow_methods, "GET");
        assert!(c.allow_credentials && c.forward_not_matching_preflights);
        assert!(c.origin_allowed("https://a") && !c.origin_allowed("https://b"));
        assert!(
            all.for_filter("another.cors").is_none(),
            "by the filter's name"
        );
        assert!(resolve(
            &HashMap::new(),
            &HashMap::new(),
            &HashMap::new(),
            [None, None]
        )
        .unwrap()
        .is_none());
    }

    #[test]
    fn deprecated_fields_count_only_without_per_filter_configs() {
        let old = rpb::CorsPolicy {
            allow_methods: "POST".into(),
            ..Default::default()
        };
        let all = resolve(
            &HashMap::new(),
            &HashMap::new(),
            &HashMap::new(),
            [Some(&old), None],
        )
        .unwrap()
        .unwrap();
        assert_eq!(all.for_filter(FILTER).unwrap().allow_methods, "POST");
        let typed_one = typed(cpb::CorsPolicy::default());
        let all = resolve(
            &typed_one,
            &HashMap::new(),
            &HashMap::new(),
            [Some(&old), None],
        )
        .unwrap()
        .unwrap();
        assert_eq!(all.for_filter(FILTER).unwrap().allow_methods, "");
        assert_eq!(
            all.for_filter("other").unwrap().allow_methods,
            "POST",
            "a CORS filter of another name has no per-filter config: the deprecated fields"
        );
        let wrong = HashMap::from([(
            FILTER.to_string(),
            Any {
                type_url: "type.googleapis.com/google.protobuf.Empty".into(),
                value: Vec::new(),
            },
        )]);
        let e = resolve(&wrong, &HashMap::new(), &HashMap::new(), [None, None]).unwrap_err();
        assert!(e.contains(
            "expected type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy"
        ));
    }
}
