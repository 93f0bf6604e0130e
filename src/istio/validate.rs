//! Every object in the directory checked on its own, whichever gateway selects it, as
//! istiod's validation webhook and `istioctl validate` check them (istio/istio
//! `pkg/config/validation`): what would change where traffic goes or whether it is served.
//!
//! A VirtualService or ServiceEntry that fails is left out whole, as the webhook would never
//! admit it. A DestinationRule that fails is left out and takes its host's clusters with it
//! (fail closed: serving the service without its rule could drop a TLS origination or a
//! connection limit; the translation always did this with a policy it could not render). A
//! Gateway's bad server is left out alone, the rest of the Gateway served (the translation's
//! long-standing behaviour for servers, which tests/golden/invalid pins); a Gateway with no
//! servers is left out.
//!
//! Checks the translation makes on a bound object (regexes, durations, redirect codes,
//! retry policies, fault and CORS fields) are made here through the same functions, so an
//! object no gateway binds is held to the same rules and reported in the same words.
//! Reports come in the order the translation meets the kinds: DestinationRules, service
//! registry, Gateways, VirtualServices; within a kind, in file order.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use super::model::*;
use super::translate::{check_http_route, check_server_tls, duration, is_http_protocol};
use super::{Config, Invalid, Options};

/// What validation leaves out of a config, and why.
#[derive(Debug, Default, PartialEq)]
pub struct Checked {
    /// Objects left out whole, by index into the config's objects.
    pub skip: BTreeSet<usize>,
    /// Gateway servers left out alone: (object index, server index).
    pub skip_servers: BTreeSet<(usize, usize)>,
    /// DestinationRules left out whose host gets no clusters either, by object index.
    pub fail_closed: BTreeSet<usize>,
    /// One report per object (or Gateway server) left out, with every reason.
    pub reports: Vec<Invalid>,
}

impl Checked {
    /// The config without the objects left out whole.
    pub fn kept(&self, config: &Config) -> Config {
        let mut out = Config::default();
        for (i, o) in config.objects.iter().enumerate() {
            if !self.skip.contains(&i) {
                out.objects.push(o.clone());
                out.files.push(config.file_of(i).to_string());
            }
        }
        out
    }
}

/// The kinds in the order the translation reports them.
const ORDER: [&str; 6] = [
    "DestinationRule",
    "ServiceEntry",
    "WorkloadEntry",
    "Gateway",
    "VirtualService",
    "Secret",
];

pub fn check(config: &Config, options: &Options) -> Checked {
    let mut out = Checked::default();
    let mut reports: Vec<(usize, usize, Invalid)> = Vec::new();
    for (i, o) in config.objects.iter().enumerate() {
        let m = o.metadata();
        let report = |reasons: Vec<String>| Invalid {
            file: config.file_of(i).to_string(),
            kind: o.kind().to_string(),
            name: format!("{}/{}", m.namespace.as_deref().unwrap_or("default"), m.name),
            reason: reasons.join("; "),
        };
        let rank = ORDER
            .iter()
            .position(|k| *k == o.kind())
            .unwrap_or(ORDER.len());
        let errors = match o {
            Object::Gateway(_, gw) => {
                let (whole, servers) = gateway(gw);
                for (s, reasons) in servers {
                    out.skip_servers.insert((i, s));
                    reports.push((rank, i, report(reasons)));
                }
                whole
            }
            Object::VirtualService(m, vs) => virtual_service(m, vs, options),
            Object::DestinationRule(_, dr) => destination_rule(dr),
            Object::ServiceEntry(_, se) => service_entry(se),
            _ => Vec::new(),
        };
        if !errors.is_empty() {
            if matches!(o, Object::DestinationRule(..)) {
                out.fail_closed.insert(i);
            }
            out.skip.insert(i);
            reports.push((rank, i, report(errors)));
        }
    }
    reports.sort_by_key(|(rank, i, _)| (*rank, *i));
    out.reports = reports.into_iter().map(|(_, _, r)| r).collect();
    out
}

