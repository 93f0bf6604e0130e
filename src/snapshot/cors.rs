//! CORS policies as Envoy's `envoy.filters.http.cors` filter applies them: per-filter configs
//! on the route, its virtual host and the route configuration (most specific first, each field
//! from the first policy that sets it), or the deprecated `cors` fields when there are none.
//! Resolved once per route at snapshot build time.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::http::cors::v3 as cpb;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::route::{string_matcher, StringMatch};

pub const FILTER: &str = "envoy.filters.http.cors";
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
    super::per_million(f, 1_000_000).map_err(|e| format!("filter_enabled: {e}"))
}

fn from_typed(any: &Any) -> Result<Policy, String> {
    if any.type_url != POLICY_TYPE {
        return Err(format!(
            "typed_per_filter_config['{FILTER}']: expected {POLICY_TYPE}, found {}",
            any.type_url
        ));
    }
    let p = cpb::CorsPolicy::decode(any.value.as_slice())
        .map_err(|e| format!("typed_per_filter_config['{FILTER}']: {e}"))?;
    Ok(Policy {
        allow_origins: p
            .allow_origin_string_match
            .iter()
            .map(string_matcher)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("cors allow_origin_string_match: {e}"))?,
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
        allow_origins: p
            .allow_origin_string_match
            .iter()
            .map(string_matcher)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("cors allow_origin_string_match: {e}"))?,
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

/// The CORS policy of a route, from its own, its virtual host's and its route
/// configuration's per-filter configs (in that order), else their deprecated `cors` fields.
pub fn resolve(
    route: &HashMap<String, Any>,
    vhost: &HashMap<String, Any>,
    config: &HashMap<String, Any>,
    deprecated: [Option<&rpb::CorsPolicy>; 2],
) -> Result<Option<Cors>, String> {
    let mut policies = Vec::new();
    for map in [route, vhost, config] {
        if let Some(any) = map.get(FILTER) {
            policies.push(from_typed(any)?);
        }
    }
    if policies.is_empty() {
        for p in deprecated.into_iter().flatten() {
            policies.push(from_deprecated(p)?);
        }
    }
    let Some(first) = policies.first() else {
        return Ok(None);
    };
    let text = |f: fn(&Policy) -> &String| {
        policies
            .iter()
            .map(f)
            .find(|s| !s.is_empty())
            .cloned()
            .unwrap_or_default()
    };
    let flag = |f: fn(&Policy) -> Option<bool>| policies.iter().find_map(f);
    Ok(Some(Cors {
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
    }))
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
        let c = resolve(&route, &vhost, &HashMap::new(), [None, None])
            .unwrap()
            .unwrap();
        assert_eq!(c.allow_methods, "GET");
        assert!(c.allow_credentials && c.forward_not_matching_preflights);
        assert!(c.origin_allowed("https://a") && !c.origin_allowed("https://b"));
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
        let c = resolve(
            &HashMap::new(),
            &HashMap::new(),
            &HashMap::new(),
            [Some(&old), None],
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.allow_methods, "POST");
        let typed_one = typed(cpb::CorsPolicy::default());
        let c = resolve(
            &typed_one,
            &HashMap::new(),
            &HashMap::new(),
            [Some(&old), None],
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.allow_methods, "");
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
