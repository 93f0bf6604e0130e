//! `GET /explain`: what the gateway would do with a request, from the serving snapshot, by
//! the request path's own functions (the listener's chain selection, the router, the
//! clusters' health): the listener and chain, the virtual host and route (index and name),
//! the action, the cluster(s) and each endpoint's eligibility, and the HTTP filters the
//! request would pass. Nothing is sent anywhere.
//!
//! Query: `authority` and `path` (required), `method` (GET), `scheme` (http), `header=name:value`
//! (repeatable), `listener` (a listener's name or port; optional when one HTTP listener
//! serves), `sni` (for TLS chains chosen by server name).

use std::sync::Arc;

use serde_json::{json, Value as Json};

use crate::matcher::RequestView;
use crate::snapshot::route::{Action, Target};
use crate::snapshot::{ActiveListener, Snapshot};

/// The explanation, or a message naming the query parameter that is wrong (a 400).
pub fn explain(snap: &Snapshot, params: &[(String, String)]) -> Result<Json, String> {
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let authority = get("authority")
        .filter(|a| !a.is_empty())
        .ok_or("authority: required")?;
    let path = get("path").ok_or("path: required")?;
    if !path.starts_with('/') {
        return Err(format!("path: '{path}' must start with '/'"));
    }
    let method = get("method").unwrap_or("GET");
    let scheme = get("scheme").unwrap_or("http");
    let sni = get("sni").unwrap_or("");
    let mut headers = http::HeaderMap::new();
    for (_, h) in params.iter().filter(|(n, _)| n == "header") {
        let (k, v) = h
            .split_once(':')
            .ok_or_else(|| format!("header: '{h}' is not name:value"))?;
        let name = http::HeaderName::from_bytes(k.trim().to_ascii_lowercase().as_bytes())
            .map_err(|_| format!("header: '{k}' is not a header name"))?;
        let value = http::HeaderValue::from_str(v.trim())
            .map_err(|_| format!("header: the value of '{k}' is not a header value"))?;
        headers.append(name, value);
    }
    let listener = pick_listener(snap, get("listener"))?;
    let def = &listener.def;
    let port = def.addr.port();
    let conn = crate::snapshot::filter_chain::Conn {
        destination_port: port,
        server_name: sni,
        transport_protocol: if sni.is_empty() { "raw_buffer" } else { "tls" },
        application_protocols: &[],
    };
    let mut out = json!({"listener": def.name, "address": def.addr.to_string()});
    let Some(i) = def.select_chain(&conn) else {
        out["outcome"] = "no filter chain matches: the connection is closed".into();
        return Ok(out);
    };
    let Some(chain) = listener.chains.get(i) else {
        return Ok(out);
    };
    out["filter_chain"] = json!({"index": i, "name": chain.def.name});
    let Some(hcm) = chain.def.hcm() else {
        out["outcome"] = "a TCP chain (tcp_proxy): no HTTP routing".into();
        if let Some(t) = chain.def.tcp() {
            out["tcp_proxy"] = json!(format!("{t:?}").chars().take(300).collect::<String>());
        }
        return Ok(out);
    };
    // The authority as routing sees it (lowercased, the port dropped as configured).
    let lower = authority.to_ascii_lowercase();
    let host = match split_port(&lower) {
        (h, Some(p))
            if chain.routes.ignore_port
                || hcm.strip_any_host_port
                || (hcm.strip_matching_host_port && p == port.to_string()) =>
        {
            h.to_string()
        }
        _ => lower.clone(),
    };
    let view = RequestView {
        host: &host,
        authority,
        path,
        method,
        scheme,
        headers: &headers,
    };
    out["route_configuration"] = chain.routes.name.clone().into();
    let filters: Vec<Json> = hcm.filters.iter().map(|f| json!(f.name())).collect();
    let Some((vh, route)) = crate::router::route(&chain.routes, &view) else {
        let vhosts: Vec<&str> = chain
            .routes
            .vhosts
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        out["outcome"] = match chain.routes.vhost(&host) {
            None => format!("404: no virtual host's domains match '{host}'"),
            Some(v) => format!(
                "404: virtual host '{}' has no route matching {method} {path}",
                v.name
            ),
        }
        .into();
        out["virtual_hosts"] = json!(vhosts);
        out["http_filters"] = json!(filters);
        return Ok(out);
    };
    let index = vh
        .routes
        .iter()
        .position(|r| std::ptr::eq(r, route))
        .unwrap_or(0);
    out["virtual_host"] = vh.name.clone().into();
    out["route"] = json!({"index": index, "name": &*route.name});
    let overridden: Vec<Json> = hcm
        .filters
        .iter()
        .filter(|f| {
            let n = f.name();
            route.filters.fault_override(n).is_some()
                || route.filters.rbac_override(n).is_some()
                || route.filters.rate_limits.iter().any(|(x, _)| x == n)
        })
        .map(|f| json!(f.name()))
        .collect();
    out["http_filters"] = json!(filters);
    out["route_overrides_filters"] = json!(overridden);
    match &route.action {
        Action::Direct { status, .. } => {
            out["action"] = json!({"direct_response": status.as_u16()});
        }
        Action::Redirect(_) => {
            out["action"] = json!("redirect");
        }
        Action::Forward(f) => {
            let targets: Vec<(Arc<str>, Option<u64>)> = match &f.target {
                Target::Cluster(c) => vec![(c.clone(), None)],
                Target::Weighted(w) => w
                    .clusters
                    .iter()
                    .map(|(c, weight)| (c.clone(), Some(*weight)))
                    .collect(),
            };
            let clusters: Vec<Json> = targets
                .iter()
                .map(|(name, weight)| cluster(snap, name, *weight))
                .collect();
            out["action"] = json!({"forward": clusters});
        }
    }
    Ok(out)
}