// ---------------------------------------------------------------------------------------
// Names and numbers, as Kubernetes and Istio define them.

/// A DNS-1123 label: lower case letters, digits and '-', at most 63, alphanumeric ends.
fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// istio's wildcard label: `*`, or a label optionally prefixed by `*` or `*-`.
fn is_wildcard_label(s: &str) -> bool {
    s == "*"
        || s.len() <= 63
            && is_dns_label(
                s.strip_prefix("*-")
                    .or_else(|| s.strip_prefix('*'))
                    .unwrap_or(s),
            )
}

/// istio's `ValidateWildcardDomain`: a DNS name whose first label may be a wildcard.
fn wildcard_domain(d: &str) -> Result<(), String> {
    if d.is_empty() {
        return Err("empty domain name not allowed".into());
    }
    if d.len() > 255 {
        return Err(format!("domain name '{d}' too long (max 255)"));
    }
    let (first, rest) = match d.split_once('.') {
        Some((f, r)) => (f, Some(r)),
        None => (d, None),
    };
    if !is_wildcard_label(first) {
        return Err(format!(
            "domain name '{d}' invalid (label '{first}' invalid)"
        ));
    }
    let Some(rest) = rest else { return Ok(()) };
    let labels: Vec<&str> = rest.split('.').collect();
    if labels.last().is_some_and(|l| l.parse::<u64>().is_ok()) {
        return Err(format!(
            "domain name '{d}' invalid (top level domain cannot be all-numeric)"
        ));
    }
    for (i, l) in labels.iter().enumerate() {
        // A trailing dot (`istio.io.`) is allowed.
        if i == labels.len() - 1 && l.is_empty() {
            break;
        }
        if !is_dns_label(l) {
            return Err(format!("domain name '{d}' invalid (label '{l}' invalid)"));
        }
    }
    Ok(())
}

fn is_ip(s: &str) -> bool {
    s.parse::<IpAddr>().is_ok()
}

fn port(n: u32, at: &str) -> Result<(), String> {
    if (1..=65535).contains(&n) {
        Ok(())
    } else {
        Err(format!(
            "{at}: port number {n} must be in the range 1..65535"
        ))
    }
}

/// istio's `ValidateDuration`: a duration of at least 1ms, to the millisecond. A duration
/// that does not parse is the translation's to report (in its words).
fn min_duration(text: &str, at: &str) -> Result<(), String> {
    let Ok(d) = duration(text) else {
        return Ok(());
    };
    let body = d.trim_end_matches('s');
    let (secs, frac) = body.split_once('.').unwrap_or((body, ""));
    if frac.len() > 3 {
        return Err(format!(
            "{at}: '{text}': only durations to ms precision are supported"
        ));
    }
    if secs == "0" && frac.is_empty() {
        return Err(format!("{at}: '{text}': a duration must be at least 1ms"));
    }
    Ok(())
}

fn with_duration(errs: &mut Vec<String>, text: Option<&str>, at: &str) {
    if let Some(t) = text {
        match duration(t) {
            Err(e) => errs.push(format!("{at}: {e}")),
            Ok(_) => errs.extend(min_duration(t, at).err()),
        }
    }
}

fn percent(p: Option<&Percent>, at: &str) -> Option<String> {
    let v = p?.value;
    (!(0.0..=100.0).contains(&v)).then(|| format!("{at}: {v} is not a percentage (0-100)"))
}

// ---------------------------------------------------------------------------------------
// Gateway

