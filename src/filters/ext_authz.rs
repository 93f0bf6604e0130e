//! `envoy.filters.http.ext_authz`: each request is checked with an authorization server
//! before it goes on, over Envoy's gRPC `envoy.service.auth.v3.Authorization/Check` API or as
//! a raw HTTP request, as Envoy's filter does it (what istiod renders for a CUSTOM
//! AuthorizationPolicy, behind the shadow RBAC filter's `istio-ext-authz` mark).
//!
//! - The check: gRPC gets a `CheckRequest` with the request's attributes (method, path, host,
//!   scheme, headers as `allowed_headers`/`disallowed_headers` select them, the peer
//!   addresses, the client certificate's principal, the route's context extensions and the
//!   named dynamic metadata); HTTP gets the request's method and `path_prefix` + path, with
//!   `content-length: 0`, the `authorization`, `host`, `:method` and `:path` headers and the
//!   ones `allowed_headers` names, plus `authorization_request.headers_to_add`.
//! - Its answer: allowed (gRPC status OK; HTTP 200): the server's headers go upstream
//!   (gRPC `ok_response.headers`, append or overwrite; HTTP `allowed_upstream_headers`,
//!   `allowed_upstream_headers_to_append`), headers are removed (`headers_to_remove`,
//!   `x-envoy-auth-headers-to-remove`), headers go on the response
//!   (`response_headers_to_add`, `allowed_client_headers_on_success`) and metadata is written
//!   under `envoy.filters.http.ext_authz`; denied (any other gRPC status; HTTP other than 200
//!   and 5xx): the server's status (403 by default), headers (`allowed_client_headers`) and
//!   body go to the client, details `ext_authz_denied`, flag `UAEX`; no answer (connection
//!   failure, timeout, HTTP 5xx, a malformed reply): `status_on_error` (403) with details
//!   `ext_authz_error`, or with `failure_mode_allow` the request goes on (and with
//!   `failure_mode_allow_header_add` carries `x-envoy-auth-failure-mode-allowed: true`).
//! - `filter_enabled_metadata` (istiod's mark), `filter_enabled` (a runtime fraction's
//!   default), `deny_at_disable`; per route `ExtAuthzPerRoute` (`disabled`, and
//!   `check_settings.context_extensions` merged from the route configuration down).
//! - Stats under the connection manager's scope: `ext_authz.[<stat_prefix>.]{ok, denied,
//!   error, disabled, failure_mode_allowed}`.
//!
//! `with_request_body`: the connection manager reads the body (up to `max_request_bytes`,
//! at most 64 KiB: it is replayed upstream from pingora's retry buffer) before the filters
//! run; a longer body is cut with `allow_partial_message` (`x-envoy-auth-partial-body: true`)
//! and answered 413 without it, as Envoy's buffer limit does.
//!
//! Refused, each with its reason: a larger `max_request_bytes`, header mutation rules,
//! shadow mode, `path_override`, retries and service overrides, typed and route metadata
//! namespaces, `include_peer_certificate` (the PEM is not kept), `encode_raw_headers`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3 as pb;
use envoy_types::pb::envoy::service::auth::v3 as authpb;
use envoy_types::pb::google::protobuf::Any;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use prost::Message;

use super::callout::{CalloutError, CalloutRequest, CalloutResponse};
use super::{Decision, FilterDecl, FilterState, HeaderOp, LocalReply, Request, Translated};
use crate::matcher::StringMatch;

pub const TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz";
pub const PER_ROUTE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute";
/// Where an allowed check's dynamic metadata goes.
pub const NAMESPACE: &str = "envoy.filters.http.ext_authz";
const CHECK_PATH: &str = "/envoy.service.auth.v3.Authorization/Check";
const DENIED: &str = "ext_authz_denied";
const ERROR: &str = "ext_authz_error";

/// The filter in a chain.
#[derive(Debug)]
pub struct ExtAuthzFilter {
    pub name: String,
    cfg: Config,
    counters: OnceLock<Counters>,
}

#[derive(Debug)]
struct Config {
    service: Service,
    failure_mode_allow: bool,
    failure_mode_allow_header_add: bool,
    status_on_error: u16,
    /// None: every header; else only those matching (and never `disallowed`).
    allowed_headers: Option<Vec<StringMatch>>,
    disallowed_headers: Vec<StringMatch>,
    enabled_metadata: Option<super::rbac::MetadataMatcher>,
    /// `filter_enabled`'s default, in millionths.
    enabled_per_million: u32,
    deny_at_disable: bool,
    metadata_context_namespaces: Vec<String>,
    clear_route_cache: bool,
    stat_prefix: String,
    max_denied_body: usize,
    /// `with_request_body`.
    body: Option<BodySettings>,
}

/// `with_request_body`: how much of the body the check carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodySettings {
    pub max_bytes: usize,
    pub allow_partial: bool,
    pub pack_as_bytes: bool,
}

/// The most body a check can carry: pingora replays a body read before proxying from its
/// 64 KiB retry buffer.
pub const MAX_BODY: usize = 64 * 1024;

#[derive(Debug)]
enum Service {
    Grpc {
        cluster: String,
        authority: String,
        timeout: Duration,
        initial_metadata: Vec<(HeaderName, HeaderValue)>,
    },
    Http(Box<HttpService>),
}

#[derive(Debug)]
struct HttpService {
    cluster: String,
    timeout: Duration,
    path_prefix: String,
    request_allowed: Vec<StringMatch>,
    headers_to_add: Vec<(HeaderName, HeaderValue)>,
    upstream: Vec<StringMatch>,
    upstream_append: Vec<StringMatch>,
    /// None: every header but `host` (Envoy's default for an empty list).
    client: Option<Vec<StringMatch>>,
    client_on_success: Vec<StringMatch>,
    metadata_from_headers: Vec<StringMatch>,
}

