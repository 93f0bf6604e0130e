//! HTTP upgrades (`upgrade_configs`) on the connection manager and per route, decided as
//! Envoy's `createUpgradeFilterChain` decides them: a route that names the upgrade type has
//! the last word; otherwise the connection manager's list does.

use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;

/// Upgrade types with their `enabled` flag. Kept as a short list: there are one or two in
/// practice, and a scan with a case-insensitive compare beats a map for that.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Upgrades(Box<[(Box<str>, bool)]>);

impl Upgrades {
    /// The flag for `upgrade` (the request's `Upgrade` value), if this level names it.
    /// Upgrade names compare case-insensitively, as Envoy's lookups do.
    pub fn lookup(&self, upgrade: &[u8]) -> Option<bool> {
        self.0
            .iter()
            .find(|(t, _)| t.as_bytes().eq_ignore_ascii_case(upgrade))
            .map(|(_, on)| *on)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The connection manager's `upgrade_configs`.
    pub fn from_hcm(list: &[hcm::http_connection_manager::UpgradeConfig]) -> Result<Self, String> {
        let mut out: Vec<(Box<str>, bool)> = Vec::with_capacity(list.len());
        for (i, u) in list.iter().enumerate() {
            if !u.filters.iter().all(is_router) {
                // A separate filter chain per upgrade is not built (a router-only one is the
                // plain chain minus its filters); refusing it beats running the upgrade through
                // filters the config did not ask for.
                return Err(format!(
                    "upgrade_configs[{i}] '{}': filters other than the router are not supported",
                    u.upgrade_type
                ));
            }
            // Envoy refuses a second config for a name it already has, ignoring case.
            if out
                .iter()
                .any(|(t, _)| t.eq_ignore_ascii_case(&u.upgrade_type))
            {
                return Err(format!(
                    "multiple upgrade configs with the same name: '{}'",
                    u.upgrade_type
                ));
            }
            out.push((
                u.upgrade_type.as_str().into(),
                u.enabled.as_ref().is_none_or(|b| b.value),
            ));
        }
        Ok(Upgrades(out.into()))
    }

    /// A route action's `upgrade_configs`.
    pub fn from_route(list: &[rpb::route_action::UpgradeConfig]) -> Result<Self, String> {
        let mut out: Vec<(Box<str>, bool)> = Vec::with_capacity(list.len());
        for u in list {
            if u.upgrade_type.is_empty()
                || u.upgrade_type
                    .bytes()
                    .any(|b| b == 0 || b == b'\r' || b == b'\n')
            {
                return Err(format!(
                    "upgrade_configs: invalid upgrade_type '{}'",
                    u.upgrade_type.escape_default()
                ));
            }
            if u.connect_config.is_some() && u.upgrade_type != "CONNECT" {
                return Err(format!(
                    "Non-CONNECT upgrade type {} has ConnectConfig",
                    u.upgrade_type
                ));
            }
            if u.connect_config
                .as_ref()
                .is_some_and(|c| c.allow_post || c.proxy_protocol_config.is_some())
            {
                return Err(
                    "upgrade_configs: connect_config allow_post and proxy_protocol_config are not supported"
                        .into(),
                );
            }
            // Envoy's per-route map ignores case too.
            if out
                .iter()
                .any(|(t, _)| t.eq_ignore_ascii_case(&u.upgrade_type))
            {
                return Err(format!("Duplicate upgrade {}", u.upgrade_type));
            }
            out.push((
                u.upgrade_type.as_str().into(),
                u.enabled.as_ref().is_none_or(|b| b.value),
            ));
        }
        Ok(Upgrades(out.into()))
    }
}

fn is_router(f: &hcm::HttpFilter) -> bool {
    matches!(&f.config_type,
        Some(hcm::http_filter::ConfigType::TypedConfig(a)) if a.type_url == super::listener::ROUTER_TYPE)
}

/// Whether an `Upgrade: upgrade` request may be proxied: a route that names the type decides
/// (either way); otherwise the connection manager must list it enabled. `route` is `None`
/// when no forwarding route matched (no route, direct responses, redirects).
pub fn allowed(hcm: &Upgrades, route: Option<&Upgrades>, upgrade: &[u8]) -> bool {
    match route.and_then(|r| r.lookup(upgrade)) {
        Some(on) => on,
        None => hcm.lookup(upgrade).unwrap_or(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::BoolValue;

    fn h(t: &str, enabled: Option<bool>) -> hcm::http_connection_manager::UpgradeConfig {
        hcm::http_connection_manager::UpgradeConfig {
            upgrade_type: t.into(),
            enabled: enabled.map(|value| BoolValue { value }),
            ..Default::default()
        }
    }

    fn r(t: &str, enabled: Option<bool>) -> rpb::route_action::UpgradeConfig {
        rpb::route_action::UpgradeConfig {
            upgrade_type: t.into(),
            enabled: enabled.map(|value| BoolValue { value }),
            ..Default::default()
        }
    }

    #[test]
    fn the_connection_manager_list_decides_without_a_route_word() {
        let hcm = Upgrades::from_hcm(&[h("websocket", None), h("foo", Some(false))]).unwrap();
        assert!(allowed(&hcm, None, b"websocket"));
        assert!(allowed(&hcm, None, b"WebSocket"));
        assert!(!allowed(&hcm, None, b"foo"));
        assert!(!allowed(&hcm, None, b"bar"));
        let route = Upgrades::from_route(&[]).unwrap();
        assert!(allowed(&hcm, Some(&route), b"websocket"));
        assert!(!allowed(&Upgrades::default(), None, b"websocket"));
    }

    #[test]
    fn a_route_enables_or_disables_what_it_names() {
        let hcm = Upgrades::from_hcm(&[h("websocket", None), h("foo", Some(false))]).unwrap();
        let route = Upgrades::from_route(&[r("websocket", Some(false)), r("foo", None)]).unwrap();
        assert!(!allowed(&hcm, Some(&route), b"websocket"));
        assert!(allowed(&hcm, Some(&route), b"FOO"));
        // A route may enable a type the connection manager does not list at all.
        let none = Upgrades::default();
        let route = Upgrades::from_route(&[r("websocket", Some(true))]).unwrap();
        assert!(allowed(&none, Some(&route), b"websocket"));
        assert!(!allowed(&none, Some(&route), b"other"));
    }

    #[test]
    fn malformed_upgrade_configs_are_rejected() {
        let e = Upgrades::from_hcm(&[h("websocket", None), h("WEBSOCKET", None)]).unwrap_err();
        assert!(e.contains("multiple upgrade configs"), "{e}");
        let mut f = h("websocket", None);
        f.filters.push(Default::default());
        assert!(Upgrades::from_hcm(&[f]).unwrap_err().contains("filters"));
        let mut f = h("websocket", None);
        f.filters.push(hcm::HttpFilter {
            name: "envoy.filters.http.router".into(),
            config_type: Some(hcm::http_filter::ConfigType::TypedConfig(
                envoy_types::pb::google::protobuf::Any {
                    type_url: super::super::listener::ROUTER_TYPE.into(),
                    value: Vec::new(),
                },
            )),
            ..Default::default()
        });
        assert!(Upgrades::from_hcm(&[f]).is_ok());
        let e =
            Upgrades::from_route(&[r("websocket", None), r("websocket", Some(false))]).unwrap_err();
        assert_eq!(e, "Duplicate upgrade websocket");
        let e = Upgrades::from_route(&[r("websocket", None), r("WebSocket", None)]).unwrap_err();
        assert_eq!(e, "Duplicate upgrade WebSocket");
        let mut c = r("websocket", None);
        c.connect_config = Some(Default::default());
        assert!(Upgrades::from_route(&[c])
            .unwrap_err()
            .contains("ConnectConfig"));
        assert!(Upgrades::from_route(&[r("", None)]).is_err());
    }
}
