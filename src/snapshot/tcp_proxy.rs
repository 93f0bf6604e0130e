//! `envoy.filters.network.tcp_proxy`: a filter chain that forwards the raw byte stream to one
//! cluster (TLS passthrough, plain TCP) instead of parsing HTTP.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3 as tpb;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use crate::telemetry::access_log::AccessLogs;

pub const TCP_PROXY_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";

/// Where a connection goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `cluster` (may be empty: Envoy accepts it and closes every connection as no route).
    Cluster(String),
    /// `weighted_clusters`: one cluster per connection, drawn by weight.
    Weighted {
        clusters: Vec<(String, u32)>,
        total: u64,
    },
}

/// The parts of `TcpProxy` a connection reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpProxy {
    pub stat_prefix: String,
    pub target: Target,
    /// `idle_timeout`: 1 h when unset, as in Envoy; zero disables it.
    pub idle_timeout: Option<Duration>,
    /// `max_connect_attempts` (at least 1, default 1): hosts tried before giving up.
    pub max_connect_attempts: u32,
    /// `tunneling_config`: the bytes go in an HTTP/2 CONNECT stream to the cluster's host.
    pub tunneling: Option<std::sync::Arc<Tunneling>>,
    /// `access_log`: written when the connection closes. `access_log_options` (periodic
    /// lines, a line on connect) is accepted and not honoured: one line per connection.
    pub access_log: AccessLogs,
}

/// `tunneling_config` with CONNECT (istiod's HBONE origination): the request's `:authority`
/// and the headers added to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tunneling {
    pub hostname: Vec<HostPart>,
    /// `headers_to_add` applied, in order, to a CONNECT request that has no other headers:
    /// the result is fixed, so it is computed once here.
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// A hash of the above: pooled tunnels made with other settings are kept apart.
    pub key: u64,
}

/// A piece of the `hostname` format string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPart {
    Text(String),
    /// `%DOWNSTREAM_LOCAL_ADDRESS%`: the (restored) local address of the connection.
    LocalAddress,
    /// `%DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT%`.
    LocalIp,
    /// `%DOWNSTREAM_LOCAL_PORT%`.
    LocalPort,
}

