//! The bootstrap's `stats_sinks`, flushed every `stats_flush_interval` (Envoy's default 5 s)
//! or, with `stats_flush_on_admin`, whenever the admin serves `/stats`.
//!
//! `envoy.stat_sinks.statsd` over UDP is what Portico implements, as Envoy's `UdpStatsdSink`
//! writes it: one datagram per stat, `<prefix>.<dotted name>:<value>|<type>`, counters as
//! their change since the last flush (`|c`), gauges as their value (`|g`), both only once
//! used. Portico keeps no histograms, so none are sent.
//!
//! The other sinks Envoy has (a statsd sink through a TCP cluster, DogStatsD, the gRPC
//! metrics service, Hystrix, OpenTelemetry, Wasm) ship the same numbers to collectors Portico
//! does not talk to. They are accepted without effect, with one warning each at start-up: a
//! stats sink never changes where a request goes or whether it is allowed, and the numbers
//! stay on `/stats` and `/stats/prometheus` for a scraper. A type Envoy does not know is
//! refused, naming the field.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::metrics::v3 as mpb;
use prost::Message;

use super::stats::{Kind, StatList};

const STATSD: &str = "type.googleapis.com/envoy.config.metrics.v3.StatsdSink";

/// Sinks Envoy has that Portico accepts without effect (see the module doc).
const INERT: [&str; 6] = [
    "type.googleapis.com/envoy.config.metrics.v3.DogStatsdSink",
    "type.googleapis.com/envoy.config.metrics.v3.MetricsServiceConfig",
    "type.googleapis.com/envoy.config.metrics.v3.HystrixSink",
    "type.googleapis.com/envoy.extensions.stat_sinks.open_telemetry.v3.SinkConfig",
    "type.googleapis.com/envoy.extensions.stat_sinks.wasm.v3.Wasm",
    "type.googleapis.com/envoy.extensions.stat_sinks.graphite_statsd.v3.GraphiteStatsdSink",
];

/// A statsd sink Portico writes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statsd {
    pub address: SocketAddr,
    pub prefix: String,
}

/// The translated `stats_sinks`, with when to flush them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Sinks {
    pub statsd: Vec<Statsd>,
    /// Sinks accepted without effect: (index, name, type), for the start-up warning.
    pub inert: Vec<String>,
    pub interval: Duration,
    pub on_admin: bool,
}

/// Translates the bootstrap's sinks (pure; `Err` names the field).
pub fn translate(b: &Bootstrap) -> Result<Sinks, String> {
    let mut out = Sinks {
        interval: Duration::from_secs(5),
        ..Default::default()
    };
    if let Some(d) = &b.stats_flush_interval {
        let d = Duration::from_secs(d.seconds.max(0) as u64)
            + Duration::from_nanos(d.nanos.max(0) as u64);
        // Envoy's validation: at least 1 ms, at most 300 s.
        if d < Duration::from_millis(1) || d > Duration::from_secs(300) {
            return Err(format!(
                "stats_flush_interval: {d:?} is outside Envoy's range of 1ms to 300s"
            ));
        }
        out.interval = d;
    }
    use envoy_types::pb::envoy::config::bootstrap::v3::bootstrap::{StatsEviction, StatsFlush};
    out.on_admin = matches!(b.stats_flush, Some(StatsFlush::StatsFlushOnAdmin(true)));
    if out.on_admin && b.stats_flush_interval.is_some() {
        return Err(
            "stats_flush_on_admin: cannot be set together with stats_flush_interval".into(),
        );
    }
    // Envoy evicts unused stats from its per-worker caches; Portico keeps no such caches (a
    // removed cluster's stats go with it), so only Envoy's check applies.
    if let Some(StatsEviction::StatsEvictionInterval(d)) = &b.stats_eviction {
        let d = Duration::from_secs(d.seconds.max(0) as u64)
            + Duration::from_nanos(d.nanos.max(0) as u64);
        if !d.as_nanos().is_multiple_of(out.interval.as_nanos()) {
            return Err(format!(
                "stats_eviction_interval: {d:?} is not a multiple of the stats flush interval {:?}",
                out.interval
            ));
        }
    }
    for (i, s) in b.stats_sinks.iter().enumerate() {
        let at = format!("stats_sinks[{i}]");
        let Some(mpb::stats_sink::ConfigType::TypedConfig(any)) = &s.config_type else {
            return Err(format!("{at} '{}': typed_config is required", s.name));
        };
        let t = any.type_url.as_str();
        if t == STATSD {
            let sink = mpb::StatsdSink::decode(any.value.as_slice())
                .map_err(|e| format!("{at}.typed_config: cannot decode {t}: {e}"))?;
            match sink.statsd_specifier {
                Some(mpb::statsd_sink::StatsdSpecifier::Address(a)) => {
                    let address = socket_address(&a)
                        .map_err(|e| format!("{at}.typed_config.address: {e}"))?;
                    out.statsd.push(Statsd {
                        address,
                        prefix: if sink.prefix.is_empty() {
                            "envoy".into()
                        } else {
                            sink.prefix
                        },
                    });
                }
                Some(mpb::statsd_sink::StatsdSpecifier::TcpClusterName(c)) => {
                    out.inert.push(format!(
                        "{at} '{}' (statsd through TCP cluster '{c}')",
                        s.name
                    ));
                }
                None => {
                    return Err(format!(
                        "{at}.typed_config: one of address or tcp_cluster_name is required"
                    ))
                }
            }
        } else if INERT.contains(&t) {
            out.inert.push(format!("{at} '{}' ({t})", s.name));
        } else {
            return Err(format!(
                "{at} '{}': stats sink type '{t}' is not supported",
                s.name
            ));
        }
    }
    Ok(out)
}