/// The counters, resolved once against the connection manager's scope.
#[derive(Debug)]
struct Counters {
    ok: Arc<AtomicU64>,
    denied: Arc<AtomicU64>,
    error: Arc<AtomicU64>,
    disabled: Arc<AtomicU64>,
    failure_mode_allowed: Arc<AtomicU64>,
}

/// `ExtAuthzPerRoute` at one level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerRoute {
    pub disabled: bool,
    pub context_extensions: Vec<(String, String)>,
    /// `check_settings.disable_request_body_buffering`.
    pub no_body: bool,
}

pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let cfg = pb::ExtAuthz::decode(d.config.value.as_slice())
        .map_err(|e| format!("cannot decode ExtAuthz: {e}"))?;
    Ok(Translated::Run(super::HttpFilter::ExtAuthz(Box::new(
        ExtAuthzFilter::translate(d.name, &cfg)?,
    ))))
}

fn list(
    m: &Option<envoy_types::pb::envoy::r#type::matcher::v3::ListStringMatcher>,
    at: &str,
) -> Result<Vec<StringMatch>, String> {
    m.iter()
        .flat_map(|l| l.patterns.iter())
        .enumerate()
        .map(|(i, p)| {
            crate::matcher::string_matcher(p).map_err(|e| format!("{at}.patterns[{i}]: {e}"))
        })
        .collect()
}

fn timeout_of(
    d: Option<&envoy_types::pb::google::protobuf::Duration>,
    at: &str,
) -> Result<Duration, String> {
    match d {
        // Envoy's gRPC and HTTP clients: no timeout means none; Portico bounds the wait so a
        // silent server cannot hold a request forever (Envoy's stream idle timeout would).
        None => Ok(Duration::from_secs(300)),
        Some(d) => crate::units::duration(d).map_err(|e| format!("{at}: {e}")),
    }
}

