//! Istio config in, xDS out: the file-fed control plane (issue 4, in progress on this branch).

pub mod model;