/// Errors that leave the whole Gateway out, and per bad server its errors.
fn gateway(gw: &GatewaySpec) -> (Vec<String>, Vec<(usize, Vec<String>)>) {
    if gw.servers.is_empty() {
        return (
            vec!["spec.servers: a Gateway needs at least one server".into()],
            Vec::new(),
        );
    }
    let mut bad = Vec::new();
    // Port name -> the server that has it; port number -> the first server on it.
    let mut names: BTreeMap<&str, usize> = BTreeMap::new();
    let mut first_on: BTreeMap<u32, (usize, String, bool)> = BTreeMap::new();
    for (i, s) in gw.servers.iter().enumerate() {
        let mut errs = Vec::new();
        let protocol = s
            .port
            .protocol
            .as_deref()
            .unwrap_or("")
            .to_ascii_uppercase();
        match protocol.as_str() {
            "HTTP" | "HTTP2" | "GRPC" | "GRPC-WEB" | "HTTP_PROXY" | "HTTPS" | "TLS" | "TCP"
            | "MONGO" | "REDIS" | "MYSQL" => {}
            other => errs.push(format!(".port.protocol: unknown protocol '{other}'")),
        }
        if s.port.number == 0 || s.port.number > 65535 {
            errs.push(format!(".port.number: {} is not a port", s.port.number));
        }
        match s.port.name.as_deref() {
            None | Some("") => errs.push(".port.name: a server port needs a name".into()),
            Some(n) => {
                if let Some(j) = names.insert(n, i) {
                    errs.push(format!(
                        ".port.name: '{n}' is the name of servers[{j}]'s port too (port names must be unique in a Gateway)"
                    ));
                }
            }
        }
        if s.hosts.is_empty() {
            errs.push(".hosts: at least one host is required".into());
        }
        for (j, h) in s.hosts.iter().enumerate() {
            if let Err(e) = gateway_host(h) {
                errs.push(format!(".hosts[{j}]: {e}"));
            }
        }
        if let Err(e) = check_server_tls(s, &protocol) {
            errs.push(e);
        }
        // istiod serves one kind of listener per port: plaintext HTTP servers may share
        // one, and TLS servers may; anything else on a taken port is dropped by its merge.
        let tls_server = s.tls.is_some() && !is_http_protocol(&protocol);
        if errs.is_empty() {
            match first_on.get(&s.port.number) {
                None => {
                    first_on.insert(s.port.number, (i, protocol.clone(), tls_server));
                }
                Some((j, first, false)) => {
                    if !(is_http_protocol(first) && is_http_protocol(&protocol)) {
                        errs.push(format!(
                            ".port: port {} is plaintext {first} in servers[{j}]; a {protocol} server cannot share it",
                            s.port.number
                        ));
                    }
                }
                Some((j, _, true)) => {
                    if s.tls.is_none() {
                        errs.push(format!(
                            ".port: port {} serves TLS in servers[{j}]; a server without tls settings cannot share it",
                            s.port.number
                        ));
                    }
                }
            }
        }
        if !errs.is_empty() {
            let errs = errs
                .into_iter()
                .map(|e| format!("spec.servers[{i}]{e}"))
                .collect();
            bad.push((i, errs));
        }
    }
    (Vec::new(), bad)
}

/// A Gateway server host: `host` or `namespace/host`, where host is `*`, a DNS name (not a
/// short one), a wildcard name or an IP.
fn gateway_host(h: &str) -> Result<(), String> {
    let host = match h.split_once('/') {
        Some((n, host)) => {
            if n.is_empty() || host.is_empty() {
                return Err(format!("'{h}': namespace and host cannot be empty"));
            }
            if n != "*" && n != "." && !is_dns_label(n) {
                return Err(format!("'{h}': invalid namespace '{n}'"));
            }
            host
        }
        None => h,
    };
    if host == "*" || is_ip(host) {
        return Ok(());
    }
    if !host.contains('.') {
        return Err(format!(
            "'{h}': short names (not fully qualified) are not allowed"
        ));
    }
    if host.contains('*') && !host.starts_with("*.") {
        return Err(format!("'{h}': partial wildcard '{host}' not allowed"));
    }
    wildcard_domain(host).map_err(|e| format!("'{h}': {e}"))
}

// ---------------------------------------------------------------------------------------
// VirtualService