impl ExtAuthzFilter {
    pub fn translate(name: &str, c: &pb::ExtAuthz) -> Result<ExtAuthzFilter, String> {
        let refuse = |field: &str, why: &str| Err(format!("{field} is not supported: {why}"));
        if c.transport_api_version != corepb::ApiVersion::V3 as i32 {
            return Err("transport_api_version: only V3 is supported".into());
        }
        let body = match &c.with_request_body {
            None => None,
            Some(b) => {
                let max_bytes = b.max_request_bytes as usize;
                if max_bytes == 0 {
                    return Err(
                        "with_request_body.max_request_bytes: must be greater than 0".into(),
                    );
                }
                if max_bytes > MAX_BODY {
                    return refuse(
                        "with_request_body.max_request_bytes above 65536",
                        "the body is held for the check in a 64 KiB replay buffer",
                    );
                }
                Some(BodySettings {
                    max_bytes,
                    allow_partial: b.allow_partial_message,
                    pack_as_bytes: b.pack_as_bytes,
                })
            }
        };
        if c.decoder_header_mutation_rules.is_some() {
            return refuse(
                "decoder_header_mutation_rules",
                "the server's header mutations are applied unchecked",
            );
        }
        if c.shadow_mode {
            return refuse("shadow_mode", "a shadow check is not implemented");
        }
        if !c.typed_metadata_context_namespaces.is_empty()
            || !c.route_metadata_context_namespaces.is_empty()
            || !c.route_typed_metadata_context_namespaces.is_empty()
        {
            return refuse(
                "typed/route metadata_context_namespaces",
                "only metadata_context_namespaces are sent",
            );
        }
        if c.include_peer_certificate {
            return refuse(
                "include_peer_certificate",
                "the client certificate's PEM is not kept",
            );
        }
        if c.encode_raw_headers {
            return refuse("encode_raw_headers", "headers are sent as the headers map");
        }
        if !c.bootstrap_metadata_labels_key.is_empty() {
            return refuse(
                "bootstrap_metadata_labels_key",
                "destination labels are not sent",
            );
        }
        let service = match &c.services {
            Some(pb::ext_authz::Services::GrpcService(g)) => {
                use corepb::grpc_service::TargetSpecifier as T;
                let Some(T::EnvoyGrpc(e)) = &g.target_specifier else {
                    return refuse("grpc_service.google_grpc", "only envoy_grpc (a cluster) is");
                };
                if e.cluster_name.is_empty() {
                    return Err("grpc_service.envoy_grpc.cluster_name is required".into());
                }
                if e.retry_policy.is_some() {
                    return refuse(
                        "grpc_service.envoy_grpc.retry_policy",
                        "checks are not retried",
                    );
                }
                let initial_metadata = g
                    .initial_metadata
                    .iter()
                    .enumerate()
                    .map(|(i, h)| {
                        let n = HeaderName::from_bytes(h.key.as_bytes()).map_err(|_| {
                            format!(
                                "grpc_service.initial_metadata[{i}]: invalid name '{}'",
                                h.key
                            )
                        })?;
                        let v = HeaderValue::from_str(&h.value).map_err(|_| {
                            format!("grpc_service.initial_metadata[{i}]: invalid value")
                        })?;
                        Ok((n, v))
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                Service::Grpc {
                    cluster: e.cluster_name.clone(),
                    authority: if e.authority.is_empty() {
                        e.cluster_name.clone()
                    } else {
                        e.authority.clone()
                    },
                    timeout: timeout_of(g.timeout.as_ref(), "grpc_service.timeout")?,
                    initial_metadata,
                }
            }
            Some(pb::ext_authz::Services::HttpService(h)) => {
                let uri = h
                    .server_uri
                    .as_ref()
                    .ok_or("http_service.server_uri is required")?;
                use corepb::http_uri::HttpUpstreamType as U;
                let cluster = match &uri.http_upstream_type {
                    Some(U::Cluster(c)) if !c.is_empty() => c.clone(),
                    _ => return Err("http_service.server_uri.cluster is required".into()),
                };
                if !h.path_override.is_empty() {
                    return refuse(
                        "http_service.path_override",
                        "the check path is path_prefix + the request's path",
                    );
                }
                if h.retry_policy.is_some() {
                    return refuse("http_service.retry_policy", "checks are not retried");
                }
                let req = h.authorization_request.clone().unwrap_or_default();
                // Deprecated for the top-level `allowed_headers`, but Envoy still honours it.
                #[allow(deprecated)]
                let legacy_allowed = &req.allowed_headers;
                let resp = h.authorization_response.clone().unwrap_or_default();
                let client = list(
                    &resp.allowed_client_headers,
                    "http_service.authorization_response.allowed_client_headers",
                )?;
                Service::Http(Box::new(HttpService {
                    cluster,
                    timeout: timeout_of(uri.timeout.as_ref(), "http_service.server_uri.timeout")?,
                    path_prefix: h.path_prefix.clone(),
                    request_allowed: list(legacy_allowed, "http_service.authorization_request.allowed_headers")?,
                    headers_to_add: req
                        .headers_to_add
                        .iter()
                        .enumerate()
                        .map(|(i, h)| {
                            let n = HeaderName::from_bytes(h.key.as_bytes()).map_err(|_| {
                                format!("http_service.authorization_request.headers_to_add[{i}]: invalid name '{}'", h.key)
                            })?;
                            let v = HeaderValue::from_str(&h.value).map_err(|_| {
                                format!("http_service.authorization_request.headers_to_add[{i}]: invalid value")
                            })?;
                            Ok((n, v))
                        })
                        .collect::<Result<Vec<_>, String>>()?,
                    upstream: list(&resp.allowed_upstream_headers, "http_service.authorization_response.allowed_upstream_headers")?,
                    upstream_append: list(&resp.allowed_upstream_headers_to_append, "http_service.authorization_response.allowed_upstream_headers_to_append")?,
                    client: (!client.is_empty()).then_some(client),
                    client_on_success: list(&resp.allowed_client_headers_on_success, "http_service.authorization_response.allowed_client_headers_on_success")?,
                    metadata_from_headers: list(&resp.dynamic_metadata_from_headers, "http_service.authorization_response.dynamic_metadata_from_headers")?,
                }))
            }
            None => return Err("one of grpc_service or http_service is required".into()),
        };
        let status_on_error = match c.status_on_error.as_ref().map(|s| s.code) {
            None | Some(0) => 403,
            Some(code) => u16::try_from(code)
                .ok()
                .filter(|c| (200..600).contains(c))
                .ok_or(format!(
                    "status_on_error.code: {code} is not an HTTP status"
                ))?,
        };
        let enabled_metadata = c
            .filter_enabled_metadata
            .as_ref()
            .map(|m| {
                super::rbac::MetadataMatcher::translate(m)
                    .map_err(|e| format!("filter_enabled_metadata: {e}"))
            })
            .transpose()?;
        let enabled_per_million = crate::units::per_million(c.filter_enabled.as_ref(), 1_000_000)
            .map_err(|e| format!("filter_enabled: {e}"))?;
        let deny_at_disable = c
            .deny_at_disable
            .as_ref()
            .and_then(|d| d.default_value.as_ref())
            .is_some_and(|b| b.value);
        let allowed = list(&c.allowed_headers, "allowed_headers")?;
        Ok(ExtAuthzFilter {
            name: name.to_string(),
            cfg: Config {
                service,
                failure_mode_allow: c.failure_mode_allow,
                failure_mode_allow_header_add: c.failure_mode_allow_header_add,
                status_on_error,
                allowed_headers: c.allowed_headers.is_some().then_some(allowed),
                disallowed_headers: list(&c.disallowed_headers, "disallowed_headers")?,
                enabled_metadata,
                enabled_per_million,
                deny_at_disable,
                metadata_context_namespaces: c.metadata_context_namespaces.clone(),
                clear_route_cache: c.clear_route_cache,
                stat_prefix: c.stat_prefix.clone(),
                max_denied_body: if c.max_denied_response_body_bytes == 0 {
                    usize::MAX
                } else {
                    c.max_denied_response_body_bytes as usize
                },
                body,
            },
            counters: OnceLock::new(),
        })
    }

    /// The body this filter's checks carry, if any: what the connection manager buffers
    /// before the filters run.
    pub fn body_settings(&self) -> Option<BodySettings> {
        self.cfg.body
    }

    /// The buffered body, unless this route turned buffering off.
    fn body<'r>(&self, req: &'r Request<'_>) -> Option<&'r super::BufferedBody> {
        self.cfg.body?;
        if self.per_route(req).is_some_and(|p| p.no_body) {
            return None;
        }
        req.body
    }

    fn counters(&self, named: &super::counters::NamedCounters) -> &Counters {
        self.counters.get_or_init(|| {
            let p = if self.cfg.stat_prefix.is_empty() {
                "ext_authz.".to_string()
            } else {
                format!("ext_authz.{}.", self.cfg.stat_prefix)
            };
            Counters {
                ok: named.get(&format!("{p}ok")),
                denied: named.get(&format!("{p}denied")),
                error: named.get(&format!("{p}error")),
                disabled: named.get(&format!("{p}disabled")),
                failure_mode_allowed: named.get(&format!("{p}failure_mode_allowed")),
            }
        })
    }

    fn per_route<'r>(&self, req: &'r Request<'_>) -> Option<&'r PerRoute> {
        req.route.and_then(|r| r.ext_authz_override(&self.name))
    }

    pub fn decode(
        &self,
        req: &Request<'_>,
        st: &mut FilterState,
        named: &super::counters::NamedCounters,
    ) -> Decision {
        let c = self.counters(named);
        if self.per_route(req).is_some_and(|p| p.disabled) {
            return Decision::Continue;
        }
        let enabled = self
            .cfg
            .enabled_metadata
            .as_ref()
            .is_none_or(|m| m.matches(st))
            && (self.cfg.enabled_per_million >= 1_000_000
                || fastrand::u32(0..1_000_000) < self.cfg.enabled_per_million);
        if !enabled {
            c.disabled.fetch_add(1, Relaxed);
            if self.cfg.deny_at_disable {
                return Decision::Reply(self.error_reply());
            }
            return Decision::Continue;
        }
        Decision::Async
    }

    fn error_reply(&self) -> LocalReply {
        LocalReply {
            status: self.cfg.status_on_error,
            body: None,
            headers: Vec::new(),
            grpc_status: None,
            details: ERROR.into(),
        }
    }

    pub async fn decode_async(&self, req: &Request<'_>, st: &mut FilterState) -> Decision {
        // `decode` binds the counters before it says Async; should it not have, fail closed.
        let Some(c) = self.counters.get() else {
            return Decision::Reply(self.error_reply());
        };
        let verdict = match req.upstreams {
            None => Verdict::Error("no way to the configuration's clusters".into()),
            Some(up) => match &self.cfg.service {
                Service::Grpc { cluster, .. } => {
                    let r = self.grpc_request(req, st.metadata.as_deref());
                    parse_grpc(up.call(cluster, r).await, self.cfg.max_denied_body)
                }
                Service::Http(h) => {
                    let r = self.http_request(h, req);
                    self.parse_http(h, up.call(&h.cluster, r).await)
                }
            },
        };
        match verdict {
            Verdict::Ok(ok) => {
                c.ok.fetch_add(1, Relaxed);
                if self.cfg.clear_route_cache && !ok.request.is_empty() {
                    st.clear_route_cache = true;
                }
                st.request_header_ops.extend(ok.request);
                st.response_header_ops.extend(ok.response);
                if let Some(m) = ok.metadata {
                    for (k, v) in m {
                        st.set_metadata(NAMESPACE, k, v);
                    }
                }
                Decision::Continue
            }
            Verdict::Denied {
                status,
                headers,
                body,
            } => {
                c.denied.fetch_add(1, Relaxed);
                Decision::Reply(LocalReply {
                    status,
                    body: (!body.is_empty()).then_some(body),
                    headers,
                    grpc_status: None,
                    details: DENIED.into(),
                })
            }
            Verdict::Error(why) => {
                c.error.fetch_add(1, Relaxed);
                tracing::debug!(filter = %self.name, "ext_authz check failed: {why}");
                if self.cfg.failure_mode_allow {
                    c.failure_mode_allowed.fetch_add(1, Relaxed);
                    if self.cfg.failure_mode_allow_header_add {
                        st.request_header_ops.push(HeaderOp::Set(
                            HeaderName::from_static("x-envoy-auth-failure-mode-allowed"),
                            HeaderValue::from_static("true"),
                        ));
                    }
                    Decision::Continue
                } else {
                    Decision::Reply(self.error_reply())
                }
            }
        }
    }

    /// The request headers the check carries, as `allowed_headers`/`disallowed_headers`
    /// select them.
    fn selected<'h, 's: 'h>(
        &'s self,
        headers: &'h HeaderMap,
    ) -> impl Iterator<Item = (&'h HeaderName, &'h HeaderValue)> + 'h {
        headers.iter().filter(move |(k, _)| {
            let k = k.as_str();
            self.cfg
                .allowed_headers
                .as_ref()
                .is_none_or(|a| a.iter().any(|m| m.matches(k)))
                && !self.cfg.disallowed_headers.iter().any(|m| m.matches(k))
        })
    }

