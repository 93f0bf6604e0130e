//! `security.istio.io` RequestAuthentication to Envoy's `jwt_authn` filter, as istiod renders
//! it for a gateway (pilot/pkg/security/authn/policy_applier.go): every jwtRule of every
//! policy selecting the gateway, sorted by issuer, is a provider `origins-<i>` that puts the
//! payload in metadata under `payload` (AuthorizationPolicy's `requestPrincipals` and claims
//! read it there) and clears the route cache (claim-based routing); a request may carry no
//! token, but a token it carries must be valid.
//!
//! Keys: inline `jwks` as given. A `jwksUri` naming a service of the mesh (a cluster of this
//! control plane) is fetched by the gateway through that cluster (`remote_jwks`, istiod's
//! hybrid mode). Any other `jwksUri` would be fetched by istiod itself; this control plane
//! reads no network, so such a rule gets a key set whose private key exists nowhere: its
//! tokens are refused (fail closed, as istiod does when its fetch fails), and it is reported.

use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use super::authz::{TargetRef, WorkloadSelector};

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestAuthenticationSpec {
    #[serde(default)]
    pub selector: Option<WorkloadSelector>,
    #[serde(default)]
    pub target_ref: Option<TargetRef>,
    #[serde(default)]
    pub target_refs: Vec<TargetRef>,
    #[serde(default)]
    pub jwt_rules: Vec<JwtRule>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtRule {
    pub issuer: String,
    #[serde(default)]
    pub audiences: Vec<String>,
    #[serde(default)]
    pub jwks_uri: String,
    #[serde(default)]
    pub jwks: String,
    #[serde(default)]
    pub from_headers: Vec<JwtHeader>,
    #[serde(default)]
    pub from_params: Vec<String>,
    #[serde(default)]
    pub from_cookies: Vec<String>,
    #[serde(default)]
    pub output_payload_to_header: String,
    #[serde(default)]
    pub forward_original_token: bool,
    #[serde(default)]
    pub output_claim_to_headers: Vec<ClaimToHeader>,
    #[serde(default)]
    pub timeout: Option<String>,
    #[serde(default)]
    pub space_delimited_claims: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtHeader {
    pub name: String,
    #[serde(default)]
    pub prefix: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimToHeader {
    pub header: String,
    pub claim: String,
}

/// A key set nobody can sign for: the private key was discarded when it was generated.
pub const PUBLIC_ONLY_JWKS: &str = r#"{"keys":[{"kty":"RSA","alg":"RS256","use":"sig","kid":"portico-fail-closed","e":"AQAB","n":"6c7ZsRenh2-PXyp4cGZzpVjGsG96JUo1AM-9ltw7ngbA2-hwtxijQXXgfSiByzEi71bNABf-ygqE7UfOszLr546SSIWMmenhR0X14A74WbJZDUs4bqU4K1z7s2WNAeKD9xbB51bPpAHZKTCWlLVe5hsPioK4-u9eiP-W__s1O184qdspOtM2w6waP3ykVUOnsas03ypwlPsPqjoOQdDUaYw1c9ZuYJ9DgvS2b0-xc9OMjtzC1rEIsS3HKZMrydPRQmi_lg2B18L2cy_xr7NqNgbl96oTLsbMj476bb0oPzCA6_bCZVmT6QnK1AU8jFBXr1aJUkXkvlVq2rPIWVF7Rw"}]}"#;

/// One jwtRule with where it came from, for reports.
pub struct Rule<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub index: usize,
    pub rule: &'a JwtRule,
}

/// The `jwt_authn` filter for these rules (None without rules) and the problems met:
/// (namespace, name, reason). `cluster_for` maps a jwksUri's host and port to a cluster of the
/// mesh, if there is one.
pub fn jwt_filter(
    rules: &[Rule<'_>],
    cluster_for: &dyn Fn(&str, u16) -> Option<String>,
) -> (Option<Json>, Vec<(String, String, String)>) {
    let mut problems = Vec::new();
    if rules.is_empty() {
        return (None, problems);
    }
    let mut sorted: Vec<&Rule<'_>> = rules.iter().collect();
    // istiod sorts by issuer (a stable sort: equal issuers keep their order).
    sorted.sort_by(|a, b| a.rule.issuer.cmp(&b.rule.issuer));
    let mut providers = Map::new();
    let mut inner_and = Vec::new();
    let mut outer_or = Vec::new();
    for (i, r) in sorted.iter().enumerate() {
        let j = r.rule;
        let at = format!("spec.jwtRules[{}]", r.index);
        let mut p = Map::new();
        p.insert("issuer".into(), j.issuer.clone().into());
        if !j.audiences.is_empty() {
            p.insert("audiences".into(), json!(j.audiences));
        }
        if j.forward_original_token {
            p.insert("forward".into(), true.into());
        }
        if !j.output_payload_to_header.is_empty() {
            p.insert(
                "forward_payload_header".into(),
                j.output_payload_to_header.clone().into(),
            );
        }
        p.insert("payload_in_metadata".into(), "payload".into());
        let mut claims: Vec<String> = vec!["permission".into(), "scope".into()];
        if let Some(extra) = &j.space_delimited_claims {
            claims.extend(extra.iter().cloned());
            claims.sort();
            claims.dedup();
        }
        p.insert(
            "normalize_payload_in_metadata".into(),
            json!({"space_delimited_claims": claims}),
        );
        p.insert("clear_route_cache".into(), true.into());
        if !j.output_claim_to_headers.is_empty() {
            let c: Vec<Json> = j
                .output_claim_to_headers
                .iter()
                .map(|c| json!({"header_name": c.header, "claim_name": c.claim}))
                .collect();
            p.insert("claim_to_headers".into(), c.into());
        }
        if !j.from_headers.is_empty() {
            let h: Vec<Json> = j
                .from_headers
                .iter()
                .map(|h| {
                    let mut m = Map::new();
                    m.insert("name".into(), h.name.clone().into());
                    if !h.prefix.is_empty() {
                        m.insert("value_prefix".into(), h.prefix.clone().into());
                    }
                    Json::Object(m)
                })
                .collect();
            p.insert("from_headers".into(), h.into());
        }
        if !j.from_params.is_empty() {
            p.insert("from_params".into(), json!(j.from_params));
        }
        if !j.from_cookies.is_empty() {
            p.insert("from_cookies".into(), json!(j.from_cookies));
        }
        let timeout = match j.timeout.as_deref() {
            None => "5s".to_string(),
            Some(t) => match super::translate::duration(t) {
                Ok(d) => d,
                Err(e) => {
                    problems.push((
                        r.namespace.into(),
                        r.name.into(),
                        format!("{at}.timeout: {e}; 5s used"),
                    ));
                    "5s".into()
                }
            },
        };
        let mut local = |keys: &str| {
            p.insert("local_jwks".into(), json!({"inline_string": keys}));
        };
        if !j.jwks.is_empty() {
            local(&j.jwks);
        } else if !j.jwks_uri.is_empty() {
            match uri_host_port(&j.jwks_uri).and_then(|(h, port)| cluster_for(&h, port)) {
                Some(cluster) => {
                    p.insert(
                        "remote_jwks".into(),
                        json!({
                            "http_uri": {"uri": j.jwks_uri, "cluster": cluster, "timeout": timeout},
                            "cache_duration": "300s"
                        }),
                    );
                }
                None => {
                    problems.push((
                        r.namespace.into(),
                        r.name.into(),
                        format!(
                            "{at}.jwksUri: {} is not a service of the mesh and this control plane fetches no keys itself; tokens of issuer {} are refused until the keys are given inline (jwks) or the host is registered (ServiceEntry)",
                            j.jwks_uri, j.issuer
                        ),
                    ));
                    local(PUBLIC_ONLY_JWKS);
                }
            }
        } else {
            problems.push((
                r.namespace.into(),
                r.name.into(),
                format!(
                    "{at}: neither jwks nor jwksUri is set (istiod would discover the keys from the issuer); tokens of issuer {} are refused",
                    j.issuer
                ),
            ));
            local(PUBLIC_ONLY_JWKS);
        }
        let name = format!("origins-{i}");
        providers.insert(name.clone(), Json::Object(p));
        inner_and.push(json!({"requires_any": {"requirements": [
            {"provider_name": name},
            {"allow_missing": {}}
        ]}}));
        outer_or.push(json!({"provider_name": name}));
    }
    let requires = if inner_and.len() == 1 {
        inner_and.pop().unwrap_or(Json::Null)
    } else {
        outer_or.push(json!({"requires_all": {"requirements": inner_and}}));
        json!({"requires_any": {"requirements": outer_or}})
    };
    let filter = json!({
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": providers,
            "rules": [{"match": {"prefix": "/"}, "requires": requires}],
            "bypass_cors_preflight": true
        }
    });
    (Some(filter), problems)
}

/// The host and port of an http(s) URI (the scheme's port when none is given).
fn uri_host_port(uri: &str) -> Option<(String, u16)> {
    let (scheme, rest) = uri.split_once("://")?;
    let default = match scheme {
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    let authority = rest.split(['/', '?', '#']).next()?;
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || p.parse::<u16>().is_ok() => {
            Some((h.trim_matches(['[', ']']).to_string(), p.parse().ok()?))
        }
        _ => Some((authority.trim_matches(['[', ']']).to_string(), default)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(issuer: &str) -> JwtRule {
        JwtRule {
            issuer: issuer.into(),
            jwks: r#"{"keys":[]}"#.into(),
            ..Default::default()
        }
    }

    #[test]
    fn one_provider_requires_it_or_nothing() {
        let r = rule("https://issuer.example");
        let rules = [Rule {
            namespace: "istio-system",
            name: "jwt",
            index: 0,
            rule: &r,
        }];
        let (f, problems) = jwt_filter(&rules, &|_, _| None);
        assert!(problems.is_empty());
        let f = f.expect("filter");
        let cfg = &f["typed_config"];
        assert_eq!(
            cfg["rules"][0]["requires"],
            json!({"requires_any": {"requirements": [{"provider_name": "origins-0"}, {"allow_missing": {}}]}})
        );
        let p = &cfg["providers"]["origins-0"];
        assert_eq!(p["payload_in_metadata"], "payload");
        assert_eq!(p["clear_route_cache"], true);
        assert_eq!(
            p["normalize_payload_in_metadata"]["space_delimited_claims"],
            json!(["permission", "scope"])
        );
        assert_eq!(p["local_jwks"]["inline_string"], r#"{"keys":[]}"#);
        assert_eq!(cfg["bypass_cors_preflight"], true);
    }

    #[test]
    fn several_providers_sorted_by_issuer_any_one_or_each_valid_if_present() {
        let (b, a) = (rule("b.example"), rule("a.example"));
        let rules = [
            Rule {
                namespace: "ns",
                name: "b",
                index: 0,
                rule: &b,
            },
            Rule {
                namespace: "ns",
                name: "a",
                index: 0,
                rule: &a,
            },
        ];
        let (f, _) = jwt_filter(&rules, &|_, _| None);
        let cfg = &f.expect("filter")["typed_config"];
        assert_eq!(cfg["providers"]["origins-0"]["issuer"], "a.example");
        assert_eq!(
            cfg["rules"][0]["requires"]["requires_any"]["requirements"][2]["requires_all"]
                ["requirements"][1],
            json!({"requires_any": {"requirements": [{"provider_name": "origins-1"}, {"allow_missing": {}}]}})
        );
    }

    #[test]
    fn a_mesh_jwks_uri_is_fetched_through_its_cluster_an_external_one_fails_closed() {
        let mut r = rule("https://auth.example");
        r.jwks.clear();
        r.jwks_uri = "http://keys.auth.svc.cluster.local:8080/jwks".into();
        let rules = [Rule {
            namespace: "ns",
            name: "jwt",
            index: 0,
            rule: &r,
        }];
        let lookup = |h: &str, p: u16| {
            (h == "keys.auth.svc.cluster.local" && p == 8080)
                .then(|| "outbound|8080||keys.auth.svc.cluster.local".to_string())
        };
        let (f, problems) = jwt_filter(&rules, &lookup);
        assert!(problems.is_empty());
        let p = &f.expect("filter")["typed_config"]["providers"]["origins-0"];
        assert_eq!(
            p["remote_jwks"]["http_uri"]["cluster"],
            "outbound|8080||keys.auth.svc.cluster.local"
        );
        r.jwks_uri = "https://www.googleapis.com/oauth2/v3/certs".into();
        let rules = [Rule {
            namespace: "ns",
            name: "jwt",
            index: 0,
            rule: &r,
        }];
        let (f, problems) = jwt_filter(&rules, &lookup);
        assert!(
            problems[0].2.starts_with("spec.jwtRules[0].jwksUri:"),
            "{problems:?}"
        );
        let p = &f.expect("filter")["typed_config"]["providers"]["origins-0"];
        assert_eq!(p["local_jwks"]["inline_string"], PUBLIC_ONLY_JWKS);
    }

    #[test]
    fn uri_hosts_and_ports() {
        assert_eq!(uri_host_port("https://a.b/x"), Some(("a.b".into(), 443)));
        assert_eq!(uri_host_port("http://a.b:81/x"), Some(("a.b".into(), 81)));
        assert_eq!(uri_host_port("ftp://a.b/x"), None);
    }
}