fn socket_address(
    a: &envoy_types::pb::envoy::config::core::v3::Address,
) -> Result<SocketAddr, String> {
    use envoy_types::pb::envoy::config::core::v3::{address::Address as A, socket_address};
    match &a.address {
        Some(A::SocketAddress(s)) => {
            let port = match s.port_specifier {
                Some(socket_address::PortSpecifier::PortValue(p)) => p,
                _ => return Err("a port_value is required".into()),
            };
            let ip: std::net::IpAddr = s
                .address
                .parse()
                .map_err(|_| format!("'{}' is not an IP address", s.address))?;
            let port = u16::try_from(port).map_err(|_| format!("port {port} is out of range"))?;
            Ok(SocketAddr::new(ip, port))
        }
        _ => Err("a socket_address is required".into()),
    }
}

/// What one flush sends: the lines of every used stat, counters as deltas from `last` (which
/// is updated). Pure, for the tests.
pub fn flush_lines(list: &StatList, prefix: &str, last: &mut HashMap<String, u64>) -> Vec<String> {
    let mut lines = Vec::new();
    for s in &list.stats {
        match s.kind {
            Kind::Counter => {
                let before = last.insert(s.name.clone(), s.value).unwrap_or(0);
                if s.used {
                    // A counter reset (`/reset_counters`) starts again from zero.
                    let delta = s.value.checked_sub(before).unwrap_or(s.value);
                    lines.push(format!("{prefix}.{}:{delta}|c", s.name));
                }
            }
            Kind::Gauge => {
                if s.used {
                    lines.push(format!("{prefix}.{}:{}|g", s.name, s.value));
                }
            }
        }
    }
    lines
}

