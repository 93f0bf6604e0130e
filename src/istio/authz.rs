//! `security.istio.io` AuthorizationPolicy (ALLOW, DENY, AUDIT) to Envoy's RBAC filters, as
//! istiod's authorization builder renders them (pilot/pkg/security/authz/{builder,model,
//! matcher}): one rule of a policy becomes one RBAC policy named
//! `ns[<namespace>]-policy[<name>]-rule[<index>]`; a rule's `from` sources become principals,
//! its `to` operations permissions, its `when` conditions are folded into both; AUDIT, DENY and
//! ALLOW become one filter each, in that order; `istio.io/dry-run` policies go to the shadow
//! rules. Output is proto-JSON (snake_case), compared with istiod's own golden files in the
//! tests.
//!
//! istiod's error handling is kept: a value that cannot be rendered drops the whole rule from
//! an ALLOW policy (a narrower allow) and only that value from a DENY or AUDIT policy (a wider
//! deny).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

/// The policy's spec, as the API defines it (unknown fields refused, as the API server does).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuthorizationPolicySpec {
    #[serde(default)]
    pub selector: Option<WorkloadSelector>,
    #[serde(default)]
    pub target_ref: Option<TargetRef>,
    #[serde(default)]
    pub target_refs: Vec<TargetRef>,
    #[serde(default)]
    pub rules: Vec<Option<Rule>>,
    #[serde(default)]
    pub action: Option<String>,
    #[serde(default)]
    pub provider: Option<Provider>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkloadSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TargetRef {
    #[serde(default)]
    pub group: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Provider {
    #[serde(default)]
    pub name: String,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    #[serde(default)]
    pub from: Vec<From>,
    #[serde(default)]
    pub to: Vec<To>,
    #[serde(default)]
    pub when: Vec<Condition>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct From {
    #[serde(default)]
    pub source: Option<Source>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Source {
    #[serde(default)]
    pub principals: Vec<String>,
    #[serde(default)]
    pub not_principals: Vec<String>,
    #[serde(default)]
    pub request_principals: Vec<String>,
    #[serde(default)]
    pub not_request_principals: Vec<String>,
    #[serde(default)]
    pub namespaces: Vec<String>,
    #[serde(default)]
    pub not_namespaces: Vec<String>,
    #[serde(default)]
    pub service_accounts: Vec<String>,
    #[serde(default)]
    pub not_service_accounts: Vec<String>,
    #[serde(default)]
    pub trust_domains: Vec<String>,
    #[serde(default)]
    pub not_trust_domains: Vec<String>,
    #[serde(default)]
    pub ip_blocks: Vec<String>,
    #[serde(default)]
    pub not_ip_blocks: Vec<String>,
    #[serde(default)]
    pub remote_ip_blocks: Vec<String>,
    #[serde(default)]
    pub not_remote_ip_blocks: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct To {
    #[serde(default)]
    pub operation: Option<Operation>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Operation {
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default)]
    pub not_hosts: Vec<String>,
    #[serde(default)]
    pub ports: Vec<String>,
    #[serde(default)]
    pub not_ports: Vec<String>,
    #[serde(default)]
    pub methods: Vec<String>,
    #[serde(default)]
    pub not_methods: Vec<String>,
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub not_paths: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Condition {
    pub key: String,
    #[serde(default)]
    pub values: Vec<String>,
    #[serde(default)]
    pub not_values: Vec<String>,
}

/// The three actions this module renders; CUSTOM goes through ext_authz.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Allow,
    Deny,
    Audit,
}

impl Action {
    fn rbac(self) -> &'static str {
        match self {
            Action::Allow => "ALLOW",
            Action::Deny => "DENY",
            Action::Audit => "LOG",
        }
    }
}

/// The policy's action (`None` for CUSTOM: not rendered here), or why it is not one.
pub fn action(spec: &AuthorizationPolicySpec) -> Result<Option<Action>, String> {
    match spec.action.as_deref().unwrap_or("ALLOW") {
        "ALLOW" => Ok(Some(Action::Allow)),
        "DENY" => Ok(Some(Action::Deny)),
        "AUDIT" => Ok(Some(Action::Audit)),
        "CUSTOM" => Ok(None),
        other => Err(format!("spec.action: unknown action '{other}'")),
    }
}

/// One policy as the builder takes it.
#[derive(Debug, Clone, Copy)]
pub struct Policy<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub spec: &'a AuthorizationPolicySpec,
    /// The `istio.io/dry-run` annotation was "true".
    pub dry_run: bool,
}

/// A problem met building the filters: the policy (namespace, name) and what was skipped.
pub type Problem = (String, String, String);

/// istiod's `BuildHTTP`: the AUDIT, DENY and ALLOW RBAC HTTP filters for these policies, in
/// that order; and the problems met (rules skipped).
pub fn build_http(policies: &[Policy<'_>], for_tcp: bool) -> (Vec<Json>, Vec<Problem>) {
    build_filters(policies, for_tcp, false)
}

/// istiod's `BuildTCP`: the same as network RBAC filters for a TCP chain (HTTP-only
/// conditions drop an ALLOW rule, and only themselves from a DENY or AUDIT rule).
pub fn build_tcp(policies: &[Policy<'_>]) -> (Vec<Json>, Vec<Problem>) {
    build_filters(policies, true, true)
}

fn build_filters(
    policies: &[Policy<'_>],
    for_tcp: bool,
    network: bool,
) -> (Vec<Json>, Vec<Problem>) {
    let mut problems = Vec::new();
    let mut out = Vec::new();
    for action in [Action::Audit, Action::Deny, Action::Allow] {
        let of: Vec<&Policy<'_>> = policies
            .iter()
            .filter(|p| matches!(self::action(p.spec), Ok(Some(a)) if a == action))
            .collect();
        if let Some((rules, shadow)) = build(&of, action, for_tcp, &mut problems) {
            let mut config = Map::new();
            let (name, type_url) = if network {
                (
                    "envoy.filters.network.rbac",
                    "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC",
                )
            } else {
                (
                    "envoy.filters.http.rbac",
                    "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
                )
            };
            config.insert("@type".into(), type_url.into());
            if let Some(r) = rules {
                config.insert("rules".into(), r);
            }
            if network {
                config.insert("stat_prefix".into(), "tcp.".into());
            }
            // istiod reads the shadow rules' action even when there are none (ALLOW's prefix).
            let prefix = match (shadow.is_some(), action) {
                (true, Action::Deny) => "istio_dry_run_deny_",
                (true, Action::Audit) => "",
                _ => "istio_dry_run_allow_",
            };
            if let Some(s) = shadow {
                config.insert("shadow_rules".into(), s);
            }
            if !prefix.is_empty() {
                config.insert("shadow_rules_stat_prefix".into(), prefix.into());
            }
            out.push(json!({"name": name, "typed_config": Json::Object(config)}));
        }
    }
    (out, problems)
}

/// Whether a policy applies to the gateway: a `targetRef(s)` naming its Kubernetes Gateway, or
/// else a selector matching its labels, in the gateway's namespace or the root namespace
/// (istiod's `PolicyMatcherForProxy` for a gateway pod).
pub fn selects(
    selector: Option<&WorkloadSelector>,
    target_refs: &[&TargetRef],
    policy_namespace: &str,
    node_namespace: &str,
    labels: &BTreeMap<String, String>,
) -> bool {
    if !target_refs.is_empty() {
        let gateway = labels.get("gateway.networking.k8s.io/gateway-name");
        return target_refs.iter().any(|r| {
            let ns = if r.namespace.is_empty() {
                policy_namespace
            } else {
                &r.namespace
            };
            r.kind == "Gateway" && gateway == Some(&r.name) && ns == node_namespace
        });
    }
    if policy_namespace != node_namespace && policy_namespace != ROOT_NAMESPACE {
        return false;
    }
    selector.is_none_or(|s| s.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// istiod's default root namespace: its policies apply mesh-wide.
pub const ROOT_NAMESPACE: &str = "istio-system";

/// The enforced and the shadow rule sets of one action, or None without policies.
#[allow(clippy::type_complexity)]
fn build(
    policies: &[&Policy<'_>],
    action: Action,
    for_tcp: bool,
    problems: &mut Vec<Problem>,
) -> Option<(Option<Json>, Option<Json>)> {
    build_named(policies, action, for_tcp, "", problems)
}

/// [`build`] with a prefix on every policy name (CUSTOM's `istio-ext-authz-<provider>-`).
#[allow(clippy::type_complexity)]
fn build_named(
    policies: &[&Policy<'_>],
    action: Action,
    for_tcp: bool,
    prefix: &str,
    problems: &mut Vec<Problem>,
) -> Option<(Option<Json>, Option<Json>)> {
    if policies.is_empty() {
        return None;
    }
    let mut enforced: Option<Map<String, Json>> = None;
    let mut shadow: Option<Map<String, Json>> = None;
    for p in policies {
        let set = if p.dry_run {
            shadow.get_or_insert_with(Map::new)
        } else {
            enforced.get_or_insert_with(Map::new)
        };
        for (i, rule) in p.spec.rules.iter().enumerate() {
            let name = format!("{prefix}ns[{}]-policy[{}]-rule[{i}]", p.namespace, p.name);
            let mut problem =
                |m: String| problems.push((p.namespace.to_string(), p.name.to_string(), m));
            let Some(rule) = rule else {
                problem(format!("spec.rules[{i}]: skipped nil rule {name}"));
                continue;
            };
            let model = match Model::new(p.namespace, rule) {
                Ok(m) => m,
                Err(e) => {
                    problem(format!("spec.rules[{i}]: skipped invalid rule {name}: {e}"));
                    continue;
                }
            };
            match model.generate(for_tcp, action) {
                Ok(policy) => {
                    set.insert(name, policy);
                }
                // On a TCP chain an HTTP-only rule is left out there, as istiod does: not a
                // problem of the policy.
                Err(_) if for_tcp => {}
                Err(e) => problem(format!("spec.rules[{i}]: skipped rule {name}: {e}")),
            }
        }
        if p.spec.rules.is_empty() {
            let name = format!("{prefix}ns[{}]-policy[{}]-rule[0]", p.namespace, p.name);
            set.insert(
                name,
                json!({
                    "permissions": [{"not_rule": {"any": true}}],
                    "principals": [{"not_id": {"any": true}}]
                }),
            );
        }
    }
    let wrap = |m: Option<Map<String, Json>>| {
        m.map(|m| json!({"action": action.rbac(), "policies": Json::Object(m)}))
    };
    Some((wrap(enforced), wrap(shadow)))
}

// ---------------------------------------------------------------------------------------------
// CUSTOM: external authorization through a provider of the mesh config (istiod's extauthz.go).

/// The part of Istio's MeshConfig (the `mesh` key of the `istio` ConfigMap) CUSTOM reads.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MeshConfig {
    #[serde(default)]
    pub extension_providers: Vec<ExtensionProvider>,
}

/// One extension provider; kinds other than the two ext_authz ones (tracing, access
/// logging) are kept out of the way.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionProvider {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub envoy_ext_authz_http: Option<ExtAuthzHttp>,
    #[serde(default)]
    pub envoy_ext_authz_grpc: Option<ExtAuthzGrpc>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtAuthzHttp {
    pub service: String,
    #[serde(default)]
    pub port: u32,
    #[serde(default)]
    pub timeout: Option<String>,
    #[serde(default)]
    pub path_prefix: String,
    #[serde(default)]
    pub fail_open: bool,
    #[serde(default)]
    pub status_on_error: String,
    #[serde(default)]
    pub include_request_headers_in_check: Vec<String>,
    #[serde(default)]
    pub include_headers_in_check: Vec<String>,
    #[serde(default)]
    pub include_additional_headers_in_check: BTreeMap<String, String>,
    #[serde(default)]
    pub include_request_body_in_check: Option<RequestBody>,
    #[serde(default)]
    pub headers_to_upstream_on_allow: Vec<String>,
    #[serde(default)]
    pub headers_to_downstream_on_deny: Vec<String>,
    #[serde(default)]
    pub headers_to_downstream_on_allow: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtAuthzGrpc {
    pub service: String,
    #[serde(default)]
    pub port: u32,
    #[serde(default)]
    pub timeout: Option<String>,
    #[serde(default)]
    pub fail_open: bool,
    #[serde(default)]
    pub status_on_error: String,
    #[serde(default)]
    pub include_request_body_in_check: Option<RequestBody>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestBody {
    #[serde(default)]
    pub max_request_bytes: u32,
    #[serde(default)]
    pub allow_partial_message: bool,
    #[serde(default)]
    pub pack_as_bytes: bool,
}

/// A provider's filters: HTTP, and for gRPC providers the network one too.
struct BuiltExtAuthz {
    http: Json,
    tcp: Option<Json>,
}

/// A mesh cluster for a provider's `service` (`[<namespace>/]<hostname>`) and port:
/// (hostname, cluster name), or why there is none.
pub type ClusterLookup<'a> = &'a dyn Fn(&str, u32) -> Result<(String, String), String>;

fn resolve_providers(
    mesh: &MeshConfig,
    lookup: ClusterLookup<'_>,
) -> BTreeMap<String, Result<BuiltExtAuthz, String>> {
    let mut out = BTreeMap::new();
    for (i, p) in mesh.extension_providers.iter().enumerate() {
        let mut errs: Vec<String> = Vec::new();
        if p.name.is_empty() {
            errs.push(format!(
                "extension provider name must not be empty, found empty at index: {i}"
            ));
        } else if out.contains_key(&p.name) {
            errs.push(format!(
                "extension provider name must be unique, found duplicate: {}",
                p.name
            ));
        }
        let built = match (&p.envoy_ext_authz_http, &p.envoy_ext_authz_grpc) {
            (Some(h), _) => ext_authz_http(h, lookup),
            (None, Some(g)) => ext_authz_grpc(g, lookup),
            (None, None) => continue,
        };
        let entry = match built {
            Err(e) => {
                errs.push(format!(
                    "failed to parse extension provider {:?}: {e}",
                    p.name
                ));
                Err(errs.join("; "))
            }
            Ok(_) if !errs.is_empty() => Err(errs.join("; ")),
            Ok(b) => Ok(b),
        };
        out.entry(p.name.clone()).or_insert(entry);
    }
    out
}

fn provider_port(port: u32) -> Result<u32, String> {
    if (1..=65535).contains(&port) {
        Ok(port)
    } else {
        Err(format!(
            "port must be in the range [1, 65535], found: {port}"
        ))
    }
}

/// `statusOnError` as Envoy's HttpStatus code name.
fn status_on_error(s: &str) -> Result<Option<Json>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    let code: u16 = s
        .parse()
        .map_err(|_| format!("invalid statusOnError {s:?}"))?;
    use envoy_types::pb::envoy::r#type::v3::StatusCode;
    match StatusCode::try_from(i32::from(code)) {
        Ok(c) if code != 0 => Ok(Some(json!({"code": c.as_str_name()}))),
        _ => Err(format!("unsupported statusOnError {s}")),
    }
}

fn timeout_or_default(t: &Option<String>) -> Result<String, String> {
    match t {
        None => Ok("600s".into()),
        Some(t) => super::translate::duration(t),
    }
}

fn header_list(headers: &[String]) -> Option<Json> {
    if headers.is_empty() {
        return None;
    }
    let patterns: Vec<Json> = headers
        .iter()
        .map(|h| {
            if let Some(rest) = h.strip_prefix('*') {
                json!({"ignore_case": true, "suffix": rest})
            } else if let Some(rest) = h.strip_suffix('*') {
                json!({"ignore_case": true, "prefix": rest})
            } else {
                json!({"ignore_case": true, "exact": h})
            }
        })
        .collect();
    Some(json!({"patterns": patterns}))
}

fn body(b: &Option<RequestBody>) -> Option<Json> {
    b.as_ref().map(|b| {
        let mut m = Map::new();
        m.insert("max_request_bytes".into(), b.max_request_bytes.into());
        m.insert(
            "allow_partial_message".into(),
            b.allow_partial_message.into(),
        );
        m.insert("pack_as_bytes".into(), b.pack_as_bytes.into());
        Json::Object(m)
    })
}

fn enabled_metadata(filter: &str, prefix: &str) -> Json {
    json!({
        "filter": filter,
        "path": [{"key": "istio_ext_authz_shadow_effective_policy_id"}],
        "value": {"string_match": {"prefix": prefix}}
    })
}

fn ext_authz_http(c: &ExtAuthzHttp, lookup: ClusterLookup<'_>) -> Result<BuiltExtAuthz, String> {
    let mut errs = Vec::new();
    let port = provider_port(c.port).map_err(|e| errs.push(e)).ok();
    let found = port.and_then(|p| lookup(&c.service, p).map_err(|e| errs.push(e)).ok());
    let status = status_on_error(&c.status_on_error)
        .map_err(|e| errs.push(e))
        .ok()
        .flatten();
    if !c.path_prefix.is_empty() && !c.path_prefix.starts_with('/') {
        errs.push(format!(
            "pathPrefix must begin with `/`, found: {:?}",
            c.path_prefix
        ));
    }
    for (field, values) in [
        (
            "IncludeRequestHeadersInCheck",
            &c.include_request_headers_in_check,
        ),
        ("IncludeHeadersInCheck", &c.include_headers_in_check),
        (
            "HeadersToDownstreamOnDeny",
            &c.headers_to_downstream_on_deny,
        ),
        (
            "HeadersToDownstreamOnAllow",
            &c.headers_to_downstream_on_allow,
        ),
        ("HeadersToUpstreamOnAllow", &c.headers_to_upstream_on_allow),
    ] {
        if values.iter().any(|v| v == "*") {
            errs.push(format!("a single wildcard (\"*\") is not supported, change it to either prefix or suffix match: {field}"));
        }
    }
    let timeout = timeout_or_default(&c.timeout)
        .map_err(|e| errs.push(e))
        .ok();
    let (Some((hostname, cluster)), Some(timeout), true) = (found, timeout, errs.is_empty()) else {
        return Err(errs.join("; "));
    };
    let mut service = Map::new();
    if !c.path_prefix.is_empty() {
        service.insert("path_prefix".into(), c.path_prefix.clone().into());
    }
    service.insert(
        "server_uri".into(),
        json!({"timeout": timeout, "uri": format!("http://{hostname}"), "cluster": cluster}),
    );
    if !c.include_additional_headers_in_check.is_empty() {
        let add: Vec<Json> = c
            .include_additional_headers_in_check
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        service.insert(
            "authorization_request".into(),
            json!({"headers_to_add": add}),
        );
    }
    if !c.headers_to_upstream_on_allow.is_empty()
        || !c.headers_to_downstream_on_deny.is_empty()
        || !c.headers_to_downstream_on_allow.is_empty()
    {
        let mut r = Map::new();
        for (k, v) in [
            ("allowed_upstream_headers", &c.headers_to_upstream_on_allow),
            ("allowed_client_headers", &c.headers_to_downstream_on_deny),
            (
                "allowed_client_headers_on_success",
                &c.headers_to_downstream_on_allow,
            ),
        ] {
            if let Some(l) = header_list(v) {
                r.insert(k.into(), l);
            }
        }
        service.insert("authorization_response".into(), Json::Object(r));
    }
    let mut http = Map::new();
    http.insert(
        "@type".into(),
        "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz".into(),
    );
    if let Some(s) = status {
        http.insert("status_on_error".into(), s);
    }
    if c.fail_open {
        http.insert("failure_mode_allow".into(), true.into());
    }
    http.insert("transport_api_version".into(), "V3".into());
    http.insert("http_service".into(), Json::Object(service));
    http.insert(
        "filter_enabled_metadata".into(),
        enabled_metadata("envoy.filters.http.rbac", "istio-ext-authz"),
    );
    if let Some(b) = body(&c.include_request_body_in_check) {
        http.insert("with_request_body".into(), b);
    }
    let allowed = header_list(&c.include_request_headers_in_check)
        .or_else(|| header_list(&c.include_headers_in_check));
    if let Some(a) = allowed {
        http.insert("allowed_headers".into(), a);
    }
    Ok(BuiltExtAuthz {
        http: Json::Object(http),
        tcp: None,
    })
}

fn ext_authz_grpc(c: &ExtAuthzGrpc, lookup: ClusterLookup<'_>) -> Result<BuiltExtAuthz, String> {
    let mut errs = Vec::new();
    let port = provider_port(c.port).map_err(|e| errs.push(e)).ok();
    let found = port.and_then(|p| lookup(&c.service, p).map_err(|e| errs.push(e)).ok());
    let status = status_on_error(&c.status_on_error)
        .map_err(|e| errs.push(e))
        .ok()
        .flatten();
    let timeout = timeout_or_default(&c.timeout)
        .map_err(|e| errs.push(e))
        .ok();
    let (Some((hostname, cluster)), Some(timeout), true) = (found, timeout, errs.is_empty()) else {
        return Err(errs.join("; "));
    };
    let grpc = json!({
        "envoy_grpc": {"cluster_name": cluster, "authority": hostname},
        "timeout": timeout
    });
    let mut http = Map::new();
    http.insert(
        "@type".into(),
        "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz".into(),
    );
    if let Some(s) = status {
        http.insert("status_on_error".into(), s);
    }
    if c.fail_open {
        http.insert("failure_mode_allow".into(), true.into());
    }
    http.insert("grpc_service".into(), grpc.clone());
    http.insert(
        "filter_enabled_metadata".into(),
        enabled_metadata("envoy.filters.http.rbac", "istio-ext-authz"),
    );
    http.insert("transport_api_version".into(), "V3".into());
    if let Some(b) = body(&c.include_request_body_in_check) {
        http.insert("with_request_body".into(), b);
    }
    let mut tcp = Map::new();
    tcp.insert(
        "@type".into(),
        "type.googleapis.com/envoy.extensions.filters.network.ext_authz.v3.ExtAuthz".into(),
    );
    tcp.insert("stat_prefix".into(), "tcp.".into());
    if c.fail_open {
        tcp.insert("failure_mode_allow".into(), true.into());
    }
    tcp.insert("transport_api_version".into(), "V3".into());
    tcp.insert("grpc_service".into(), grpc);
    tcp.insert(
        "filter_enabled_metadata".into(),
        enabled_metadata("envoy.filters.network.rbac", "istio-ext-authz"),
    );
    Ok(BuiltExtAuthz {
        http: Json::Object(http),
        tcp: Some(Json::Object(tcp)),
    })
}

/// Renames every policy of a rule set as istiod does when a CUSTOM provider is unusable,
/// and makes it a DENY: what the rules match is refused (fail closed).
fn bad_custom_deny(rules: &Option<Json>) -> Json {
    let mut policies = Map::new();
    if let Some(Json::Object(m)) = rules.as_ref().and_then(|r| r.get("policies")) {
        for (k, v) in m {
            policies.insert(format!("{k}-deny-due-to-bad-CUSTOM-action"), v.clone());
        }
    }
    json!({"action": "DENY", "policies": policies})
}

/// istiod's CUSTOM builder: per provider (sorted by name) an RBAC filter that only marks the
/// requests its rules match (shadow rules, `istio_ext_authz_` prefix) and the provider's
/// ext_authz filter, enabled by that mark. An unusable provider, or more than one provider
/// on the gateway (istiod's default), gives a DENY of what the rules match instead. Returns
/// the HTTP filters, the TCP filters and the problems.
pub fn build_custom(
    policies: &[Policy<'_>],
    mesh: &MeshConfig,
    lookup: ClusterLookup<'_>,
) -> (Vec<Json>, Vec<Json>, Vec<Problem>) {
    let mut problems = Vec::new();
    let (mut http, mut tcp) = (Vec::new(), Vec::new());
    let mut by_provider: BTreeMap<String, Vec<&Policy<'_>>> = BTreeMap::new();
    for p in policies {
        if matches!(action(p.spec), Ok(None)) {
            let name = p
                .spec
                .provider
                .as_ref()
                .map(|x| x.name.clone())
                .unwrap_or_default();
            by_provider.entry(name).or_default().push(p);
        }
    }
    if by_provider.is_empty() {
        return (http, tcp, problems);
    }
    let resolved = resolve_providers(mesh, lookup);
    let several = by_provider.len() > 1;
    for (provider, of) in &by_provider {
        let prefix = format!("istio-ext-authz-{provider}-");
        let enforced: Vec<&Policy<'_>> = of.iter().copied().filter(|p| !p.dry_run).collect();
        let dry: Vec<&Policy<'_>> = of.iter().copied().filter(|p| p.dry_run).collect();
        let rules_of = |set: &[&Policy<'_>], for_tcp: bool, problems: &mut Vec<Problem>| {
            build_named(set, Action::Deny, for_tcp, &prefix, problems)
                .and_then(|(r, _)| r)
                .unwrap_or_else(|| json!({"action": "DENY", "policies": {}}))
        };
        let found = match resolved.get(provider) {
            _ if several => Err(format!(
                "multiple CUSTOM authorization providers per workload are not enabled (istiod's PILOT_ENABLE_MULTIPLE_CUSTOM_AUTHZ_PROVIDERS), found {} providers: {:?}",
                by_provider.len(),
                by_provider.keys().collect::<Vec<_>>()
            )),
            None if provider.is_empty() => Err("no provider specified in authorization policy".into()),
            None => Err(format!(
                "available providers are {:?} but found {provider:?}",
                resolved.keys().collect::<Vec<_>>()
            )),
            Some(Err(e)) => Err(format!("found errors in provider {provider}: {e}")),
            Some(Ok(b)) => Ok(b),
        };
        let mut http_problems = Vec::new();
        let enforced_http = rules_of(&enforced, false, &mut http_problems);
        let dry_http = rules_of(&dry, false, &mut http_problems);
        match found {
            Err(e) => {
                for p in of {
                    problems.push((
                        p.namespace.to_string(),
                        p.name.to_string(),
                        format!("spec.provider: {e}; the policy's rules deny the requests they match (fail closed, as istiod does)"),
                    ));
                }
                http.push(rbac_filter(
                    false,
                    Some(bad_custom_deny(&Some(enforced_http))),
                    None,
                    None,
                ));
                let mut ignore = Vec::new();
                let enforced_tcp = rules_of(&enforced, true, &mut ignore);
                tcp.push(rbac_filter(
                    true,
                    Some(bad_custom_deny(&Some(enforced_tcp))),
                    None,
                    None,
                ));
            }
            Ok(b) => {
                problems.extend(http_problems);
                let has_dry = dry_http["policies"]
                    .as_object()
                    .is_some_and(|m| !m.is_empty());
                let enabled =
                    |filter: &str| enabled_metadata(filter, &format!("istio-ext-authz-{provider}"));
                http.push(rbac_filter(
                    false,
                    has_dry.then(|| dry_http.clone()),
                    Some(enforced_http),
                    Some("istio_ext_authz_"),
                ));
                let mut f = b.http.clone();
                f["filter_enabled_metadata"] = enabled("envoy.filters.http.rbac");
                http.push(json!({"name": "envoy.filters.http.ext_authz", "typed_config": f}));
                if let Some(t) = &b.tcp {
                    let mut ignore = Vec::new();
                    let enforced_tcp = rules_of(&enforced, true, &mut ignore);
                    let dry_tcp = rules_of(&dry, true, &mut ignore);
                    let has_dry = dry_tcp["policies"]
                        .as_object()
                        .is_some_and(|m| !m.is_empty());
                    tcp.push(rbac_filter(
                        true,
                        has_dry.then_some(dry_tcp),
                        Some(enforced_tcp),
                        Some("istio_ext_authz_"),
                    ));
                    let mut f = t.clone();
                    f["filter_enabled_metadata"] = enabled("envoy.filters.network.rbac");
                    tcp.push(json!({"name": "envoy.filters.network.ext_authz", "typed_config": f}));
                }
            }
        }
    }
    (http, tcp, problems)
}

/// An RBAC filter (HTTP or network) with the given rule sets.
fn rbac_filter(
    network: bool,
    rules: Option<Json>,
    shadow: Option<Json>,
    shadow_prefix: Option<&str>,
) -> Json {
    let mut config = Map::new();
    let (name, type_url) = if network {
        (
            "envoy.filters.network.rbac",
            "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC",
        )
    } else {
        (
            "envoy.filters.http.rbac",
            "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
        )
    };
    config.insert("@type".into(), type_url.into());
    if let Some(r) = rules {
        config.insert("rules".into(), r);
    }
    if network {
        config.insert("stat_prefix".into(), "tcp.".into());
    }
    if let Some(s) = shadow {
        config.insert("shadow_rules".into(), s);
    }
    if let Some(p) = shadow_prefix {
        config.insert("shadow_rules_stat_prefix".into(), p.into());
    }
    json!({"name": name, "typed_config": Json::Object(config)})
}

// ---------------------------------------------------------------------------------------------
// The model: a rule's conditions as permission and principal lists (istiod's `authz/model`).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gen {
    DestIp,
    DestPort,
    ConnSni,
    EnvoyFilter,
    SrcIp,
    RemoteIp,
    SrcNamespace,
    SrcTrustDomain,
    SrcServiceAccount,
    SrcPrincipal,
    RequestPrincipal,
    RequestAudiences,
    RequestPresenter,
    RequestHeader,
    RequestClaims,
    Host,
    Path,
    Method,
}

impl Gen {
    /// Generators that see all values at once (istiod's `extendedGenerator`).
    fn extended(self) -> bool {
        matches!(
            self,
            Gen::EnvoyFilter
                | Gen::RequestPrincipal
                | Gen::RequestAudiences
                | Gen::RequestPresenter
                | Gen::RequestClaims
        )
    }
}

#[derive(Debug, Clone)]
struct Cond {
    key: String,
    values: Vec<String>,
    not_values: Vec<String>,
    g: Gen,
}

#[derive(Debug, Clone, Default)]
struct RuleList(Vec<Cond>);

impl RuleList {
    fn push_back(&mut self, g: Gen, key: &str, values: &[String], not_values: &[String]) {
        if values.is_empty() && not_values.is_empty() {
            return;
        }
        self.0.push(Cond {
            key: key.into(),
            values: values.to_vec(),
            not_values: not_values.to_vec(),
            g,
        });
    }

    fn push_front(&mut self, g: Gen, key: &str, values: &[String], not_values: &[String]) {
        if values.is_empty() && not_values.is_empty() {
            return;
        }
        self.0.insert(
            0,
            Cond {
                key: key.into(),
                values: values.to_vec(),
                not_values: not_values.to_vec(),
                g,
            },
        );
    }
}

struct Model {
    namespace: String,
    permissions: Vec<RuleList>,
    principals: Vec<RuleList>,
}

impl Model {
    fn new(namespace: &str, r: &Rule) -> Result<Model, String> {
        let mut base_perm = RuleList::default();
        let mut base_princ = RuleList::default();
        for w in &r.when {
            let k = w.key.as_str();
            let (v, nv) = (&w.values, &w.not_values);
            match k {
                "destination.ip" => base_perm.push_back(Gen::DestIp, k, v, nv),
                "destination.port" => base_perm.push_back(Gen::DestPort, k, v, nv),
                "connection.sni" => base_perm.push_back(Gen::ConnSni, k, v, nv),
                _ if k.starts_with("experimental.envoy.filters.") => {
                    base_perm.push_back(Gen::EnvoyFilter, k, v, nv)
                }
                "source.ip" => base_princ.push_back(Gen::SrcIp, k, v, nv),
                "remote.ip" => base_princ.push_back(Gen::RemoteIp, k, v, nv),
                "source.namespace" => base_princ.push_back(Gen::SrcNamespace, k, v, nv),
                "source.trustDomain" => base_princ.push_back(Gen::SrcTrustDomain, k, v, nv),
                "source.serviceAccount" => base_princ.push_back(Gen::SrcServiceAccount, k, v, nv),
                "source.principal" => base_princ.push_back(Gen::SrcPrincipal, k, v, nv),
                "request.auth.principal" => base_princ.push_back(Gen::RequestPrincipal, k, v, nv),
                "request.auth.audiences" => base_princ.push_back(Gen::RequestAudiences, k, v, nv),
                "request.auth.presenter" => base_princ.push_back(Gen::RequestPresenter, k, v, nv),
                _ if k.starts_with("request.headers") => {
                    base_princ.push_back(Gen::RequestHeader, k, v, nv)
                }
                _ if k.starts_with("request.auth.claims") => {
                    base_princ.push_back(Gen::RequestClaims, k, v, nv)
                }
                _ => return Err(format!("unknown attribute {k}")),
            }
        }
        let mut principals = Vec::new();
        for f in &r.from {
            let mut merged = base_princ.clone();
            if let Some(s) = &f.source {
                merged.push_front(Gen::SrcIp, "source.ip", &s.ip_blocks, &s.not_ip_blocks);
                merged.push_front(
                    Gen::RemoteIp,
                    "remote.ip",
                    &s.remote_ip_blocks,
                    &s.not_remote_ip_blocks,
                );
                merged.push_front(
                    Gen::SrcNamespace,
                    "source.namespace",
                    &s.namespaces,
                    &s.not_namespaces,
                );
                merged.push_front(
                    Gen::SrcTrustDomain,
                    "source.trustDomain",
                    &s.trust_domains,
                    &s.not_trust_domains,
                );
                merged.push_front(
                    Gen::SrcServiceAccount,
                    "source.serviceAccount",
                    &s.service_accounts,
                    &s.not_service_accounts,
                );
                merged.push_front(
                    Gen::RequestPrincipal,
                    "request.auth.principal",
                    &s.request_principals,
                    &s.not_request_principals,
                );
                merged.push_front(
                    Gen::SrcPrincipal,
                    "source.principal",
                    &s.principals,
                    &s.not_principals,
                );
            }
            principals.push(merged);
        }
        if r.from.is_empty() {
            principals.push(base_princ);
        }
        let mut permissions = Vec::new();
        for t in &r.to {
            let mut merged = base_perm.clone();
            if let Some(o) = &t.operation {
                merged.push_front(Gen::DestPort, "destination.port", &o.ports, &o.not_ports);
                merged.push_front(Gen::Path, "path-matcher", &o.paths, &o.not_paths);
                merged.push_front(Gen::Method, ":method", &o.methods, &o.not_methods);
                merged.push_front(Gen::Host, ":authority", &o.hosts, &o.not_hosts);
            }
            permissions.push(merged);
        }
        if r.to.is_empty() {
            permissions.push(base_perm);
        }
        Ok(Model {
            namespace: namespace.into(),
            permissions,
            principals,
        })
    }

    fn generate(&self, for_tcp: bool, action: Action) -> Result<Json, String> {
        let mut permissions = Vec::new();
        for rl in &self.permissions {
            let mut and = Vec::new();
            for c in &rl.0 {
                and.extend(self.side(c, for_tcp, action, Side::Permission)?);
            }
            if and.is_empty() {
                and.push(json!({"any": true}));
            }
            permissions.push(json!({"and_rules": {"rules": and}}));
        }
        let mut principals = Vec::new();
        for rl in &self.principals {
            let mut and = Vec::new();
            for c in &rl.0 {
                and.extend(self.side(c, for_tcp, action, Side::Principal)?);
            }
            if and.is_empty() {
                and.push(json!({"any": true}));
            }
            principals.push(json!({"and_ids": {"ids": and}}));
        }
        Ok(json!({"permissions": permissions, "principals": principals}))
    }

    /// One condition as permissions or principals: its values OR-ed, its not-values OR-ed and
    /// negated. A value that cannot be rendered fails the rule for ALLOW and is skipped for
    /// DENY and AUDIT (istiod's `checkError`).
    fn side(
        &self,
        c: &Cond,
        for_tcp: bool,
        action: Action,
        side: Side,
    ) -> Result<Vec<Json>, String> {
        let check = |r: Result<Option<Json>, String>| match r {
            Err(e) if action == Action::Allow => Err(e),
            Err(_) => Ok(None),
            Ok(v) => Ok(v),
        };
        let (or_key, not_key) = match side {
            Side::Permission => ("or_rules", "not_rule"),
            Side::Principal => ("or_ids", "not_id"),
        };
        let set_key = match side {
            Side::Permission => "rules",
            Side::Principal => "ids",
        };
        let mut out = Vec::new();
        for (values, negate) in [(&c.values, false), (&c.not_values, true)] {
            if values.is_empty() {
                continue;
            }
            let item = if c.g.extended() {
                check(self.extended(c, values, for_tcp, side))?
            } else {
                let mut or = Vec::new();
                for v in values {
                    if let Some(x) = check(self.single(c, v, for_tcp, side))? {
                        or.push(x);
                    }
                }
                (!or.is_empty()).then(|| json!({or_key: {set_key: or}}))
            };
            if let Some(x) = item {
                out.push(if negate { json!({not_key: x}) } else { x });
            }
        }
        Ok(out)
    }

    fn single(&self, c: &Cond, v: &str, for_tcp: bool, side: Side) -> Result<Option<Json>, String> {
        let http_only = || Err(format!("{:?} is HTTP only", c.key));
        let unimplemented = || Err("unimplemented".to_string());
        let auth = |m: Json| Ok(Some(json!({"authenticated": {"principal_name": m}})));
        match (c.g, side) {
            (Gen::DestIp, Side::Permission) => Ok(Some(json!({"destination_ip": cidr(v)?}))),
            (Gen::DestPort, Side::Permission) => Ok(Some(json!({"destination_port": port(v)?}))),
            (Gen::ConnSni, Side::Permission) => Ok(Some(
                json!({"requested_server_name": string_matcher(v, "")}),
            )),
            (Gen::SrcIp, Side::Principal) => Ok(Some(json!({"direct_remote_ip": cidr(v)?}))),
            (Gen::RemoteIp, Side::Principal) => Ok(Some(json!({"remote_ip": cidr(v)?}))),
            (Gen::SrcNamespace, Side::Principal) => {
                let ns = v.split('*').map(quote_meta).collect::<Vec<_>>().join(".*");
                auth(json!({"safe_regex": {"regex": format!(".*/ns/{ns}/.*")}}))
            }
            (Gen::SrcTrustDomain, Side::Principal) => auth(if v == "*" {
                json!({"prefix": "spiffe://"})
            } else if !v.contains('*') {
                json!({"prefix": format!("spiffe://{v}/")})
            } else {
                let (a, b) = v.split_once('*').unwrap_or((v, ""));
                let re = format!("spiffe://{}[^/]*{}/.*", quote_meta(a), quote_meta(b));
                json!({"safe_regex": {"regex": re}})
            }),
            (Gen::SrcServiceAccount, Side::Principal) => {
                let (ns, sa) = v.split_once('/').unwrap_or((&self.namespace, v));
                let re = format!(
                    "spiffe://.+/ns/{}/(.+/|)sa/{}(/.+)?",
                    quote_meta(ns),
                    quote_meta(sa)
                );
                auth(json!({"safe_regex": {"regex": re}}))
            }
            (Gen::SrcPrincipal, Side::Principal) => auth(string_matcher(v, "spiffe://")),
            (Gen::RequestHeader, Side::Principal) => {
                if for_tcp {
                    return http_only();
                }
                let name = in_brackets(c.key.trim_start_matches("request.headers"))?;
                Ok(Some(json!({"header": header_matcher(&name, v, false)})))
            }
            (Gen::Host, Side::Permission) => {
                if for_tcp {
                    return http_only();
                }
                Ok(Some(
                    json!({"header": header_matcher(":authority", v, true)}),
                ))
            }
            (Gen::Method, Side::Permission) => {
                if for_tcp {
                    return http_only();
                }
                Ok(Some(json!({"header": header_matcher(":method", v, false)})))
            }
            (Gen::Path, Side::Permission) => {
                if for_tcp {
                    return http_only();
                }
                if v.contains("{*}") || v.contains("{**}") {
                    let t = v.replace("{**}", "**").replace("{*}", "*");
                    return Ok(Some(json!({"uri_template": {
                        "name": "uri-template",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.path.match.uri_template.v3.UriTemplateMatchConfig",
                            "path_template": t
                        }
                    }})));
                }
                Ok(Some(json!({"url_path": {"path": string_matcher(v, "")}})))
            }
            _ => unimplemented(),
        }
    }

    fn extended(
        &self,
        c: &Cond,
        values: &[String],
        for_tcp: bool,
        side: Side,
    ) -> Result<Option<Json>, String> {
        let http_only = || Err(format!("{:?} is HTTP only", c.key));
        match (c.g, side) {
            (Gen::EnvoyFilter, Side::Permission) => {
                let rest = c.key.trim_start_matches("experimental.");
                let rest = rest.strip_suffix(']').unwrap_or(rest);
                let Some((filter, key)) = rest.split_once('[') else {
                    return Err(format!("invalid key: {}", c.key));
                };
                let matchers: Vec<Json> = values
                    .iter()
                    .map(|v| {
                        if v.starts_with('[') && v.ends_with(']') {
                            let inner = v.trim_matches(|c| c == '[' || c == ']');
                            json!({"list_match": {"one_of": {"string_match": string_matcher(inner, "")}}})
                        } else {
                            json!({"string_match": string_matcher(v, "")})
                        }
                    })
                    .collect();
                Ok(Some(json!({"metadata": {
                    "filter": filter,
                    "path": [{"key": key}],
                    "value": or_matcher(matchers)
                }})))
            }
            (Gen::RequestPrincipal, Side::Principal) => {
                if for_tcp {
                    return http_only();
                }
                let any = || json!({"safe_regex": {"regex": ".+"}});
                let mut or = Vec::new();
                for v in values {
                    let (found, iss, sub) = match v.rfind('/') {
                        Some(i) => (true, &v[..i], &v[i + 1..]),
                        None => (false, v.as_str(), ""),
                    };
                    let (mi, ms) = if v == "*" {
                        (any(), any())
                    } else if let Some(rest) = v.strip_prefix('*') {
                        if found {
                            let mi = if iss == "*" {
                                any()
                            } else {
                                json!({"suffix": iss.trim_start_matches('*')})
                            };
                            (mi, json!({"exact": sub}))
                        } else {
                            (any(), json!({"suffix": rest}))
                        }
                    } else if let Some(rest) = v.strip_suffix('*') {
                        if found {
                            let ms = if sub == "*" {
                                any()
                            } else {
                                json!({"prefix": sub.trim_end_matches('*')})
                            };
                            (json!({"exact": iss}), ms)
                        } else {
                            (json!({"prefix": rest}), any())
                        }
                    } else {
                        (json!({"exact": iss}), json!({"exact": sub}))
                    };
                    let claim = |claim: &str, m: Json| {
                        json!({"metadata": {
                            "filter": "envoy.filters.http.jwt_authn",
                            "path": [{"key": "payload"}, {"key": claim}],
                            "value": {"string_match": m}
                        }})
                    };
                    or.push(json!({"and_ids": {"ids": [claim("iss", mi), claim("sub", ms)]}}));
                }
                Ok(match or.len() {
                    0 => None,
                    1 => or.pop(),
                    _ => Some(json!({"or_ids": {"ids": or}})),
                })
            }
            (Gen::RequestAudiences, Side::Principal) => {
                if for_tcp {
                    return http_only();
                }
                Ok(Some(jwt_claims(&["aud".to_string()], values)))
            }
            (Gen::RequestPresenter, Side::Principal) => {
                if for_tcp {
                    return http_only();
                }
                Ok(Some(jwt_claims(&["azp".to_string()], values)))
            }
            (Gen::RequestClaims, Side::Principal) => {
                if for_tcp {
                    return http_only();
                }
                let claims = nested_brackets(c.key.trim_start_matches("request.auth.claims"))?;
                Ok(Some(jwt_claims(&claims, values)))
            }
            _ => Err("unimplemented".into()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Permission,
    Principal,
}

/// A principal on JWT claims at `payload.<claims...>`: the claim as a list holding one of the
/// values, or the claim itself one of them.
fn jwt_claims(claims: &[String], values: &[String]) -> Json {
    let value = or_matcher(
        values
            .iter()
            .map(|v| json!({"string_match": string_matcher(v, "")}))
            .collect(),
    );
    let mut path = vec![json!({"key": "payload"})];
    path.extend(claims.iter().map(|c| json!({"key": c})));
    json!({"metadata": {
        "filter": "envoy.filters.http.jwt_authn",
        "path": path,
        "value": {"or_match": {"value_matchers": [
            {"list_match": {"one_of": value.clone()}},
            value
        ]}}
    }})
}

/// Go's `regexp.QuoteMeta`, as istiod escapes: the metacharacters `\.+*?()|[]{}^$` only.
fn quote_meta(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn or_matcher(mut matchers: Vec<Json>) -> Json {
    if matchers.len() == 1 {
        return matchers.pop().unwrap_or(Json::Null);
    }
    json!({"or_match": {"value_matchers": matchers}})
}

/// istiod's `StringMatcherWithPrefix`: `*` any (as `.+`), `*x` suffix, `x*` prefix, else exact.
fn string_matcher(v: &str, prefix: &str) -> Json {
    if v == "*" {
        json!({"safe_regex": {"regex": ".+"}})
    } else if let Some(rest) = v.strip_prefix('*') {
        if prefix.is_empty() {
            json!({"suffix": rest})
        } else {
            json!({"safe_regex": {"regex": format!("{prefix}.*{}", quote_meta(rest))}})
        }
    } else if let Some(rest) = v.strip_suffix('*') {
        json!({"prefix": format!("{prefix}{rest}")})
    } else {
        json!({"exact": format!("{prefix}{v}")})
    }
}

/// istiod's `HeaderMatcher` / `HostMatcher` (the latter ignoring case).
fn header_matcher(name: &str, v: &str, ignore_case: bool) -> Json {
    let sm = |k: &str, s: &str| {
        let mut m = Map::new();
        if ignore_case {
            m.insert("ignore_case".into(), true.into());
        }
        m.insert(k.into(), s.into());
        Json::Object(m)
    };
    if v == "*" {
        json!({"name": name, "present_match": true})
    } else if let Some(rest) = v.strip_prefix('*') {
        json!({"name": name, "string_match": sm("suffix", rest)})
    } else if let Some(rest) = v.strip_suffix('*') {
        json!({"name": name, "string_match": sm("prefix", rest)})
    } else {
        json!({"name": name, "string_match": sm("exact", v)})
    }
}

fn cidr(v: &str) -> Result<Json, String> {
    let (addr, len) = match v.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (v, None),
    };
    let ip: std::net::IpAddr = addr
        .parse()
        .map_err(|_| format!("invalid IP address {v:?}"))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let len = match len {
        None => max,
        Some(l) => l
            .parse::<u32>()
            .ok()
            .filter(|l| *l <= max)
            .ok_or_else(|| format!("invalid prefix length in {v:?}"))?,
    };
    Ok(json!({"address_prefix": ip.to_string(), "prefix_len": len}))
}

fn port(v: &str) -> Result<u32, String> {
    v.parse::<u32>()
        .ok()
        .filter(|p| *p <= 65535)
        .ok_or_else(|| format!("invalid port {v}"))
}

fn in_brackets(s: &str) -> Result<String, String> {
    s.strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .map(str::to_string)
        .ok_or_else(|| format!("expecting format [<NAME>], but found {s}"))
}

/// `[a][b][c]` to `a, b, c`; anything else must be one `[name]`.
fn nested_brackets(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let Some(inner) = rest.strip_prefix('[') else {
            return in_brackets(s).map(|n| vec![n]);
        };
        match inner.find(['[', ']']) {
            Some(i) if inner.as_bytes()[i] == b']' => {
                out.push(inner[..i].to_string());
                rest = &inner[i + 1..];
            }
            _ => return in_brackets(s).map(|n| vec![n]),
        }
    }
    if out.is_empty() {
        return in_brackets(s).map(|n| vec![n]);
    }
    Ok(out)
}

#[cfg(test)]
#[path = "authz_tests.rs"]
mod authz_tests;