    /// The dynamic metadata of the namespaces `metadata_context_namespaces` names.
    fn metadata_context(
        &self,
        st: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Option<corepb::Metadata> {
        let st = st?;
        let filter_metadata: HashMap<_, _> = self
            .cfg
            .metadata_context_namespaces
            .iter()
            .filter_map(|ns| match st.get(ns) {
                Some(serde_json::Value::Object(m)) => Some((ns.clone(), json_struct(m))),
                _ => None,
            })
            .collect();
        (!filter_metadata.is_empty()).then(|| corepb::Metadata {
            filter_metadata,
            ..Default::default()
        })
    }

    fn grpc_request(
        &self,
        req: &Request<'_>,
        st_metadata: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> CalloutRequest {
        let Service::Grpc {
            authority,
            timeout,
            initial_metadata,
            ..
        } = &self.cfg.service
        else {
            unreachable!("grpc_request on an HTTP service")
        };
        let v = req.view;
        let mut headers: HashMap<String, String> = HashMap::new();
        let pseudo = [
            (":authority", v.authority),
            (":method", v.method),
            (":path", v.path),
            (":scheme", v.scheme),
        ];
        for (k, val) in pseudo {
            let allowed = self
                .cfg
                .allowed_headers
                .as_ref()
                .is_none_or(|a| a.iter().any(|m| m.matches(k)));
            if allowed && !self.cfg.disallowed_headers.iter().any(|m| m.matches(k)) {
                headers.insert(k.to_string(), val.to_string());
            }
        }
        for (k, val) in self.selected(v.headers) {
            let val = String::from_utf8_lossy(val.as_bytes());
            headers
                .entry(k.as_str().to_string())
                .and_modify(|e| {
                    e.push(',');
                    e.push_str(&val);
                })
                .or_insert_with(|| val.into_owned());
        }
        let body = self.body(req);
        if let Some(b) = body {
            headers.insert(
                "x-envoy-auth-partial-body".into(),
                if b.partial { "true" } else { "false" }.into(),
            );
        }
        let (_, query, fragment) = split_path(v.path);
        let peer = |addr: Option<std::net::SocketAddr>| authpb::attribute_context::Peer {
            address: addr.map(socket_address),
            ..Default::default()
        };
        let mut source = peer(
            req.conn
                .remote
                .zip(req.conn.direct_remote)
                .map(|(ip, d)| std::net::SocketAddr::new(ip, d.port()))
                .or(req.conn.direct_remote),
        );
        if let Some(p) = req.conn.peer {
            source.principal = p
                .uri_sans()
                .first()
                .cloned()
                .or_else(|| p.dns_sans().first().cloned())
                .unwrap_or_else(|| p.subject().to_string());
        }
        let context_extensions = self
            .per_route(req)
            .map(|p| p.context_extensions.iter().cloned().collect())
            .unwrap_or_default();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let size = v
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|l| l.to_str().ok()?.parse::<i64>().ok())
            .unwrap_or(-1);
        let check = authpb::CheckRequest {
            attributes: Some(authpb::AttributeContext {
                source: Some(source),
                destination: Some(peer(req.conn.local)),
                request: Some(authpb::attribute_context::Request {
                    time: Some(envoy_types::pb::google::protobuf::Timestamp {
                        seconds: now.as_secs() as i64,
                        nanos: now.subsec_nanos() as i32,
                    }),
                    http: Some(authpb::attribute_context::HttpRequest {
                        id: v
                            .headers
                            .get("x-request-id")
                            .and_then(|h| h.to_str().ok())
                            .unwrap_or_default()
                            .to_string(),
                        method: v.method.to_string(),
                        headers,
                        path: v.path.to_string(),
                        host: v.authority.to_string(),
                        scheme: v.scheme.to_string(),
                        query: query.to_string(),
                        fragment: fragment.to_string(),
                        size,
                        protocol: protocol_of(req),
                        body: match (body, self.cfg.body) {
                            (Some(b), Some(s)) if !s.pack_as_bytes => {
                                String::from_utf8_lossy(&b.bytes).into_owned()
                            }
                            _ => String::new(),
                        },
                        raw_body: match (body, self.cfg.body) {
                            (Some(b), Some(s)) if s.pack_as_bytes => b.bytes.to_vec(),
                            _ => Vec::new(),
                        },
                        ..Default::default()
                    }),
                }),
                context_extensions,
                metadata_context: self.metadata_context(st_metadata),
                ..Default::default()
            }),
        };
        grpc_call(&check, authority, *timeout, initial_metadata)
    }

    fn http_request(&self, h: &HttpService, req: &Request<'_>) -> CalloutRequest {
        let v = req.view;
        let mut headers = HeaderMap::new();
        let body = self.body(req);
        let len = body.map_or(0, |b| b.bytes.len());
        if let Ok(l) = HeaderValue::from_str(&len.to_string()) {
            headers.insert(http::header::CONTENT_LENGTH, l);
        }
        if let Some(b) = body {
            headers.insert(
                "x-envoy-auth-partial-body",
                HeaderValue::from_static(if b.partial { "true" } else { "false" }),
            );
        }
        // Envoy's raw HTTP check always carries these; `allowed_headers` (top level, or the
        // legacy `authorization_request.allowed_headers`) adds to them.
        for (k, val) in v.headers.iter() {
            let name = k.as_str();
            if name == "content-length" {
                continue;
            }
            let always = name == "authorization" || name == "host";
            let listed = h.request_allowed.iter().any(|m| m.matches(name))
                || self
                    .cfg
                    .allowed_headers
                    .as_ref()
                    .is_some_and(|a| a.iter().any(|m| m.matches(name)));
            if (always || listed) && !self.cfg.disallowed_headers.iter().any(|m| m.matches(name)) {
                headers.append(k.clone(), val.clone());
            }
        }
        // What Envoy's async client adds to every request it sends.
        headers.insert("x-envoy-internal", HeaderValue::from_static("true"));
        if let Ok(ms) = HeaderValue::from_str(&h.timeout.as_millis().to_string()) {
            headers.insert("x-envoy-expected-rq-timeout-ms", ms);
        }
        for (k, val) in &h.headers_to_add {
            headers.insert(k.clone(), val.clone());
        }
        let method = Method::from_bytes(v.method.as_bytes()).unwrap_or(Method::GET);
        CalloutRequest {
            method,
            path: format!("{}{}", h.path_prefix, v.path),
            authority: v.authority.to_string(),
            headers,
            body: body.map(|b| b.bytes.clone()).unwrap_or_default(),
            timeout: h.timeout,
            grpc: false,
        }
    }

    fn parse_http(&self, h: &HttpService, r: Result<CalloutResponse, CalloutError>) -> Verdict {
        let r = match r {
            Ok(r) => r,
            Err(e) => return Verdict::Error(e.to_string()),
        };
        if (500..600).contains(&r.status) {
            return Verdict::Error(format!("the authorization server answered {}", r.status));
        }
        let matches = |list: &[StringMatch], k: &str| list.iter().any(|m| m.matches(k));
        if r.status == 200 {
            let mut ok = Allowed::default();
            let mut remove: Vec<HeaderName> = Vec::new();
            for v in r.headers.get_all("x-envoy-auth-headers-to-remove") {
                for n in v.to_str().unwrap_or_default().split(',') {
                    if let Ok(n) = HeaderName::from_bytes(n.trim().as_bytes()) {
                        remove.push(n);
                    }
                }
            }
            let mut metadata = serde_json::Map::new();
            for (k, v) in r.headers.iter() {
                let name = k.as_str();
                if name == "x-envoy-auth-headers-to-remove" {
                    continue;
                }
                if matches(&h.upstream, name) {
                    ok.request.push(HeaderOp::Set(k.clone(), v.clone()));
                }
                if matches(&h.upstream_append, name) {
                    ok.request.push(HeaderOp::Append(k.clone(), v.clone()));
                }
                if matches(&h.client_on_success, name) {
                    ok.response.push(HeaderOp::Append(k.clone(), v.clone()));
                }
                if matches(&h.metadata_from_headers, name) {
                    metadata.insert(
                        name.to_string(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned().into(),
                    );
                }
            }
            ok.request.extend(remove.into_iter().map(HeaderOp::Remove));
            ok.metadata = (!metadata.is_empty()).then_some(metadata);
            return Verdict::Ok(ok);
        }
        let default_client = ["content-length", "www-authenticate", "location"];
        let headers = r
            .headers
            .iter()
            .filter(|(k, _)| match &h.client {
                None => *k != http::header::HOST,
                Some(l) => matches(l, k.as_str()) || default_client.contains(&k.as_str()),
            })
            // The reply's own framing is Portico's.
            .filter(|(k, _)| {
                *k != http::header::CONTENT_LENGTH && *k != http::header::TRANSFER_ENCODING
            })
            .map(|(k, v)| {
                (
                    k.clone(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let mut body = r.body;
        body.truncate(self.cfg.max_denied_body.min(body.len()));
        Verdict::Denied {
            status: r.status,
            headers,
            body,
        }
    }
}

fn json_struct(
    m: &serde_json::Map<String, serde_json::Value>,
) -> envoy_types::pb::google::protobuf::Struct {
    envoy_types::pb::google::protobuf::Struct {
        fields: m.iter().map(|(k, v)| (k.clone(), json_value(v))).collect(),
    }
}

fn json_value(v: &serde_json::Value) -> envoy_types::pb::google::protobuf::Value {
    use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Value};
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(json_value).collect(),
        }),
        serde_json::Value::Object(m) => Kind::StructValue(json_struct(m)),
    };
    Value { kind: Some(kind) }
}

fn protocol_of(req: &Request<'_>) -> String {
    // The view does not carry the version; HTTP/2 requests have no `connection` semantics
    // and are reported as Envoy reports them by the connection manager's codec.
    let _ = req;
    "HTTP/1.1".to_string()
}

fn split_path(p: &str) -> (&str, &str, &str) {
    let (rest, fragment) = p.split_once('#').unwrap_or((p, ""));
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    (path, query, fragment)
}

fn socket_address(a: std::net::SocketAddr) -> corepb::Address {
    corepb::Address {
        address: Some(corepb::address::Address::SocketAddress(
            corepb::SocketAddress {
                address: a.ip().to_string(),
                port_specifier: Some(corepb::socket_address::PortSpecifier::PortValue(u32::from(
                    a.port(),
                ))),
                ..Default::default()
            },
        )),
    }
}

#[derive(Debug, Default)]
struct Allowed {
    request: Vec<HeaderOp>,
    response: Vec<HeaderOp>,
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Debug)]
enum Verdict {
    Ok(Allowed),
    Denied {
        status: u16,
        headers: Vec<(HeaderName, String)>,
        body: Bytes,
    },
    Error(String),
}

/// The gRPC server's answer: the unary response's one message, and the call's status.
fn parse_grpc(r: Result<CalloutResponse, CalloutError>, max_body: usize) -> Verdict {
    let r = match r {
        Ok(r) => r,
        Err(e) => return Verdict::Error(e.to_string()),
    };
    if r.status != 200 {
        return Verdict::Error(format!("HTTP status {} from the gRPC server", r.status));
    }
    let status = r
        .trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| r.headers.get("grpc-status"))
        .and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
    if status != Some(0) {
        return Verdict::Error(format!("gRPC status {status:?}"));
    }
    let b = &r.body;
    if b.len() < 5 || b[0] != 0 {
        return Verdict::Error("no (uncompressed) gRPC message in the response".into());
    }
    let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
    let Some(msg) = b.get(5..5 + len) else {
        return Verdict::Error("a truncated gRPC message".into());
    };
    let resp = match authpb::CheckResponse::decode(msg) {
        Ok(r) => r,
        Err(e) => return Verdict::Error(format!("cannot decode CheckResponse: {e}")),
    };
    check_response(resp, max_body)
}