fn virtual_service(m: &Metadata, vs: &VirtualServiceSpec, options: &Options) -> Vec<String> {
    let vs_ns = m.namespace.as_deref().unwrap_or("default");
    let mut errs = Vec::new();
    let to_mesh = vs.gateways.is_empty() || vs.gateways.iter().any(|g| g == "mesh");
    for (i, h) in vs.hosts.iter().enumerate() {
        if is_ip(h) {
            continue;
        }
        if let Err(e) = wildcard_domain(h) {
            errs.push(format!("spec.hosts[{i}]: {e}"));
        } else if h == "*" && to_mesh {
            errs.push(format!(
                "spec.hosts[{i}]: '*' is not allowed for a VirtualService bound to the mesh"
            ));
        }
    }
    for i in 0..vs.hosts.len() {
        for j in i + 1..vs.hosts.len() {
            if hosts_overlap(&vs.hosts[i], &vs.hosts[j]) {
                errs.push(format!(
                    "spec.hosts: duplicate hosts '{}' and '{}'",
                    vs.hosts[i], vs.hosts[j]
                ));
            }
        }
    }
    for (i, g) in vs.gateways.iter().enumerate() {
        errs.extend(
            gateway_name(g)
                .err()
                .map(|e| format!("spec.gateways[{i}]: {e}")),
        );
    }
    if vs.http.is_empty() && vs.tcp.is_empty() && vs.tls.is_empty() {
        errs.push("spec: one of http, tcp, tls is required".into());
    }
    for (i, http) in vs.http.iter().enumerate() {
        let at = format!("spec.http[{i}]");
        // The translation's own checks first, in its words.
        if let Err(e) = check_http_route(http, vs_ns, options, &at) {
            errs.push(e);
        }
        http_route(http, &at, &mut errs);
    }
    for (i, tcp) in vs.tcp.iter().enumerate() {
        let at = format!("spec.tcp[{i}]");
        for (j, lm) in tcp.matches.iter().enumerate() {
            l4_match(
                lm.port,
                &lm.gateways,
                &format!("{at}.match[{j}]"),
                &mut errs,
            );
        }
        route_destinations(&tcp.route, &at, &mut errs);
    }
    for (i, tls) in vs.tls.iter().enumerate() {
        let at = format!("spec.tls[{i}]");
        if tls.matches.is_empty() {
            errs.push(format!("{at}.match: at least one match is required"));
        }
        for (j, tm) in tls.matches.iter().enumerate() {
            let at = format!("{at}.match[{j}]");
            if tm.sni_hosts.is_empty() {
                errs.push(format!("{at}.sniHosts: at least one SNI host is required"));
            }
            for (k, sni) in tm.sni_hosts.iter().enumerate() {
                if let Err(e) = wildcard_domain(sni) {
                    errs.push(format!("{at}.sniHosts[{k}]: {e}"));
                } else if !vs.hosts.iter().any(|h| host_covers(h, sni)) {
                    errs.push(format!(
                        "{at}.sniHosts[{k}]: '{sni}' is not within any of the VirtualService's hosts"
                    ));
                }
            }
            l4_match(tm.port, &tm.gateways, &at, &mut errs);
        }
        route_destinations(&tls.route, &at, &mut errs);
    }
    errs
}

/// True if `pattern` (a host, or `*.suffix`, or `*`) matches every name `name` matches.
fn host_covers(pattern: &str, name: &str) -> bool {
    if pattern == "*" || pattern == name {
        return true;
    }
    match pattern.strip_prefix('*') {
        Some(suffix) => name.strip_prefix('*').unwrap_or(name).ends_with(suffix),
        None => false,
    }
}

fn hosts_overlap(a: &str, b: &str) -> bool {
    host_covers(a, b) || host_covers(b, a)
}