/// Runs the sinks until the process ends: a flush each interval, or on each admin `/stats`
/// (`flush` is notified) with `stats_flush_on_admin`.
pub async fn run(sinks: Sinks, state: std::sync::Arc<crate::State>) {
    for w in &sinks.inert {
        tracing::warn!("{w} is accepted without effect: Portico's stats are served on the admin's /stats and /stats/prometheus");
    }
    if sinks.statsd.is_empty() {
        return;
    }
    let mut sockets = Vec::new();
    for s in &sinks.statsd {
        let bind: SocketAddr = if s.address.is_ipv4() {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        match tokio::net::UdpSocket::bind(bind).await {
            Ok(sock) => sockets.push((sock, s, HashMap::new())),
            Err(e) => {
                tracing::warn!(address = %s.address, "statsd sink: cannot open a UDP socket: {e}")
            }
        }
    }
    let mut tick = tokio::time::interval(sinks.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        if sinks.on_admin {
            state.stats_flush.notified().await;
        } else {
            tick.tick().await;
        }
        let list = super::stat_list(&state);
        for (sock, sink, last) in &mut sockets {
            for line in flush_lines(&list, &sink.prefix, last) {
                // UDP: a collector that is down loses the datagram, as with Envoy.
                let _ = sock.send_to(line.as_bytes(), sink.address).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::Any;

    fn bootstrap(yaml: &str) -> Bootstrap {
        let v: serde_json::Value = serde_yaml::from_str(yaml).expect("yaml");
        crate::protojson::dynamic_from_json("envoy.config.bootstrap.v3.Bootstrap", &v)
            .expect("bootstrap")
            .transcode_to()
            .expect("transcode")
    }

    #[test]
    fn istio_agent_sinks_translate() {
        let b = bootstrap(
            r#"
stats_flush_interval: 10s
stats_sinks:
- name: envoy.stat_sinks.metrics_service
  typed_config:
    "@type": type.googleapis.com/envoy.config.metrics.v3.MetricsServiceConfig
    transport_api_version: V3
    grpc_service: {envoy_grpc: {cluster_name: envoy_metrics_service}}
- name: envoy.stat_sinks.statsd
  typed_config:
    "@type": type.googleapis.com/envoy.config.metrics.v3.StatsdSink
    address: {socket_address: {address: 10.1.1.1, port_value: 9125}}
"#,
        );
        let s = translate(&b).expect("sinks");
        assert_eq!(s.interval, Duration::from_secs(10));
        assert_eq!(
            s.statsd,
            vec![Statsd {
                address: "10.1.1.1:9125".parse().expect("addr"),
                prefix: "envoy".into()
            }]
        );
        assert_eq!(s.inert.len(), 1);
        assert!(s.inert[0].contains("MetricsServiceConfig"), "{:?}", s.inert);
    }

    #[test]
    fn unknown_sink_and_bad_fields_are_refused_by_name() {
        let mut b = Bootstrap::default();
        b.stats_sinks.push(mpb::StatsSink {
            name: "mine".into(),
            config_type: Some(mpb::stats_sink::ConfigType::TypedConfig(Any {
                type_url: "type.googleapis.com/acme.Sink".into(),
                value: vec![],
            })),
        });
        let e = translate(&b).expect_err("unknown");
        assert!(
            e.contains("stats_sinks[0] 'mine'") && e.contains("acme.Sink"),
            "{e}"
        );

        let b = bootstrap(
            r#"
stats_sinks:
- name: s
  typed_config:
    "@type": type.googleapis.com/envoy.config.metrics.v3.StatsdSink
    address: {socket_address: {address: statsd.local, port_value: 9125}}
"#,
        );
        let e = translate(&b).expect_err("hostname");
        assert!(e.contains("stats_sinks[0].typed_config.address"), "{e}");

        let b = bootstrap("stats_flush_interval: 0.0001s\n");
        let e = translate(&b).expect_err("too short");
        assert!(e.contains("stats_flush_interval"), "{e}");
    }

    #[test]
    fn counters_flush_as_deltas_and_gauges_as_values_once_used() {
        let mut list = StatList::default();
        list.add_used(Kind::Counter, "cluster.a.upstream_rq_total", 5);
        list.add(
            Kind::Counter,
            "cluster.a.upstream_rq_timeout".into(),
            String::new(),
            String::new(),
            0,
        );
        list.gauge("server.live", 1);
        list.gauge("cluster.a.membership_total", 0);
        let mut last = HashMap::new();
        assert_eq!(
            flush_lines(&list, "envoy", &mut last),
            vec![
                "envoy.cluster.a.upstream_rq_total:5|c",
                "envoy.server.live:1|g"
            ]
        );
        list.stats[0].value = 12;
        assert_eq!(
            flush_lines(&list, "gw", &mut last)[0],
            "gw.cluster.a.upstream_rq_total:7|c"
        );
        // After /reset_counters the count starts again.
        list.stats[0].value = 2;
        assert_eq!(
            flush_lines(&list, "gw", &mut last)[0],
            "gw.cluster.a.upstream_rq_total:2|c"
        );
    }
}