/// `host[:port]` into host and port; IPv6 literals keep their brackets.
fn split_port(a: &str) -> (&str, Option<&str>) {
    let colon = if a.starts_with('[') {
        a.find("]:").map(|i| i + 1)
    } else {
        a.rfind(':')
    };
    match colon {
        Some(i) => (&a[..i], Some(&a[i + 1..])),
        None => (a, None),
    }
}

/// The listener by name or port; the only HTTP listener when none is named.
fn pick_listener<'s>(snap: &'s Snapshot, want: Option<&str>) -> Result<&'s ActiveListener, String> {
    let mut all: Vec<&ActiveListener> = snap.listeners.values().map(|l| &**l).collect();
    all.sort_by(|a, b| a.def.name.cmp(&b.def.name));
    match want {
        Some(w) => all
            .into_iter()
            .find(|l| {
                l.def.name == w
                    || w.parse::<u16>()
                        .is_ok_and(|p| l.def.binds.iter().any(|b| b.addr.port() == p))
            })
            .ok_or_else(|| format!("listener: no listener named or listening on '{w}'")),
        None => {
            let http: Vec<&ActiveListener> = all
                .into_iter()
                .filter(|l| l.chains.iter().any(|c| c.def.hcm().is_some()))
                .collect();
            match http.as_slice() {
                [one] => Ok(one),
                [] => Err("listener: no HTTP listener is serving".into()),
                many => Err(format!(
                    "listener: required, one of {:?}",
                    many.iter().map(|l| l.def.name.as_str()).collect::<Vec<_>>()
                )),
            }
        }
    }
}

/// A cluster and each endpoint's eligibility.
fn cluster(snap: &Snapshot, name: &str, weight: Option<u64>) -> Json {
    let Some(c) = snap.clusters.get(name) else {
        return json!({"cluster": name, "weight": weight, "outcome": "503: the cluster is not in the configuration (NC)"});
    };
    let hosts: Vec<Json> = c
        .endpoints
        .hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let hc = match c.hc.get(i) {
                Some(Some(_)) => c
                    .stats
                    .health
                    .flags_of(&h.addr)
                    .or(Some(crate::snapshot::health_check::HcFlags::NEW)),
                _ => None,
            };
            let flags = crate::snapshot::health_check::flags_text(h.health, hc.as_ref());
            let effective = crate::snapshot::health_check::effective(
                h.health,
                c.hc.get(i).and_then(Option::as_ref),
            );
            let why = match effective {
                crate::snapshot::cluster::Health::Healthy if h.weight == 0 => "weight 0",
                crate::snapshot::cluster::Health::Healthy => "eligible",
                crate::snapshot::cluster::Health::Degraded => {
                    "degraded: used only when healthy hosts are not enough"
                }
                crate::snapshot::cluster::Health::Unhealthy => {
                    "unhealthy (EDS status or active health check): not picked unless the priority panics"
                }
            };
            json!({
                "address": h.addr.to_string(),
                "priority": h.priority,
                "weight": h.weight,
                "health_flags": flags,
                "eligibility": why,
            })
        })
        .collect();
    let healthy = c.healthy_count();
    json!({
        "cluster": name,
        "weight": weight,
        "healthy": healthy,
        "hosts": hosts,
        "outcome": if c.endpoints.hosts.is_empty() {
            "503: no endpoints (UH)"
        } else if healthy == 0 {
            "no healthy host: the load balancer's panic mode picks among all"
        } else {
            "forwarded to an eligible host of the highest priority that has them"
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_queries_name_the_parameter() {
        let snap = Snapshot::default();
        let p = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        assert_eq!(
            explain(&snap, &p(&[("path", "/")])),
            Err("authority: required".into())
        );
        assert_eq!(
            explain(&snap, &p(&[("authority", "a"), ("path", "x")])),
            Err("path: 'x' must start with '/'".into())
        );
        assert_eq!(
            explain(
                &snap,
                &p(&[("authority", "a"), ("path", "/"), ("header", "nocolon")])
            ),
            Err("header: 'nocolon' is not name:value".into())
        );
        assert_eq!(
            explain(&snap, &p(&[("authority", "a"), ("path", "/")])),
            Err("listener: no HTTP listener is serving".into())
        );
    }
}