/// A `gateways` entry: `namespace/name` of DNS labels, `mesh`, or a (legacy) name.
fn gateway_name(g: &str) -> Result<(), String> {
    match g.split_once('/') {
        Some((n, name)) => {
            if !is_dns_label(n) {
                return Err(format!("invalid namespace '{n}' in '{g}'"));
            }
            if !is_dns_label(name) {
                return Err(format!("invalid gateway name '{name}' in '{g}'"));
            }
            Ok(())
        }
        None => wildcard_domain(g)
            .and_then(|()| {
                if g.contains('*') {
                    Err(format!("'{g}' is not a gateway name"))
                } else {
                    Ok(())
                }
            })
            .map_err(|e| format!("invalid gateway name: {e}")),
    }
}

fn l4_match(p: Option<u32>, gateways: &[String], at: &str, errs: &mut Vec<String>) {
    if let Some(p) = p.filter(|p| *p != 0) {
        errs.extend(port(p, &format!("{at}.port")).err());
    }
    for (i, g) in gateways.iter().enumerate() {
        errs.extend(
            gateway_name(g)
                .err()
                .map(|e| format!("{at}.gateways[{i}]: {e}")),
        );
    }
}

/// What istio checks on an http route beyond what the translation does.
fn http_route(http: &HttpRoute, at: &str, errs: &mut Vec<String>) {
    for (j, hm) in http.matches.iter().enumerate() {
        l4_match(hm.port, &hm.gateways, &format!("{at}.match[{j}]"), errs);
    }
    for (k, d) in http.route.iter().enumerate() {
        destination(
            &d.destination,
            &format!("{at}.route[{k}].destination"),
            errs,
        );
    }
    if http.mirror.is_some() && !http.mirrors.is_empty() {
        errs.push(format!("{at}: only one of mirror, mirrors may be set"));
    }
    if let Some(d) = &http.mirror {
        destination(d, &format!("{at}.mirror"), errs);
    }
    errs.extend(percent(
        http.mirror_percentage.as_ref(),
        &format!("{at}.mirrorPercentage.value"),
    ));
    for (k, mi) in http.mirrors.iter().enumerate() {
        destination(
            &mi.destination,
            &format!("{at}.mirrors[{k}].destination"),
            errs,
        );
        errs.extend(percent(
            mi.percentage.as_ref(),
            &format!("{at}.mirrors[{k}].percentage.value"),
        ));
    }
    if let Some(t) = &http.timeout {
        errs.extend(min_duration(t, &format!("{at}.timeout")).err());
    }
    if let Some(r) = &http.retries {
        let attempts = r.attempts.unwrap_or(0);
        if attempts < 0 {
            errs.push(format!("{at}.retries.attempts: {attempts} is negative"));
        }
        if attempts == 0
            && (r.per_try_timeout.is_some()
                || r.retry_on.is_some()
                || r.retry_remote_localities.is_some())
        {
            errs.push(format!(
                "{at}.retries: a retry policy is configured while attempts is 0 (retries disabled)"
            ));
        }
        if let Some(t) = &r.per_try_timeout {
            errs.extend(min_duration(t, &format!("{at}.retries.perTryTimeout")).err());
        }
    }
    if let Some(f) = &http.fault {
        if f.delay.is_none() && f.abort.is_none() {
            errs.push(format!("{at}.fault: an abort or a delay is required"));
        }
        if let Some(d) = &f.delay {
            if let Some(t) = &d.fixed_delay {
                errs.extend(min_duration(t, &format!("{at}.fault.delay.fixedDelay")).err());
            }
            errs.extend(percent(
                d.percentage.as_ref(),
                &format!("{at}.fault.delay.percentage.value"),
            ));
            if let Some(p) = d.percent.filter(|p| *p > 100) {
                errs.push(format!("{at}.fault.delay.percent: {p} is not a percentage"));
            }
        }
        if let Some(a) = &f.abort {
            errs.extend(percent(
                a.percentage.as_ref(),
                &format!("{at}.fault.abort.percentage.value"),
            ));
        }
    }
    if let Some(rd) = &http.redirect {
        if rd.uri.is_none() && rd.authority.is_none() && rd.port.is_none() && rd.scheme.is_none() {
            errs.push(format!(
                "{at}.redirect: one of uri, authority, scheme, port is required"
            ));
        }
        if let Some(s) = rd
            .scheme
            .as_deref()
            .filter(|s| !matches!(*s, "http" | "https"))
        {
            errs.push(format!(
                "{at}.redirect.scheme: '{s}' is neither http nor https"
            ));
        }
        if let Some(p) = rd.port {
            errs.extend(port(p, &format!("{at}.redirect.port")).err());
        }
    }
    if let Some(rw) = &http.rewrite {
        if rw.uri.is_none() && rw.authority.is_none() && rw.uri_regex_rewrite.is_none() {
            errs.push(format!(
                "{at}.rewrite: one of uri, authority, uriRegexRewrite is required"
            ));
        }
        if let Some(rr) = &rw.uri_regex_rewrite {
            if rr.pattern.is_empty() || rr.rewrite.is_empty() {
                errs.push(format!(
                    "{at}.rewrite.uriRegexRewrite: both match and rewrite are required"
                ));
            }
        }
    }
}

