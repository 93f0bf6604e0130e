//! Istio objects to the xDS istiod sends an ingress gateway. Pure: config and node in,
//! resources and problems out.

use super::{Config, Invalid, NodeInfo, Options, Xds};

pub fn translate(_config: &Config, _node: &NodeInfo, _options: &Options) -> (Xds, Vec<Invalid>) {
    (Xds::default(), Vec::new())
}