fn check_response(resp: authpb::CheckResponse, max_body: usize) -> Verdict {
    use authpb::check_response::HttpResponse as R;
    let code = resp.status.as_ref().map_or(0, |s| s.code);
    if code == 0 {
        let mut ok = Allowed::default();
        if let Some(R::OkResponse(o)) = &resp.http_response {
            // Upstream headers overwrite unless `append` says otherwise.
            ok.request
                .extend(o.headers.iter().filter_map(|h| header_op(h, false)));
            for n in &o.headers_to_remove {
                if let Ok(n) = HeaderName::from_bytes(n.as_bytes()) {
                    // Envoy never lets the server remove pseudo headers or `host`.
                    if n != http::header::HOST {
                        ok.request.push(HeaderOp::Remove(n));
                    }
                }
            }
            // Response headers are added unless `append` is false.
            ok.response.extend(
                o.response_headers_to_add
                    .iter()
                    .filter_map(|h| header_op(h, true)),
            );
        }
        let md = resp
            .dynamic_metadata
            .as_ref()
            .map(crate::telemetry::istio_stats::struct_to_json)
            .and_then(|v| match v {
                serde_json::Value::Object(m) if !m.is_empty() => Some(m),
                _ => None,
            });
        ok.metadata = md;
        return Verdict::Ok(ok);
    }
    let (status, headers, mut body) = match resp.http_response {
        Some(R::DeniedResponse(d)) => {
            let status = d
                .status
                .map(|s| s.code)
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| (200..600).contains(c))
                .unwrap_or(403);
            let headers = d
                .headers
                .iter()
                .filter_map(|h| header_of(h.header.as_ref()))
                .map(|(n, v)| (n, String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect();
            (status, headers, Bytes::from(d.body))
        }
        _ => (403, Vec::new(), Bytes::new()),
    };
    body.truncate(max_body.min(body.len()));
    Verdict::Denied {
        status,
        headers,
        body,
    }
}

/// One `HeaderValueOption` of the server's answer: append or overwrite, by its (deprecated,
/// but what servers send) `append`, else `default_append`.
fn header_op(h: &corepb::HeaderValueOption, default_append: bool) -> Option<HeaderOp> {
    let (n, v) = header_of(h.header.as_ref())?;
    #[allow(deprecated)]
    let append = h.append.as_ref().map_or(default_append, |a| a.value);
    Some(if append {
        HeaderOp::Append(n, v)
    } else {
        HeaderOp::Set(n, v)
    })
}

fn header_of(h: Option<&corepb::HeaderValue>) -> Option<(HeaderName, HeaderValue)> {
    let h = h?;
    let n = HeaderName::from_bytes(h.key.as_bytes()).ok()?;
    let v = if h.raw_value.is_empty() {
        HeaderValue::from_str(&h.value).ok()?
    } else {
        HeaderValue::from_bytes(&h.raw_value).ok()?
    };
    Some((n, v))
}

/// `ExtAuthzPerRoute` entries of one level's `typed_per_filter_config`, by filter name.
pub fn per_route(map: &HashMap<String, Any>) -> Result<Vec<(String, Arc<PerRoute>)>, String> {
    let mut out = Vec::new();
    for (name, a) in map {
        if a.type_url != PER_ROUTE_TYPE {
            continue;
        }
        let at = format!("typed_per_filter_config['{name}']");
        let p = pb::ExtAuthzPerRoute::decode(a.value.as_slice())
            .map_err(|e| format!("{at}: cannot decode ExtAuthzPerRoute: {e}"))?;
        let per = match p.r#override {
            Some(pb::ext_authz_per_route::Override::Disabled(true)) => PerRoute {
                disabled: true,
                context_extensions: Vec::new(),
                no_body: false,
            },
            Some(pb::ext_authz_per_route::Override::Disabled(false)) => {
                return Err(format!("{at}.disabled: must be true when set"))
            }
            Some(pb::ext_authz_per_route::Override::CheckSettings(s)) => {
                if s.with_request_body.is_some() {
                    return Err(format!("{at}.check_settings.with_request_body is not supported: the filter's own body settings apply"));
                }
                if s.service_override.is_some() {
                    return Err(format!(
                        "{at}.check_settings.service_override is not supported"
                    ));
                }
                let mut ext: Vec<_> = s.context_extensions.into_iter().collect();
                ext.sort();
                PerRoute {
                    disabled: false,
                    context_extensions: ext,
                    no_body: s.disable_request_body_buffering,
                }
            }
            None => {
                return Err(format!(
                    "{at}: one of disabled or check_settings is required"
                ))
            }
        };
        out.push((name.clone(), Arc::new(per)));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The levels of one route, most specific first, as the filter sees them: `disabled` from
/// the most specific level that sets it, context extensions merged (the more specific
/// level's value wins).
pub fn merge(levels: &[&[(String, Arc<PerRoute>)]]) -> Vec<(String, Arc<PerRoute>)> {
    let mut names: Vec<&String> = levels
        .iter()
        .flat_map(|l| l.iter().map(|(n, _)| n))
        .collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .map(|name| {
            let mut found = levels
                .iter()
                .filter_map(|l| l.iter().find(|(n, _)| n == name).map(|(_, p)| p));
            let first = found.next().cloned().unwrap_or_else(|| {
                Arc::new(PerRoute {
                    disabled: false,
                    context_extensions: Vec::new(),
                    no_body: false,
                })
            });
            let rest: Vec<_> = found.collect();
            if first.disabled || rest.is_empty() {
                return (name.clone(), first);
            }
            let mut ext = first.context_extensions.clone();
            for p in rest {
                for (k, v) in &p.context_extensions {
                    if !ext.iter().any(|(e, _)| e == k) {
                        ext.push((k.clone(), v.clone()));
                    }
                }
            }
            ext.sort();
            (
                name.clone(),
                Arc::new(PerRoute {
                    disabled: false,
                    context_extensions: ext,
                    no_body: first.no_body,
                }),
            )
        })
        .collect()
}

pub const NETWORK_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.ext_authz.v3.ExtAuthz";

/// `envoy.filters.network.ext_authz` on a TCP chain: each connection is checked once, when it
/// is accepted (Envoy checks on its first bytes; a gateway's TCP clients speak first or wait,
/// and either way nothing is proxied before the answer). OK: the connection goes on; denied,
/// or failed without `failure_mode_allow`: it is closed. gRPC only, as in Envoy.
#[derive(Debug)]
pub struct NetworkExtAuthz {
    cluster: String,
    authority: String,
    timeout: Duration,
    failure_mode_allow: bool,
    enabled_metadata: Option<super::rbac::MetadataMatcher>,
    total: Arc<AtomicU64>,
    ok: Arc<AtomicU64>,
    denied: Arc<AtomicU64>,
    error: Arc<AtomicU64>,
    disabled: Arc<AtomicU64>,
    failure_mode_allowed: Arc<AtomicU64>,
    cx_closed: Arc<AtomicU64>,
}

impl NetworkExtAuthz {
    pub fn translate(
        any: &Any,
        named: &super::counters::NamedCounters,
    ) -> Result<NetworkExtAuthz, String> {
        use envoy_types::pb::envoy::extensions::filters::network::ext_authz::v3 as npb;
        let c = npb::ExtAuthz::decode(any.value.as_slice())
            .map_err(|e| format!("cannot decode network ExtAuthz: {e}"))?;
        if c.stat_prefix.is_empty() {
            return Err("stat_prefix: value length must be at least 1 characters".into());
        }
        if c.transport_api_version != corepb::ApiVersion::V3 as i32 {
            return Err("transport_api_version: only V3 is supported".into());
        }
        if c.include_peer_certificate {
            return Err("include_peer_certificate is not supported: the client certificate's PEM is not kept".into());
        }
        if c.shadow_mode {
            return Err("shadow_mode is not supported".into());
        }
        if !c.bootstrap_metadata_labels_key.is_empty() {
            return Err(
                "bootstrap_metadata_labels_key is not supported: destination labels are not sent"
                    .into(),
            );
        }
        if !c.metadata_context_namespaces.is_empty()
            || !c.typed_metadata_context_namespaces.is_empty()
        {
            return Err(
                "metadata_context_namespaces are not supported on the network filter".into(),
            );
        }
        use corepb::grpc_service::TargetSpecifier as T;
        let g = c.grpc_service.as_ref().ok_or("grpc_service is required")?;
        let Some(T::EnvoyGrpc(e)) = &g.target_specifier else {
            return Err(
                "grpc_service.google_grpc is not supported: only envoy_grpc (a cluster) is".into(),
            );
        };
        if e.cluster_name.is_empty() {
            return Err("grpc_service.envoy_grpc.cluster_name is required".into());
        }
        let enabled_metadata = c
            .filter_enabled_metadata
            .as_ref()
            .map(|m| {
                super::rbac::MetadataMatcher::translate(m)
                    .map_err(|e| format!("filter_enabled_metadata: {e}"))
            })
            .transpose()?;
        let p = format!("ext_authz.{}", c.stat_prefix);
        let p = if p.ends_with('.') { p } else { format!("{p}.") };
        let n = |s: &str| named.get(&format!("{p}{s}"));
        Ok(NetworkExtAuthz {
            cluster: e.cluster_name.clone(),
            authority: if e.authority.is_empty() {
                e.cluster_name.clone()
            } else {
                e.authority.clone()
            },
            timeout: timeout_of(g.timeout.as_ref(), "grpc_service.timeout")?,
            failure_mode_allow: c.failure_mode_allow,
            enabled_metadata,
            total: n("total"),
            ok: n("ok"),
            denied: n("denied"),
            error: n("error"),
            disabled: n("disabled"),
            failure_mode_allowed: n("failure_mode_allowed"),
            cx_closed: n("cx_closed"),
        })
    }

    /// Whether the connection may go on.
    pub async fn allows(
        &self,
        conn: &super::Connection<'_>,
        st: &FilterState,
        up: Option<&dyn super::callout::Upstreams>,
    ) -> bool {
        if self
            .enabled_metadata
            .as_ref()
            .is_some_and(|m| !m.matches(st))
        {
            self.disabled.fetch_add(1, Relaxed);
            return true;
        }
        self.total.fetch_add(1, Relaxed);
        let verdict = match up {
            None => Verdict::Error("no way to the configuration's clusters".into()),
            Some(up) => {
                let peer = |addr: Option<std::net::SocketAddr>| authpb::attribute_context::Peer {
                    address: addr.map(socket_address),
                    principal: String::new(),
                    ..Default::default()
                };
                let check = authpb::CheckRequest {
                    attributes: Some(authpb::AttributeContext {
                        source: Some(peer(conn.direct_remote)),
                        destination: Some(peer(conn.local)),
                        tls_session: conn
                            .sni
                            .map(|s| authpb::attribute_context::TlsSession { sni: s.to_string() }),
                        ..Default::default()
                    }),
                };
                let req = grpc_call(&check, &self.authority, self.timeout, &[]);
                parse_grpc(up.call(&self.cluster, req).await, 0)
            }
        };
        match verdict {
            Verdict::Ok(_) => {
                self.ok.fetch_add(1, Relaxed);
                true
            }
            Verdict::Denied { .. } => {
                self.denied.fetch_add(1, Relaxed);
                self.cx_closed.fetch_add(1, Relaxed);
                false
            }
            Verdict::Error(why) => {
                self.error.fetch_add(1, Relaxed);
                tracing::debug!("network ext_authz check failed: {why}");
                if self.failure_mode_allow {
                    self.failure_mode_allowed.fetch_add(1, Relaxed);
                    true
                } else {
                    self.cx_closed.fetch_add(1, Relaxed);
                    false
                }
            }
        }
    }
}

/// A unary `Authorization/Check` call, framed.
fn grpc_call(
    check: &authpb::CheckRequest,
    authority: &str,
    timeout: Duration,
    initial_metadata: &[(HeaderName, HeaderValue)],
) -> CalloutRequest {
    let msg = check.encode_to_vec();
    let mut body = BytesMut::with_capacity(5 + msg.len());
    body.put_u8(0);
    body.put_u32(msg.len() as u32);
    body.put_slice(&msg);
    let mut h = HeaderMap::new();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert(http::header::TE, HeaderValue::from_static("trailers"));
    if let Ok(v) = HeaderValue::from_str(&format!("{}m", timeout.as_millis().max(1))) {
        h.insert("grpc-timeout", v);
    }
    for (k, v) in initial_metadata {
        h.append(k.clone(), v.clone());
    }
    CalloutRequest {
        method: Method::POST,
        path: CHECK_PATH.to_string(),
        authority: authority.to_string(),
        headers: h,
        body: body.freeze(),
        timeout,
        grpc: true,
    }
}

#[cfg(test)]
#[path = "ext_authz_tests.rs"]
mod tests;