fn route_destinations(route: &[RouteDestination], at: &str, errs: &mut Vec<String>) {
    if route.is_empty() {
        errs.push(format!("{at}.route: at least one destination is required"));
    }
    for (k, d) in route.iter().enumerate() {
        if d.destination.host.is_empty() {
            errs.push(format!("{at}.route[{k}].destination.host is required"));
        } else {
            destination(
                &d.destination,
                &format!("{at}.route[{k}].destination"),
                errs,
            );
        }
    }
    if route.len() > 1 && route.iter().all(|d| d.weight.unwrap_or(0) == 0) {
        errs.push(format!(
            "{at}.route: with several destinations, weights are required and must not all be 0"
        ));
    }
}

/// A destination's host (not `*`), subset name (a DNS label) and port.
fn destination(d: &Destination, at: &str, errs: &mut Vec<String>) {
    // An empty host is reported by the translation's check.
    if d.host == "*" {
        errs.push(format!("{at}.host: '*' is not a destination"));
    } else if !d.host.is_empty() {
        errs.extend(
            wildcard_domain(&d.host)
                .err()
                .map(|e| format!("{at}.host: {e}")),
        );
    }
    if let Some(s) = &d.subset {
        if !is_dns_label(s) {
            errs.push(format!(
                "{at}.subset: '{s}' is not a valid subset name (a DNS label)"
            ));
        }
    }
    if let Some(p) = &d.port {
        errs.extend(port(p.number, &format!("{at}.port.number")).err());
    }
}

// ---------------------------------------------------------------------------------------
// DestinationRule

fn destination_rule(dr: &DestinationRuleSpec) -> Vec<String> {
    let mut errs = Vec::new();
    if dr.host.is_empty() {
        // The translation's words.
        errs.push("spec.host is required".into());
    } else if let Err(e) = wildcard_domain(&dr.host) {
        errs.push(format!("spec.host: {e}"));
    }
    if let Some(p) = &dr.traffic_policy {
        traffic_policy(p, "trafficPolicy", &mut errs);
    }
    let mut seen = BTreeSet::new();
    for (i, s) in dr.subsets.iter().enumerate() {
        let at = format!("subsets[{i}]");
        if !is_dns_label(&s.name) {
            errs.push(format!(
                "{at}.name: '{}' is not a valid subset name (a DNS label)",
                s.name
            ));
        }
        if !seen.insert(&s.name) {
            errs.push(format!("{at}.name: duplicate subset name '{}'", s.name));
        }
        if let Some(p) = &s.traffic_policy {
            traffic_policy(p, &format!("{at}.trafficPolicy"), &mut errs);
        }
    }
    errs
}