impl Tunneling {
    fn translate(t: &tpb::tcp_proxy::TunnelingConfig) -> Result<Tunneling, String> {
        if t.hostname.is_empty() {
            return Err("hostname must not be empty".into());
        }
        // POST tunnels and a request id on the CONNECT change what the upstream receives.
        // `propagate_response_headers`/`_trailers` only put the answer in filter state for
        // other filters (istiod's baggage peer metadata), which Portico does not run.
        if t.use_post || !t.post_path.is_empty() {
            return Err("use_post / post_path: POST tunnels are not supported".into());
        }
        if t.request_id_extension.is_some() || !t.request_id_header.is_empty() {
            return Err(
                "request_id_extension / request_id_header: a request id on the CONNECT is not supported"
                    .into(),
            );
        }
        let hostname = host_format(&t.hostname).map_err(|e| format!("hostname: {e}"))?;
        let mut map = http::HeaderMap::new();
        for (i, h) in t.headers_to_add.iter().enumerate() {
            use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction as A;
            let at = format!("headers_to_add[{i}]");
            let Some(hv) = &h.header else {
                return Err(format!("{at}.header is required"));
            };
            let name = hv.key.to_ascii_lowercase();
            if name.starts_with(':') || name == "host" {
                return Err(format!("{at}: '{}' cannot be set", hv.key));
            }
            let value = if hv.raw_value.is_empty() {
                hv.value.as_bytes()
            } else {
                hv.raw_value.as_slice()
            };
            if value.contains(&b'%') {
                return Err(format!(
                    "{at}: '{}': substitution formatters in tunnel headers are not supported",
                    hv.key
                ));
            }
            if value.is_empty() && !h.keep_empty_value {
                continue;
            }
            let name = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("{at}: invalid header name '{}'", hv.key))?;
            let value = http::HeaderValue::from_bytes(value)
                .map_err(|_| format!("{at}: invalid value for '{}'", hv.key))?;
            #[allow(deprecated)]
            let action = match &h.append {
                Some(b) if !b.value => A::OverwriteIfExistsOrAdd,
                _ => A::try_from(h.append_action).unwrap_or(A::AppendIfExistsOrAdd),
            };
            match action {
                A::AppendIfExistsOrAdd => {
                    map.append(name, value);
                }
                A::AddIfAbsent => {
                    map.entry(name).or_insert(value);
                }
                A::OverwriteIfExistsOrAdd => {
                    map.insert(name, value);
                }
                A::OverwriteIfExists => {
                    if map.contains_key(&name) {
                        map.insert(name, value);
                    }
                }
            }
        }
        let headers: Vec<(http::HeaderName, http::HeaderValue)> =
            map.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut id = t.hostname.as_bytes().to_vec();
        for (k, v) in &headers {
            id.push(0);
            id.extend_from_slice(k.as_str().as_bytes());
            id.push(0);
            id.extend_from_slice(v.as_bytes());
        }
        Ok(Tunneling {
            hostname,
            headers,
            key: xxhash_rust::xxh64::xxh64(&id, 7),
        })
    }

    /// The `:authority` for a connection whose local address is `local` (`fallback` when no
    /// original destination was restored: Envoy's name for the internal address).
    pub fn authority(&self, local: Option<std::net::SocketAddr>, fallback: &str) -> String {
        let mut out = String::new();
        for p in &self.hostname {
            match (p, local) {
                (HostPart::Text(t), _) => out.push_str(t),
                (HostPart::LocalAddress, Some(a)) => out.push_str(&a.to_string()),
                (HostPart::LocalIp, Some(a)) => out.push_str(&a.ip().to_string()),
                (HostPart::LocalPort, Some(a)) => out.push_str(&a.port().to_string()),
                (HostPart::LocalAddress | HostPart::LocalIp, None) => out.push_str(fallback),
                // An internal address has no port: Envoy renders nothing.
                (HostPart::LocalPort, None) => {}
            }
        }
        out
    }
}

/// Envoy's substitution format, limited to the local-address commands (what istiod uses).
fn host_format(f: &str) -> Result<Vec<HostPart>, String> {
    let mut parts = Vec::new();
    let mut rest = f;
    while let Some(start) = rest.find('%') {
        if start > 0 {
            parts.push(HostPart::Text(rest[..start].to_string()));
        }
        let after = &rest[start + 1..];
        let Some(end) = after.find('%') else {
            return Err(format!("unterminated '%' in '{f}'"));
        };
        parts.push(match &after[..end] {
            "DOWNSTREAM_LOCAL_ADDRESS" => HostPart::LocalAddress,
            "DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => HostPart::LocalIp,
            "DOWNSTREAM_LOCAL_PORT" => HostPart::LocalPort,
            other => {
                return Err(format!(
                    "'%{other}%' is not supported (only %DOWNSTREAM_LOCAL_ADDRESS%, %DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT%, %DOWNSTREAM_LOCAL_PORT%)"
                ))
            }
        });
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        parts.push(HostPart::Text(rest.to_string()));
    }
    Ok(parts)
}

impl TcpProxy {
    pub fn from_any(a: &Any) -> Result<TcpProxy, String> {
        if a.type_url != TCP_PROXY_TYPE {
            return Err(format!("expected {TCP_PROXY_TYPE}, got {}", a.type_url));
        }
        let p = tpb::TcpProxy::decode(a.value.as_slice())
            .map_err(|e| format!("tcp_proxy: cannot decode: {e}"))?;
        TcpProxy::translate(&p).map_err(|e| format!("tcp_proxy: {e}"))
    }