fn traffic_policy(p: &TrafficPolicy, at: &str, errs: &mut Vec<String>) {
    policy_parts(
        p.load_balancer.as_ref(),
        p.connection_pool.as_ref(),
        p.outlier_detection.as_ref(),
        at,
        errs,
    );
    for (i, pl) in p.port_level_settings.iter().enumerate() {
        let at = format!("{at}.portLevelSettings[{i}]");
        match &pl.port {
            None => errs.push(format!("{at}.port is required")),
            Some(sel) => errs.extend(port(sel.number, &format!("{at}.port.number")).err()),
        }
        policy_parts(
            pl.load_balancer.as_ref(),
            pl.connection_pool.as_ref(),
            pl.outlier_detection.as_ref(),
            &at,
            errs,
        );
    }
}

fn policy_parts(
    lb: Option<&LoadBalancer>,
    pool: Option<&ConnectionPool>,
    outlier: Option<&OutlierDetection>,
    at: &str,
    errs: &mut Vec<String>,
) {
    if let Some(lb) = lb {
        if lb.simple.is_some() && lb.consistent_hash.is_some() {
            errs.push(format!(
                "{at}.loadBalancer: only one of simple, consistentHash may be set"
            ));
        }
        if let Some(s) = &lb.simple {
            if !matches!(
                s.as_str(),
                "UNSPECIFIED"
                    | "RANDOM"
                    | "PASSTHROUGH"
                    | "ROUND_ROBIN"
                    | "LEAST_REQUEST"
                    | "LEAST_CONN"
            ) {
                errs.push(format!("{at}.loadBalancer.simple: unknown value '{s}'"));
            }
        }
        if let Some(h) = &lb.consistent_hash {
            if let Some(c) = &h.http_cookie {
                if c.name.is_empty() {
                    errs.push(format!(
                        "{at}.loadBalancer.consistentHash.httpCookie.name is required"
                    ));
                }
                with_duration(
                    errs,
                    c.ttl.as_deref().filter(|t| duration(t).is_err()),
                    &format!("{at}.loadBalancer.consistentHash.httpCookie.ttl"),
                );
            }
            if let Some(t) = h.maglev.as_ref().and_then(|m| m.table_size) {
                if t == 0 || t >= 5_000_011 || !is_prime(t) {
                    errs.push(format!(
                        "{at}.loadBalancer.consistentHash.maglev.tableSize: {t} must be a prime below 5000011"
                    ));
                }
            }
        }
        with_duration(
            errs,
            lb.warmup_duration_secs.as_deref(),
            &format!("{at}.loadBalancer.warmupDurationSecs"),
        );
    }
    if let Some(pool) = pool {
        if let Some(tcp) = &pool.tcp {
            let at = format!("{at}.connectionPool.tcp");
            with_duration(
                errs,
                tcp.connect_timeout.as_deref(),
                &format!("{at}.connectTimeout"),
            );
            with_duration(
                errs,
                tcp.max_connection_duration.as_deref(),
                &format!("{at}.maxConnectionDuration"),
            );
            // 0s turns the idle timeout off.
            with_duration(
                errs,
                tcp.idle_timeout
                    .as_deref()
                    .filter(|t| duration(t).map_or(true, |d| d != "0s")),
                &format!("{at}.idleTimeout"),
            );
            if let Some(k) = &tcp.tcp_keepalive {
                with_duration(errs, k.time.as_deref(), &format!("{at}.tcpKeepalive.time"));
                with_duration(
                    errs,
                    k.interval.as_deref(),
                    &format!("{at}.tcpKeepalive.interval"),
                );
            }
        }
        if let Some(http) = &pool.http {
            with_duration(
                errs,
                http.idle_timeout.as_deref(),
                &format!("{at}.connectionPool.http.idleTimeout"),
            );
        }
    }
    if let Some(o) = outlier {
        let at = format!("{at}.outlierDetection");
        with_duration(errs, o.interval.as_deref(), &format!("{at}.interval"));
        with_duration(
            errs,
            o.base_ejection_time.as_deref(),
            &format!("{at}.baseEjectionTime"),
        );
        for (name, v) in [
            ("maxEjectionPercent", o.max_ejection_percent),
            ("minHealthPercent", o.min_health_percent),
        ] {
            if let Some(v) = v.filter(|v| *v > 100) {
                errs.push(format!("{at}.{name}: {v} is not a percentage (0-100)"));
            }
        }
    }
}

/// Envoy's (and istio's) primality test for Maglev table sizes.
fn is_prime(x: u64) -> bool {
    if x < 4 {
        return x > 1;
    }
    if x.is_multiple_of(2) {
        return false;
    }
    let mut f = 3;
    while f * f <= x {
        if x.is_multiple_of(f) {
            return false;
        }
        f += 2;
    }
    true
}

// ---------------------------------------------------------------------------------------
// ServiceEntry

fn service_entry(se: &ServiceEntrySpec) -> Vec<String> {
    let mut errs = Vec::new();
    if se.hosts.is_empty() {
        // The translation's words.
        errs.push("spec.hosts: at least one host is required".into());
    }
    for (i, h) in se.hosts.iter().enumerate() {
        if h == "*" {
            errs.push(format!("spec.hosts[{i}]: '*' is not allowed"));
        } else if let Err(e) = wildcard_domain(h) {
            errs.push(format!("spec.hosts[{i}]: {e}"));
        }
    }
    let resolution = se.resolution.as_deref().unwrap_or("NONE");
    if !matches!(
        resolution,
        "NONE" | "STATIC" | "DNS" | "DNS_ROUND_ROBIN" | "DYNAMIC_DNS"
    ) {
        errs.push(format!("spec.resolution: unknown value '{resolution}'"));
    }
    if let Some(l) = se
        .location
        .as_deref()
        .filter(|l| !matches!(*l, "MESH_EXTERNAL" | "MESH_INTERNAL"))
    {
        errs.push(format!("spec.location: unknown value '{l}'"));
    }
    let mut numbers = BTreeSet::new();
    let mut names = BTreeSet::new();
    for (i, p) in se.ports.iter().enumerate() {
        let at = format!("spec.ports[{i}]");
        errs.extend(port(p.number, &format!("{at}.number")).err());
        if let Some(t) = p.target_port {
            errs.extend(port(t, &format!("{at}.targetPort")).err());
        }
        if !numbers.insert(p.number) {
            errs.push(format!("{at}.number: port {} is defined twice", p.number));
        }
        let name = p.name.as_deref().unwrap_or("");
        if !names.insert(name) {
            errs.push(format!("{at}.name: port name '{name}' is defined twice"));
        }
    }
    // istio also refuses workloadSelector with endpoints; the translation serves both (the
    // features golden pins it), so that rule is left to the operator's istioctl.
    match resolution {
        "NONE" if !se.endpoints.is_empty() => {
            errs.push("spec.endpoints: resolution NONE takes no endpoints".into())
        }
        "DNS_ROUND_ROBIN" if se.endpoints.len() > 1 => errs
            .push("spec.endpoints: resolution DNS_ROUND_ROBIN takes at most one endpoint".into()),
        _ => {}
    }
    for (i, e) in se.endpoints.iter().enumerate() {
        let at = format!("spec.endpoints[{i}]");
        let address_ok = match resolution {
            "STATIC" => is_ip(&e.address) || e.address.starts_with("unix://"),
            _ => is_ip(&e.address) || wildcard_domain(&e.address).is_ok(),
        };
        if !address_ok {
            errs.push(format!(
                "{at}.address: '{}' is not a valid address for resolution {resolution}",
                e.address
            ));
        }
        for (name, p) in &e.ports {
            if !names.contains(name.as_str()) {
                errs.push(format!(
                    "{at}.ports.{name}: no port of the ServiceEntry is named '{name}'"
                ));
            }
            errs.extend(port(*p, &format!("{at}.ports.{name}")).err());
        }
    }
    errs
}

#[cfg(test)]
#[path = "validate_tests.rs"]
mod tests;