    pub fn translate(p: &tpb::TcpProxy) -> Result<TcpProxy, String> {
        if p.stat_prefix.is_empty() {
            return Err("stat_prefix must not be empty".into());
        }
        // Fields that change where or how bytes flow: honouring none of them silently would
        // send traffic somewhere Envoy would not, so they are refused by name.
        let unsupported = [
            ("on_demand", p.on_demand.is_some()),
            ("metadata_match", p.metadata_match.is_some()),
            (
                "downstream_idle_timeout",
                p.downstream_idle_timeout.is_some(),
            ),
            ("upstream_idle_timeout", p.upstream_idle_timeout.is_some()),
            ("backoff_options", p.backoff_options.is_some()),
            ("hash_policy", !p.hash_policy.is_empty()),
            (
                "max_downstream_connection_duration",
                p.max_downstream_connection_duration.is_some(),
            ),
            ("proxy_protocol_tlvs", !p.proxy_protocol_tlvs.is_empty()),
            ("upstream_connect_mode", p.upstream_connect_mode != 0),
            ("max_early_data_bytes", p.max_early_data_bytes.is_some()),
            (
                "check_drain_close",
                p.check_drain_close.as_ref().is_some_and(|b| b.value),
            ),
        ];
        if let Some((field, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(format!("{field} is not supported"));
        }
        use tpb::tcp_proxy::ClusterSpecifier;
        let target = match &p.cluster_specifier {
            None => return Err("one of cluster or weighted_clusters is required".into()),
            Some(ClusterSpecifier::Cluster(c)) => Target::Cluster(c.clone()),
            Some(ClusterSpecifier::WeightedClusters(w)) => {
                if w.clusters.is_empty() {
                    return Err("weighted_clusters.clusters must not be empty".into());
                }
                let mut clusters = Vec::with_capacity(w.clusters.len());
                for (i, c) in w.clusters.iter().enumerate() {
                    let at = format!("weighted_clusters.clusters[{i}]");
                    if c.name.is_empty() {
                        return Err(format!("{at}.name must not be empty"));
                    }
                    if c.weight < 1 {
                        return Err(format!("{at}.weight must be at least 1"));
                    }
                    if c.metadata_match.is_some() {
                        return Err(format!("{at}.metadata_match is not supported"));
                    }
                    clusters.push((c.name.clone(), c.weight));
                }
                // u64: the weights are u32 each, so their sum cannot overflow.
                let total = clusters.iter().map(|(_, w)| u64::from(*w)).sum();
                Target::Weighted { clusters, total }
            }
        };
        let idle_timeout = match &p.idle_timeout {
            None => Some(Duration::from_secs(3600)),
            Some(d) => {
                let d = super::duration(d).map_err(|e| format!("idle_timeout: {e}"))?;
                (!d.is_zero()).then_some(d)
            }
        };
        let max_connect_attempts = match &p.max_connect_attempts {
            None => 1,
            Some(v) if v.value >= 1 => v.value,
            Some(v) => {
                return Err(format!(
                    "max_connect_attempts {} must be at least 1",
                    v.value
                ))
            }
        };
        let tunneling = match &p.tunneling_config {
            Some(t) => Some(std::sync::Arc::new(
                Tunneling::translate(t).map_err(|e| format!("tunneling_config.{e}"))?,
            )),
            None => None,
        };
        let access_log = AccessLogs::translate(&p.access_log, "access_log")?;
        Ok(TcpProxy {
            access_log,
            stat_prefix: p.stat_prefix.clone(),
            target,
            idle_timeout,
            max_connect_attempts,
            tunneling,
        })
    }

    /// The cluster for one connection; `draw` is a uniform random number.
    pub fn cluster(&self, draw: u64) -> &str {
        match &self.target {
            Target::Cluster(c) => c,
            Target::Weighted { clusters, total } => {
                let mut point = draw % (*total).max(1);
                for (name, w) in clusters {
                    let w = u64::from(*w);
                    if point < w {
                        return name;
                    }
                    point -= w;
                }
                // Unreachable while total is the weights' sum; the last entry is a safe answer.
                clusters.last().map_or("", |(n, _)| n.as_str())
            }
        }
    }

    /// Every cluster the chain can send to, for `/config_dump` and warming checks.
    pub fn clusters(&self) -> Vec<&str> {
        match &self.target {
            Target::Cluster(c) => vec![c.as_str()],
            Target::Weighted { clusters, .. } => clusters.iter().map(|(n, _)| n.as_str()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3 as corepb;
    use envoy_types::pb::google::protobuf::{BoolValue, Duration as PDuration, UInt32Value};
    use tpb::tcp_proxy::{weighted_cluster::ClusterWeight, ClusterSpecifier, WeightedCluster};

    fn base() -> tpb::TcpProxy {
        tpb::TcpProxy {
            stat_prefix: "outbound|443||a".into(),
            cluster_specifier: Some(ClusterSpecifier::Cluster("a".into())),
            ..Default::default()
        }
    }

    fn weighted(w: &[(&str, u32)]) -> tpb::TcpProxy {
        tpb::TcpProxy {
            cluster_specifier: Some(ClusterSpecifier::WeightedClusters(WeightedCluster {
                clusters: w
                    .iter()
                    .map(|(n, w)| ClusterWeight {
                        name: n.to_string(),
                        weight: *w,
                        ..Default::default()
                    })
                    .collect(),
            })),
            ..base()
        }
    }

    fn err(p: tpb::TcpProxy) -> String {
        TcpProxy::translate(&p).expect_err("should be rejected")
    }

    #[test]
    fn defaults_follow_envoy() {
        let t = TcpProxy::translate(&base()).expect("valid");
        assert_eq!(t.stat_prefix, "outbound|443||a");
        assert_eq!(t.target, Target::Cluster("a".into()));
        assert_eq!(t.idle_timeout, Some(Duration::from_secs(3600)));
        assert_eq!(t.max_connect_attempts, 1);
        assert_eq!(t.cluster(12345), "a");
    }

    #[test]
    fn idle_timeout_zero_disables_and_attempts_are_read() {
        let t = TcpProxy::translate(&tpb::TcpProxy {
            idle_timeout: Some(PDuration {
                seconds: 0,
                nanos: 0,
            }),
            max_connect_attempts: Some(UInt32Value { value: 3 }),
            ..base()
        })
        .expect("valid");
        assert_eq!(t.idle_timeout, None);
        assert_eq!(t.max_connect_attempts, 3);
        let t = TcpProxy::translate(&tpb::TcpProxy {
            idle_timeout: Some(PDuration {
                seconds: 2,
                nanos: 500_000_000,
            }),
            ..base()
        })
        .expect("valid");
        assert_eq!(t.idle_timeout, Some(Duration::from_millis(2500)));
    }

    #[test]
    fn access_log_is_translated() {
        use envoy_types::pb::envoy::config::accesslog::v3 as apb;
        let t = TcpProxy::translate(&tpb::TcpProxy {
            access_log: vec![Default::default()],
            ..base()
        });
        assert_eq!(
            t.unwrap_err(),
            "access_log[0]: access log '' has no typed_config"
        );
        let stdout = apb::AccessLog {
            name: "envoy.access_loggers.stdout".into(),
            filter: None,
            config_type: Some(apb::access_log::ConfigType::TypedConfig(Any {
                type_url: crate::telemetry::access_log::STDOUT_TYPE.into(),
                value: vec![],
            })),
        };
        let t = TcpProxy::translate(&tpb::TcpProxy {
            access_log: vec![stdout],
            ..base()
        })
        .expect("valid");
        assert_eq!(t.access_log.0.len(), 1);
    }

    #[test]
    fn weighted_clusters_draw_by_weight() {
        let t = TcpProxy::translate(&weighted(&[("a", 1), ("b", 3)])).expect("valid");
        assert_eq!(
            t.target,
            Target::Weighted {
                clusters: vec![("a".into(), 1), ("b".into(), 3)],
                total: 4
            }
        );
        let picks: Vec<&str> = (0..8).map(|d| t.cluster(d)).collect();
        assert_eq!(picks, ["a", "b", "b", "b", "a", "b", "b", "b"]);
        assert_eq!(t.clusters(), ["a", "b"]);
    }

    #[test]
    fn rejections_name_the_field() {
        assert_eq!(
            err(tpb::TcpProxy {
                stat_prefix: String::new(),
                ..base()
            }),
            "stat_prefix must not be empty"
        );
        assert_eq!(
            err(tpb::TcpProxy {
                cluster_specifier: None,
                ..base()
            }),
            "one of cluster or weighted_clusters is required"
        );
        assert_eq!(
            err(weighted(&[])),
            "weighted_clusters.clusters must not be empty"
        );
        assert_eq!(
            err(weighted(&[("a", 1), ("", 1)])),
            "weighted_clusters.clusters[1].name must not be empty"
        );
        assert_eq!(
            err(weighted(&[("a", 0)])),
            "weighted_clusters.clusters[0].weight must be at least 1"
        );
        let mut w = weighted(&[("a", 1)]);
        if let Some(ClusterSpecifier::WeightedClusters(wc)) = &mut w.cluster_specifier {
            wc.clusters[0].metadata_match = Some(Default::default());
        }
        assert_eq!(
            err(w),
            "weighted_clusters.clusters[0].metadata_match is not supported"
        );
        assert_eq!(
            err(tpb::TcpProxy {
                max_connect_attempts: Some(UInt32Value { value: 0 }),
                ..base()
            }),
            "max_connect_attempts 0 must be at least 1"
        );
        assert_eq!(
            err(tpb::TcpProxy {
                idle_timeout: Some(PDuration {
                    seconds: -1,
                    nanos: 0
                }),
                ..base()
            }),
            "idle_timeout: invalid duration -1s 0ns"
        );
    }

    #[test]
    fn unsupported_fields_are_refused() {
        let cases: Vec<(&str, tpb::TcpProxy)> = vec![
            (
                "on_demand",
                tpb::TcpProxy {
                    on_demand: Some(Default::default()),
                    ..base()
                },
            ),
            (
                "metadata_match",
                tpb::TcpProxy {
                    metadata_match: Some(corepb::Metadata::default()),
                    ..base()
                },
            ),
            (
                "downstream_idle_timeout",
                tpb::TcpProxy {
                    downstream_idle_timeout: Some(Default::default()),
                    ..base()
                },
            ),
            (
                "upstream_idle_timeout",
                tpb::TcpProxy {
                    upstream_idle_timeout: Some(Default::default()),
                    ..base()
                },
            ),
            (
                "backoff_options",
                tpb::TcpProxy {
                    backoff_options: Some(Default::default()),
                    ..base()
                },
            ),
            (
                "hash_policy",
                tpb::TcpProxy {
                    hash_policy: vec![Default::default()],
                    ..base()
                },
            ),
            (
                "max_downstream_connection_duration",
                tpb::TcpProxy {
                    max_downstream_connection_duration: Some(Default::default()),
                    ..base()
                },
            ),
            (
                "proxy_protocol_tlvs",
                tpb::TcpProxy {
                    proxy_protocol_tlvs: vec![Default::default()],
                    ..base()
                },
            ),
            (
                "upstream_connect_mode",
                tpb::TcpProxy {
                    upstream_connect_mode: 1,
                    ..base()
                },
            ),
            (
                "max_early_data_bytes",
                tpb::TcpProxy {
                    max_early_data_bytes: Some(UInt32Value { value: 1 }),
                    ..base()
                },
            ),
            (
                "check_drain_close",
                tpb::TcpProxy {
                    check_drain_close: Some(BoolValue { value: true }),
                    ..base()
                },
            ),
        ];
        for (field, p) in cases {
            assert_eq!(err(p), format!("{field} is not supported"));
        }
    }

    fn tunnel(t: tpb::tcp_proxy::TunnelingConfig) -> Result<TcpProxy, String> {
        TcpProxy::translate(&tpb::TcpProxy {
            tunneling_config: Some(t),
            ..base()
        })
    }

    fn header(key: &str, value: &str, action: i32) -> corepb::HeaderValueOption {
        corepb::HeaderValueOption {
            header: Some(corepb::HeaderValue {
                key: key.into(),
                value: value.into(),
                ..Default::default()
            }),
            append_action: action,
            ..Default::default()
        }
    }

    #[test]
    fn tunneling_config_as_istiod_renders_it() {
        use tpb::tcp_proxy::TunnelingConfig;
        let t = tunnel(TunnelingConfig {
            hostname: "%DOWNSTREAM_LOCAL_ADDRESS%".into(),
            headers_to_add: vec![
                header("baggage", "a=1", 0),
                header("x-two", "1", 0),
                // APPEND_IF_EXISTS_OR_ADD, then OVERWRITE_IF_EXISTS_OR_ADD.
                header("x-two", "2", 0),
                header("x-one", "1", 0),
                header("x-one", "2", 2),
                // Empty values are dropped unless keep_empty_value.
                header("x-empty", "", 0),
            ],
            propagate_response_headers: true,
            ..Default::default()
        })
        .expect("valid");
        let t = t.tunneling.expect("tunneling");
        let local: std::net::SocketAddr = "10.1.2.3:9080".parse().expect("addr");
        assert_eq!(t.authority(Some(local), "envoy://l/x"), "10.1.2.3:9080");
        // Nothing restored: Envoy's name for the internal address.
        assert_eq!(t.authority(None, "envoy://l/x"), "envoy://l/x");
        let h: Vec<(&str, &str)> = t
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.to_str().expect("ascii")))
            .collect();
        assert_eq!(
            h,
            [
                ("baggage", "a=1"),
                ("x-two", "1"),
                ("x-two", "2"),
                ("x-one", "2")
            ]
        );
        let parts = tunnel(TunnelingConfig {
            hostname: "%DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT%.svc:%DOWNSTREAM_LOCAL_PORT%".into(),
            ..Default::default()
        })
        .expect("valid")
        .tunneling
        .expect("tunneling");
        assert_eq!(parts.authority(Some(local), ""), "10.1.2.3.svc:9080");
        assert_ne!(parts.key, t.key);
    }

    #[test]
    fn tunneling_fields_that_change_the_connect_are_refused() {
        use tpb::tcp_proxy::TunnelingConfig;
        let host = || "%DOWNSTREAM_LOCAL_ADDRESS%".to_string();
        let cases = [
            (
                TunnelingConfig {
                    hostname: host(),
                    use_post: true,
                    ..Default::default()
                },
                "tunneling_config.use_post / post_path: POST tunnels are not supported",
            ),
            (
                TunnelingConfig {
                    hostname: host(),
                    request_id_header: "x-request-id".into(),
                    ..Default::default()
                },
                "tunneling_config.request_id_extension / request_id_header",
            ),
            (
                TunnelingConfig {
                    hostname: "%UPSTREAM_HOST%".into(),
                    ..Default::default()
                },
                "tunneling_config.hostname: '%UPSTREAM_HOST%' is not supported",
            ),
            (
                TunnelingConfig::default(),
                "tunneling_config.hostname must not be empty",
            ),
            (
                TunnelingConfig {
                    hostname: host(),
                    headers_to_add: vec![header(
                        "baggage",
                        "%FILTER_STATE(io.istio.baggage:PLAIN)%",
                        0,
                    )],
                    ..Default::default()
                },
                "tunneling_config.headers_to_add[0]: 'baggage': substitution formatters",
            ),
            (
                TunnelingConfig {
                    hostname: host(),
                    headers_to_add: vec![header(":authority", "x", 0)],
                    ..Default::default()
                },
                "tunneling_config.headers_to_add[0]: ':authority' cannot be set",
            ),
        ];
        for (t, want) in cases {
            let e = tunnel(t).expect_err("refused");
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn from_any_checks_the_type_and_bytes() {
        let good = Any {
            type_url: TCP_PROXY_TYPE.into(),
            value: base().encode_to_vec(),
        };
        assert!(TcpProxy::from_any(&good).is_ok());
        let wrong = Any {
            type_url: "type.googleapis.com/x".into(),
            value: vec![],
        };
        assert!(TcpProxy::from_any(&wrong)
            .expect_err("wrong type")
            .starts_with("expected "));
        let garbage = Any {
            type_url: TCP_PROXY_TYPE.into(),
            value: vec![0xff, 0xff, 0xff],
        };
        assert!(TcpProxy::from_any(&garbage)
            .expect_err("bad bytes")
            .starts_with("tcp_proxy: cannot decode"));
    }
}
